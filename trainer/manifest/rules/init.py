"""Rules of the `init:` section, reading only JSON and file headers (no torch): the Hugging Face directory's
config.json against `model:`, its weight files (a shard missing, a truncated safetensors file, a pickle not
allowed), and init.checkpoint being a committed step directory. validate and run; plan and dry-run skip them.

    manifests/ft.yaml:4:8: error: model.dim: 4096 != hidden_size 2048 in /models/x/config.json; set model.dim: 2048 ...
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from trainer.init.hf_dir import HFDirError, find_weights, read_config
from trainer.manifest.rules.finding import Finding
from trainer.models.hf_values import ConfigValueError
from trainer.manifest.schema import Manifest


def init_source(m: Manifest) -> Iterator[Finding]:
    """init.hf: config.json agrees with `model:` and every weight file is there and whole;
    init.checkpoint: a committed step directory. Neither is looked at once the run has a committed checkpoint
    of its own (or checkpoint.resume_from): it resumes from that, and `init` is not read again."""
    from trainer.init.precedence import starts_from_init
    from trainer.manifest.resolve import checkpoint_dir

    if not starts_from_init(m, checkpoint_dir(m)):
        return
    if m.init.hf:
        yield from hf_findings(m, Path(m.init.hf))
    if m.init.checkpoint:
        from trainer.checkpoint.integrity import COMMITTED
        from trainer.checkpoint.paths import STEP_NAME

        path = Path(m.init.checkpoint)
        if not STEP_NAME.fullmatch(path.name) or path.is_symlink() or not (path / COMMITTED).is_file():
            yield Finding("init.checkpoint", f"{path} is not a committed checkpoint (a step-NNNNNNNN directory "
                          f"with {COMMITTED}); name one of the run's step directories")


def hf_findings(m: Manifest, hf_dir: Path) -> Iterator[Finding]:
    from trainer.models import get_model_spec

    mapping = get_model_spec(m.model.kind).hf
    if mapping is None or mapping.section is None:
        yield Finding("init.hf", f"model.kind {m.model.kind} has no Hugging Face mapping to start from; "
                      "use a kind that has one (`mantra models`)")
        return
    try:
        config = read_config(hf_dir)
        theirs = mapping.section(config)
        find_weights(hf_dir, m.init.allow_pickle)
    except HFDirError as exc:
        yield Finding("init.hf", str(exc))
        return
    except (ValueError, KeyError, TypeError) as exc:  # the kind's refusal names the key; a key missing or mistyped
        said = f"{exc.key}: {exc.why}; {exc.fix}" if isinstance(exc, ConfigValueError) else \
            exc if isinstance(exc, ValueError) else repr(exc)
        yield Finding("init.hf", f"{hf_dir / 'config.json'}: {said}")
        return
    yield from model_mismatches(m, theirs, mapping.keys or {}, hf_dir / "config.json")
    yield from aux_loss_note(m, theirs, hf_dir / "config.json")


TRAINING_TERMS = ("kind", "balance", "capacity_factor")  # how a run trains, not what the weights are


def model_mismatches(m: Manifest, theirs: dict, keys: dict, config: Path) -> Iterator[Finding]:
    """One finding per `model:` field that differs from what config.json says (seq_len may be shorter: a run
    may train on shorter sequences than the model's context); a field config.json has no key for (an MoE's
    shared experts) is named by what the architecture implies."""
    for field, value in theirs.items():
        ours = getattr(m.model, field, None)
        if field == "kv_heads" and ours is None:  # unset: as many as heads
            ours = m.model.heads
        if field in TRAINING_TERMS or value is None or (field == "seq_len" and ours is not None and ours <= value):
            continue
        if ours != value and not (isinstance(value, float) and isinstance(ours, float)
                                  and abs(ours - value) <= 1e-12 * abs(value)):
            key = keys.get(field, f"{theirs['kind']}'s architecture")
            more = f"at most {_show(value)}" if field == "seq_len" else _show(value)
            yield Finding(f"model.{field}", f"{_show(ours)} != {key} {_show(value)} in {config}; set "
                          f"model.{field}: {more}, or point init.hf at the model this manifest describes")


def aux_loss_note(m: Manifest, theirs: dict, config: Path) -> Iterator[Finding]:
    """A warning when `model.balance.aux_loss` is on but is not the one config.json's training term maps to
    (a Mixtral's router_aux_loss_coef: HF's pooled form, trainer/models/moe/hf.py): another objective."""
    mapped = (theirs.get("balance") or {}).get("aux_loss")
    ours = getattr(getattr(m.model, "balance", None), "aux_loss", None)
    if mapped is None or ours is None:
        return
    if ours.model_dump(mode="json") != ours.model_validate(mapped).model_dump(mode="json"):
        yield Finding("model.balance.aux_loss", f"{config} was trained with router_aux_loss_coef "
                      f"{mapped['coeff']}, HF's aux loss of each forward pooled over the layers, which is "
                      f"{{form: pooled, scope: micro-batch, coeff: {mapped['coeff']}}}; set that to continue its "
                      "objective (per-layer averages each layer's loss: another function)", "warning")


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
