"""The runtime: the Backend protocol, the c10d backend, the executor, its programs, call resolution and
the pipelined primitives the ops and layers are built from."""

from commfuse.runtime.backend import Backend, Handle
from commfuse.runtime.calls import Call, choose_algorithm, resolve_call
from commfuse.runtime.executor import DEFAULT_TIMEOUT_S, Plan, Program, execute, measure, record_events

__all__ = [
    "DEFAULT_TIMEOUT_S", "Backend", "Call", "Handle", "Plan", "Program", "choose_algorithm", "execute", "measure",
    "record_events", "resolve_call",
]
