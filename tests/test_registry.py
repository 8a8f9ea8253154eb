"""The generic registry: duplicates, suggestions, entry-point plugins."""

from __future__ import annotations

import logging
import types

import pytest

import trainer.registry as registry_module
from trainer.registry import Registry, UnknownNameError


class FakeEntryPoint:
    def __init__(self, name: str, load: object) -> None:
        self.name, self.value, self._load = name, f"fake_plugin:{name}", load

    def load(self) -> object:
        return self._load() if callable(self._load) else self._load


class Spec:
    def __init__(self, name: str) -> None:
        self.name = name


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, found: list[FakeEntryPoint]) -> list[str]:
    asked: list[str] = []

    def entry_points(group: str) -> list[FakeEntryPoint]:
        asked.append(group)
        return found

    monkeypatch.setattr(registry_module, "entry_points", entry_points)
    return asked


def test_duplicate_name_raises() -> None:
    reg: Registry[object] = Registry("model kind")
    reg.add("llama", object())
    with pytest.raises(ValueError, match="model kind 'llama' is already registered"):
        reg.register("llama")(object())


def test_register_decorator_returns_object_and_get_finds_it() -> None:
    reg: Registry[object] = Registry("model kind")

    @reg.register("llama")
    def llama() -> None: ...

    assert reg.get("llama") is llama
    assert "llama" in reg and "gpt" not in reg
    reg.add("gpt", object())
    assert reg.names() == ["gpt", "llama"]


def test_unknown_name_suggests_nearest() -> None:
    reg: Registry[object] = Registry("model kind")
    reg.add("llama", object())
    reg.add("moe", object())
    with pytest.raises(UnknownNameError) as info:
        reg.get("lama")
    assert str(info.value) == "unknown model kind 'lama'; did you mean 'llama'? registered: llama, moe"
    assert isinstance(info.value, KeyError)
    with pytest.raises(UnknownNameError) as info:
        reg.get("zzz")
    assert str(info.value) == "unknown model kind 'zzz'; registered: llama, moe"


def test_plugins_load_lazily_and_broken_ones_are_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def explode() -> object:
        raise ImportError("no module named 'missing_dep'")

    good = Spec("good")
    asked = _fake_entry_points(
        monkeypatch,
        [FakeEntryPoint("broken", explode), FakeEntryPoint("good", good), FakeEntryPoint("wrong", 42)],
    )
    reg: Registry[Spec] = Registry("model kind", entry_point_group="mantra.models", item_type=Spec)
    assert asked == []  # nothing loads at construction
    with caplog.at_level(logging.WARNING, logger="trainer.registry"):
        assert reg.get("good") is good
    assert asked == ["mantra.models"]
    assert reg.names() == ["good"]
    assert asked == ["mantra.models"]  # loaded once
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'broken'" in m and "ImportError" in m and "missing_dep" in m for m in messages), messages
    assert any("'wrong'" in m and "expected a Spec" in m for m in messages), messages


def test_plugin_module_registers_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    reg: Registry[Spec] = Registry("model kind", entry_point_group="mantra.models", item_type=Spec)
    module = types.ModuleType("fake_plugin")

    def load() -> types.ModuleType:
        reg.add("mamba", Spec("mamba"))  # what the module's import would do
        return module

    _fake_entry_points(monkeypatch, [FakeEntryPoint("mamba_plugin", load)])
    assert reg.names() == ["mamba"]
    assert reg.get("mamba").name == "mamba"


def test_plugin_cannot_shadow_a_builtin(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    builtin, impostor = Spec("llama"), Spec("llama")
    _fake_entry_points(monkeypatch, [FakeEntryPoint("llama", impostor)])
    reg: Registry[Spec] = Registry("model kind", entry_point_group="mantra.models", item_type=Spec)
    reg.add("llama", builtin)
    with caplog.at_level(logging.WARNING, logger="trainer.registry"):
        assert reg.get("llama") is builtin
    assert any("already registered" in r.getMessage() for r in caplog.records)


def test_builtins_are_added_on_the_first_lookup_before_any_plugin(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    builtin, impostor, extra = Spec("llama"), Spec("llama"), Spec("mamba")
    asked = _fake_entry_points(monkeypatch, [FakeEntryPoint("llama", impostor), FakeEntryPoint("mamba", extra)])
    calls: list[int] = []

    def builtins() -> dict[str, Spec]:
        calls.append(1)
        return {"llama": builtin}

    reg: Registry[Spec] = Registry("model kind", entry_point_group="mantra.models", item_type=Spec, builtins=builtins)
    assert calls == [] and asked == []  # nothing loads at construction
    with caplog.at_level(logging.WARNING, logger="trainer.registry"):
        assert reg.get("llama") is builtin and reg.get("mamba") is extra
    assert reg.names() == ["llama", "mamba"] and calls == [1]  # once
    assert any("'llama'" in r.getMessage() and "already registered" in r.getMessage() for r in caplog.records)
    local: Registry[Spec] = Registry("model kind", builtins=lambda: {"llama": builtin})  # no entry points at all
    assert "llama" in local and local.names() == ["llama"]


def test_listing_entry_points_failing_is_not_fatal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def entry_points(group: str) -> list[FakeEntryPoint]:
        raise RuntimeError("corrupt metadata")

    monkeypatch.setattr(registry_module, "entry_points", entry_points)
    reg: Registry[object] = Registry("model kind", entry_point_group="mantra.models")
    with caplog.at_level(logging.WARNING, logger="trainer.registry"):
        assert reg.names() == []
    assert any("corrupt metadata" in r.getMessage() for r in caplog.records)


def test_model_registry_has_llama_and_suggests() -> None:
    from trainer.models import ModelSpec, get_model_spec, model_names

    spec = get_model_spec("llama")
    assert isinstance(spec, ModelSpec) and spec.name == "llama"
    assert "llama" in model_names()
    with pytest.raises(UnknownNameError, match=r"did you mean 'llama'\?"):
        get_model_spec("lama")


def test_each_kind_brings_a_model_section_class() -> None:
    """The `model:` section's class comes from the kind's spec: a ModelSection named by a Literal kind."""
    import typing

    from trainer.manifest.schema import ModelSection
    from trainer.models import config_class, get_model_spec, model_names
    from trainer.models.llama.config import LlamaConfig

    assert get_model_spec("llama").config is LlamaConfig is config_class("llama")
    for kind in model_names():
        config = config_class(kind)
        assert issubclass(config, ModelSection), kind
        assert typing.get_args(config.model_fields["kind"].annotation) == (kind,), kind
    assert not {"dim", "heads", "ffn_dim"} & set(ModelSection.model_fields)  # llama's fields are llama's
    with pytest.raises(UnknownNameError, match=r"did you mean 'llama'\?"):
        config_class("lama")
