"""commfuse: communication-computation overlap by collective decomposition.

The schedule core (``commfuse.schedule``) is pure Python; everything that needs
torch is imported on first use, so ``import commfuse`` stays cheap.
"""

from __future__ import annotations

from commfuse import schedule
from commfuse.errors import CommfuseError

__version__ = "0.1.0"

__all__ = ["CommfuseError", "__version__", "schedule"]
