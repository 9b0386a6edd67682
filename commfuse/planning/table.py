"""The one table of what commfuse planned: one entry per call signature, one way to forget it all.

Each planning step keeps what it decided here under a key that starts with its kind (``"backend"``,
``"call"``, ``"plan"``, ``"schedule"``, ``"compiled"``, or an op's name), so a later call with the same
signature finds it in one dict look-up and decides nothing again. :func:`forget` clears the whole
table at once and runs the hooks registered with :func:`on_forget` (the runtime's group state, a
vendor's own caches). ``commfuse.backends.release`` calls it, and so do tests.

The table is bounded: past :data:`LIMIT` entries it is cleared, which costs only a re-plan.

An op's key carries ``commfuse.planning.calls.C10D_WORLD._default_pg`` (torch.distributed's default group in place): once
that group is destroyed, or destroyed and made again, the op's next call misses its old entries, and
planning it calls ``commfuse.backends.fresh``, which forgets them all. The repeated call reads one attribute
for this and calls nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LIMIT", "entries", "find", "forget", "get", "keys", "on_forget", "remember"]

#: Past this many entries the table is cleared (a program that keeps making new shapes re-plans; it never
#: grows without bound).
LIMIT = 8192

_ENTRIES: dict[tuple, Any] = {}
_LOCK = threading.Lock()
_HOOKS: list[Callable[[], None]] = []

#: The one look-up of the fast path: ``get(key)`` is the table's ``dict.get``, None when not planned.
get = _ENTRIES.get


def remember(key: tuple, value: Any) -> Any:
    """Keep ``value`` under ``key`` (a tuple that starts with its kind) and return what is kept: the first
    value, when two threads planned the same key at once, so every caller shares one entry."""
    with _LOCK:
        if len(_ENTRIES) >= LIMIT:
            _ENTRIES.clear()
        return _ENTRIES.setdefault(key, value)


def find(key: tuple, make: Callable[[], Any]) -> Any:
    """What is kept under ``key``, made by ``make()`` and kept the first time. An unhashable key (an
    option the caller cannot hash) is made every time and never kept."""
    try:
        found = _ENTRIES.get(key)
    except TypeError:
        return make()
    if found is None:
        found = remember(key, make())
    return found


def keys(kind: str | None = None) -> list[tuple]:
    """The keys the table holds (of one kind, when given): for tests."""
    return [key for key in list(_ENTRIES) if kind is None or (key and key[0] == kind)]


def entries(kind: str | None = None) -> int:
    """How many entries the table holds (of one kind, when given): for logs and tests."""
    if kind is None:
        return len(_ENTRIES)
    return sum(1 for key in list(_ENTRIES) if key and key[0] == kind)


def on_forget(hook: Callable[[], None]) -> None:
    """Have :func:`forget` call ``hook()`` too: state that is not a plan but must go with the plans (the
    runtime's per-group call numbers, a backend's buffers)."""
    _HOOKS.append(hook)


def forget() -> None:
    """Forget every planned entry and run the :func:`on_forget` hooks."""
    with _LOCK:
        _ENTRIES.clear()
    for hook in list(_HOOKS):
        hook()
