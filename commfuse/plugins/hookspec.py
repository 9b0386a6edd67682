"""The plugin contract of commfuse: every hook a plugin can implement, in one place.

A backend distribution points an entry point of group ``commfuse.backends`` at a
module (or object) that implements the hooks below, marked with ``hookimpl``::

    # pyproject.toml of commfuse-mydevice
    [project.entry-points."commfuse.backends"]
    mydevice = "commfuse_mydevice.plugin"

    # commfuse_mydevice/plugin.py
    from commfuse.plugins import BackendSpec, Capabilities, hookimpl

    @hookimpl
    def commfuse_backends():
        yield BackendSpec(name="mydevice", device_types=("mydevice",), ...)

The built-in backends (``commfuse.plugins.builtin``) implement the same hook.
"""

from __future__ import annotations

from collections.abc import Iterable

import pluggy

from commfuse.plugins.types import BackendSpec

PROJECT = "commfuse"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def commfuse_backends() -> Iterable[BackendSpec]:
    """The backends this plugin provides.

    Return an iterable of :class:`~commfuse.plugins.BackendSpec` or yield them
    one by one; a plugin may provide several. Keep it cheap and free of torch
    and vendor imports: it runs whenever commfuse lists backends. Put anything
    that needs the device into the spec's ``check`` and ``factory``.
    """
