"""The runtime: the Backend protocol, the c10d backend, group state and call numbering (``groups``), the
compiled plan (``compiled``), what observes a call (``observe``) and the walks of a rank's steps
(``walks``: a call admitted by ``admission``, built of ``steps``, finished after a failure by ``finishing``),
with the programs that hold a call's data (``programs``), and the flight recorder that keeps
each group's last calls (``recorder``). It executes what the planning layer
(``commfuse.planning``) hands it and imports nothing above itself."""

from commfuse.runtime.protocol import Backend, Handle
from commfuse.runtime.compiled import Plan, Program
from commfuse.runtime.groups import DEFAULT_TIMEOUT_S
from commfuse.runtime.walks import execute
from commfuse.runtime.observe import measure, record_events

__all__ = ["DEFAULT_TIMEOUT_S", "Backend", "Handle", "Plan", "Program", "execute", "measure", "record_events"]
