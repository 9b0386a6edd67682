"""commfuse: communication-computation overlap by collective decomposition.

The schedule core (``commfuse.schedule``) is pure Python; everything that needs
torch is imported on first use, so ``import commfuse`` stays cheap and never
pulls torch or a vendor runtime by itself.
"""

from __future__ import annotations

import importlib
import logging

from commfuse import log as _log
from commfuse import schedule
from commfuse.errors import CommfuseError
from commfuse.runtime.env import choice as _choice

__version__ = "0.1.0"

# The library logs on "commfuse" (auto's choices, DTensor fallbacks) and leaves handlers to the application,
# unless COMMFUSE_LOG=info or debug asks for short rank-prefixed lines on stderr (commfuse.log).
logging.getLogger("commfuse").addHandler(logging.NullHandler())
_log.configure(_choice("COMMFUSE_LOG", None, _log.WORDS))

_LAZY = {
    "all_gather_matmul": "commfuse.ops",
    "matmul_reduce_scatter": "commfuse.ops",
    "all_gather_consume": "commfuse.ops",
    "produce_reduce_scatter": "commfuse.ops",
    "all_to_all_consume": "commfuse.ops",
    "produce_all_to_all": "commfuse.ops",
    "ring_attention": "commfuse.ops",
    "choose_algorithm": "commfuse.ops",
    "explain": "commfuse._explain",
    "backends": None,
    "context": None,
    "ops": None,
    "launch": None,
    "nn": None,
    "tp": None,
    "fsdp": None,
    "ep": None,
    "autograd": None,
    "library": None,
    "graphs": None,
    "metrics": None,
}

__all__ = ["CommfuseError", "__version__", "schedule", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'commfuse' has no attribute {name!r}")
    module = _LAZY[name]
    value = importlib.import_module(f"commfuse.{name}") if module is None else getattr(
        importlib.import_module(module), name)
    globals()[name] = value
    return value
