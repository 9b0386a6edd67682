"""The plugin system every backend arrives through, built-ins included.

``hookspec`` holds the contract (the ``commfuse_backends`` hook), ``types`` the
records a plugin yields, ``manager`` the discovery over the ``commfuse.backends``
entry point group, and ``builtin`` the ``gloo`` and ``accelerator`` backends.
Users pick backends through :mod:`commfuse.backends`; plugin authors need only
the names exported here. Nothing in this package imports torch at import time.
"""

# Only the implementation marker: ``hookspec`` stays the name of the contract module.
from commfuse.plugins.hookspec import hookimpl
from commfuse.plugins.manager import GROUP, get_plugin_manager, refresh
from commfuse.plugins.types import ACCELERATOR, COLLECTIVES, EXECUTIONS, Availability, BackendSpec, Capabilities

__all__ = [
    "ACCELERATOR",
    "COLLECTIVES",
    "EXECUTIONS",
    "GROUP",
    "Availability",
    "BackendSpec",
    "Capabilities",
    "get_plugin_manager",
    "hookimpl",
    "refresh",
]
