"""The runtime: the Backend protocol, the c10d backend, the executor and its programs."""

from commfuse.runtime.backend import Backend, Handle
from commfuse.runtime.executor import DEFAULT_TIMEOUT_S, Program, execute, measure, record_events

__all__ = ["DEFAULT_TIMEOUT_S", "Backend", "Handle", "Program", "execute", "measure", "record_events"]
