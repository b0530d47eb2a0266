"""One registry type for every pluggable family (quantizers, schedules,
optimizers, data sources, metrics, model adapters).

    SCHEDULES = Registry("schedule")

    @SCHEDULES.register("wsd")
    def wsd(step, cfg): ...

    SCHEDULES.get("wds")   # QuantdynError: unknown schedule 'wds' (did you mean 'wsd'?)

Registration happens when the module defining the entries is imported; each
family's package imports its entry modules in its ``__init__`` so that
``get`` sees every built-in name.

Some names cannot be listed in advance (a quantizer ``plan:FILE`` is made from
the file it names): ``add_family(prefix, make, canonical)`` registers every name
that starts with ``prefix``; ``get`` makes its entry on first use (cached) and
``canonical(name)`` gives the one spelling such a name is stored under.
"""
from __future__ import annotations

import threading
from typing import Callable, Generic, Iterator, TypeVar

from quantdyn.errors import unknown_name

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> object map with a duplicate-name error and did-you-mean lookup."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._families: dict[str, tuple[Callable[[str], T], Callable[[str], str]]] = {}
        self._made: dict[str, T] = {}

    def add_family(self, prefix: str, make: Callable[[str], T], canonical: Callable[[str], str]) -> None:
        """Every name starting with ``prefix``: ``make(name)`` builds its entry on first lookup (QuantdynError for
        a bad one), ``canonical(name)`` its one spelling. Family names are not listed by ``names()``."""
        if prefix in self._families or any(n.startswith(prefix) for n in self._entries_so_far()):
            raise ValueError(f"{self.kind} family '{prefix}' is registered twice or shadows a name")
        self._families[prefix] = (make, canonical)

    def _entries_so_far(self) -> dict[str, T]:
        """The entries registered until now (LazyRegistry: without loading its built-ins)."""
        return self._entries

    def _family(self, name: object) -> tuple[Callable[[str], T], Callable[[str], str]] | None:
        if not isinstance(name, str):
            return None
        return next((f for prefix, f in self._families.items() if name.startswith(prefix)), None)

    def canonical(self, name: str) -> str | None:
        """The canonical spelling of a family name (may read what the name points to), None for other names."""
        family = self._family(name)
        return family[1](name) if family is not None else None

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` as ``name`` and return it (``PTQ = ROW_KINDS.add("ptq", RowKind(...))``)."""
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        if self._family(name) is not None:
            raise ValueError(f"{self.kind} '{name}' is shadowed by a family of names")
        self._entries[name] = obj
        return obj

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            family = self._family(name)
            if family is None:
                raise unknown_name(self.kind, name, self._entries) from None
        if name not in self._made:
            self._made[name] = family[0](name)
        return self._made[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def values(self) -> list[T]:
        """The registered objects in the order they were registered (where the order is shown: the report's
        sections, the findings' families)."""
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return self._family(name) is not None or name in self._entries  # a family name loads nothing

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)


class LazyRegistry(Registry[T]):
    """A registry whose built-in entries are registered by modules imported on first use: ``load()`` imports
    them before the first lookup or addition, so that the family's package imports without them (the quantizers'
    catalogue without torch: a mistyped label is refused in a second).  ``loaded`` says whether that happened.
    Another thread that looks up while one loads waits for it."""

    def __init__(self, kind: str, load: Callable[[], object]):
        self._load: Callable[[], object] | None = load
        self._loading = False
        self._lock = threading.RLock()
        super().__init__(kind)

    @property
    def loaded(self) -> bool:
        return self._load is None

    @property
    def _entries(self) -> dict[str, T]:
        if self._load is not None:
            with self._lock:  # reentrant: the modules being loaded add their entries through here
                if self._load is not None and not self._loading:
                    self._loading = True
                    try:
                        self._load()
                        self._load = None
                    finally:
                        self._loading = False
        return self.__dict__["_entries"]

    def _entries_so_far(self) -> dict[str, T]:
        return self.__dict__["_entries"]  # a family declared beside the lazy built-ins must not load them

    @_entries.setter
    def _entries(self, value: dict[str, T]) -> None:
        self.__dict__["_entries"] = value
