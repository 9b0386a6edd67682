"""commfuse-template: the skeleton of a commfuse vendor backend (as shipped, gloo on CPU).

Three files make a backend: ``plugin.py`` (the record commfuse discovers
through the ``commfuse.backends`` entry point), ``backend.py`` (the object that
moves tensors) and ``conformance.py`` (what the backend can do, for the
conformance suite). See README.md.
"""

from __future__ import annotations

__version__ = "0.1.0"
