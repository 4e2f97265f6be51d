"""A minimal name -> object registry, shared by tasks, rewards and rollout engines.

Registration is explicit (a decorator at the definition), a duplicate name is an error, and an
unknown name raises with the valid names, so configs fail loudly and `tether list` can read
`names()`. There is no discovery by subclassing and no integer indices.
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one kind ("task", "reward", ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering its argument under `name`; raises if the name is taken."""

        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        """The entry called `name`; an unknown name raises listing the valid (and nearest) ones."""
        if name not in self._entries:
            near = difflib.get_close_matches(name, self._entries, n=3)
            hint = f" Did you mean {near}?" if near else ""
            raise ValueError(
                f"unknown {self.kind} {name!r}; valid: {self.names()}.{hint}"
            )
        return self._entries[name]

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
