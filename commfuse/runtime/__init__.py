"""The runtime: the Backend protocol, the c10d backend, group state and call numbering (``groups``), the
compiled plan (``compiled``), what observes a call (``observe``) and the walks of a rank's steps
(``walks``: a call admitted by ``admission``, built of ``steps``, finished after a failure by ``finishing``),
with the programs that hold a call's data (``programs``), and the flight recorder that keeps
each group's last calls (``recorder``). It executes what the planning layer
(``commfuse.planning``) hands it and imports nothing above itself.

The names below are imported when first asked for, so that ``commfuse.runtime.env`` (what ``import
commfuse`` reads ``COMMFUSE_LOG`` with) comes without torch."""

from __future__ import annotations

import importlib

__all__ = ["DEFAULT_TIMEOUT_S", "Backend", "Handle", "Plan", "Program", "execute", "measure", "record_events"]

#: Each public name and the module that holds it.
_HOMES = {
    "Backend": "protocol", "Handle": "protocol", "Plan": "compiled", "Program": "compiled",
    "DEFAULT_TIMEOUT_S": "groups", "execute": "walks", "measure": "observe", "record_events": "observe",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'commfuse.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"commfuse.runtime.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
