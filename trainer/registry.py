"""One generic name -> object registry: a decorator in-tree, entry points outside.

    MODELS = Registry("model kind", entry_point_group="mantra.models")

    @MODELS.register("llama")
    def ...

Duplicate names raise; a miss suggests the nearest name. The in-tree items can
be given as a function (`builtins`) called on the first lookup, so the registry's
module imports none of them. Third-party plugins come through `importlib.metadata`
entry points and load lazily, on the first lookup, after the built-ins: each entry
point loads either an object (added under the entry point's name) or a module whose
import registered itself. A plugin that fails to load, has the wrong type or
reuses a taken name is logged and skipped, never fatal. Torch-free on purpose.
"""

from __future__ import annotations

import difflib
import logging
import types
from collections.abc import Callable, Iterator, Mapping
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class UnknownNameError(KeyError):
    """A name nobody registered; the message names the nearest match and all choices."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class Registry(Generic[T]):
    """Names -> objects of one kind, e.g. Registry("model kind", "mantra.models")."""

    def __init__(
        self, kind: str, entry_point_group: str | None = None, *, item_type: type | None = None,
        builtins: Callable[[], Mapping[str, T]] | None = None,
    ) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.item_type = item_type  # plugins whose object is not of this type are skipped
        self.builtins = builtins  # the in-tree items, added (before any plugin) on the first lookup
        self._items: dict[str, T] = {}
        self._plugins_loaded = entry_point_group is None and builtins is None

    def add(self, name: str, obj: T) -> T:
        """Register `obj` under `name`; a name registered twice is a ValueError."""
        if name in self._items:
            raise ValueError(f"{self.kind} '{name}' is already registered")
        self._items[name] = obj
        return obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`; returns the object unchanged."""

        def decorator(obj: T) -> T:
            return self.add(name, obj)

        return decorator

    def get(self, name: str) -> T:
        """The object registered under `name`, or UnknownNameError with a suggestion."""
        self._load_plugins()
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(self._unknown_message(name)) from None

    def names(self) -> list[str]:
        """All registered names, sorted."""
        self._load_plugins()
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        self._load_plugins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, entry_point_group={self.entry_point_group!r})"

    def _unknown_message(self, name: str) -> str:
        names = sorted(self._items)
        message = f"unknown {self.kind} '{name}'"
        close = difflib.get_close_matches(name, names, n=1)
        if close:
            message += f"; did you mean '{close[0]}'?"
        else:
            message += ";"
        return f"{message} registered: {', '.join(names) or 'none'}"

    def _load_plugins(self) -> None:
        """Add the built-ins, then load every entry point of the group, once; only a built-in's name taken
        already raises."""
        if self._plugins_loaded:
            return
        self._plugins_loaded = True  # first, so a plugin that looks itself up does not recurse
        for name, obj in (self.builtins() if self.builtins is not None else {}).items():
            self.add(name, obj)
        if self.entry_point_group is None:
            return
        try:
            found = list(entry_points(group=self.entry_point_group))
        except Exception as exc:  # a broken installed distribution must not stop training
            log.warning("cannot list %s plugins (%s): %s", self.kind, self.entry_point_group, exc)
            return
        for entry_point in found:
            self._load_one(entry_point)

    def _load_one(self, entry_point: Any) -> None:
        name, where = entry_point.name, getattr(entry_point, "value", "?")
        if name in self._items:
            log.warning("skipping %s plugin '%s' (%s): the name is already registered", self.kind, name, where)
            return
        try:
            obj = entry_point.load()
        except Exception as exc:
            log.warning("skipping %s plugin '%s' (%s): %s: %s", self.kind, name, where, type(exc).__name__, exc)
            return
        if isinstance(obj, types.ModuleType):
            return  # importing the module registered what it provides
        if self.item_type is not None and not isinstance(obj, self.item_type):
            log.warning(
                "skipping %s plugin '%s' (%s): got %s, expected a %s or a module",
                self.kind, name, where, type(obj).__name__, self.item_type.__name__,
            )
            return
        self._items[name] = obj
