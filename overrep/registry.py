"""One registry per kind of extension: criteria, benchmarks (and, by the same pattern, methods).

An extension is one entry object with a ``name`` and a one-line ``description``, plus
whatever its kind needs (an entry point, a metric, ...). Registering it is the one edit that
makes it known: command-line help, config validation and error messages read the registry,
so no list of names is kept by hand anywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator, TypeVar

from .errors import OverRepError

T = TypeVar("T")


class Registry(Mapping[str, T]):
    """An ordered, read-only ``name -> entry`` mapping, filled by :meth:`register`.

    ``registry[name]`` raises an :class:`OverRepError` that names the choices.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, entry: T) -> T:
        name = getattr(entry, "name")
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise OverRepError(f"unknown {self.kind} '{name}'; available: {', '.join(self._entries)}") from None

    def __contains__(self, name: object) -> bool:  # Mapping's default would go through __getitem__
        return name in self._entries

    def get(self, name: str, default=None):
        return self._entries.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def choices(self, sep: str = ", ") -> str:
        """The registered names, for help text: ``"a, b, c"``."""
        return sep.join(self._entries)

    def describe(self, indent: str = "  ") -> str:
        """One ``name  description`` line per entry, aligned."""
        width = max((len(n) for n in self._entries), default=0)
        return "\n".join(f"{indent}{n:{width}s}  {getattr(e, 'description', '')}" for n, e in self._entries.items())
