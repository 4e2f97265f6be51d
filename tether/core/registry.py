"""A small, explicit name -> object registry.

Registration is by decorator; a duplicate name is an error (two things silently sharing a
name is how a preset ends up running the wrong math); an unknown name raises with the valid
names and the closest matches (`did_you_mean`, which the config, task and reward errors outside the
core use too). Pure Python: no imports from the rest of tether.
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")


def did_you_mean(name: object, valid: Iterable[str]) -> str:
    """' Did you mean 'a', 'b'?' naming the (at most 3) valid names closest to `name`, or '' when none
    is close: the one hint every "unknown name / key / knob / parameter" error in tether gives."""
    close = difflib.get_close_matches(str(name), list(valid), n=3, cutoff=0.5)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def unknown_name_message(kind: str, name: object, valid: list[str]) -> str:
    """The one wording every "unknown X" error uses: what was asked, what exists, what is close."""
    valid = list(dict.fromkeys(valid))  # each name once, in order (a preset may share an objective's name)
    return f"unknown {kind} {name!r}.{did_you_mean(name, valid)} Valid: {', '.join(valid)}."


class Registry(Generic[T]):
    """Maps names to registered objects (functions or classes) of one kind."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise KeyError(unknown_name_message(self.kind, name, self.names())) from None

    def names(self) -> list[str]:
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)
