"""Finds every backend: the built-ins, then each entry point of group ``commfuse.backends``.

Discovery runs once and is cached; :func:`refresh` runs it again (after
installing a plugin in a live process, and in tests). The built-in module is
registered directly with the pluggy plugin manager and answers the same
``commfuse_backends`` hook as third-party plugins.

A third-party plugin cannot break commfuse: an entry point that fails to import,
a hook that raises or yields something other than a ``BackendSpec``, is warned
about (:class:`~commfuse.errors.CommfuseWarning`, naming the entry point, its
distribution and the exception) and skipped, and the others still load. Two
backends with one name are an error, since which one ``get(name)`` returns
would otherwise depend on install order.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace
from importlib.metadata import EntryPoint, entry_points

import pluggy

from commfuse.errors import CommfuseWarning, PluginError
from commfuse.plugins import builtin, hookspec
from commfuse.plugins.types import Availability, BackendSpec

#: The entry point group backend distributions register under.
GROUP = "commfuse.backends"
_BUILTIN = "commfuse.builtin"


@dataclass(frozen=True)
class _Origin:
    """Where a registered plugin came from, for messages and ``BackendSpec.distribution``."""

    distribution: str
    entry_point: str

    def __str__(self) -> str:
        return f"entry point {self.entry_point!r} of distribution {self.distribution!r}"


class Registry:
    """The result of one discovery: the plugin manager, the specs by name, their memoised availability."""

    def __init__(self, plugin_manager: pluggy.PluginManager, specs: dict[str, BackendSpec]):
        self.plugin_manager = plugin_manager
        self.specs = dict(sorted(specs.items()))
        self._availability: dict[str, Availability] = {}
        self._lock = threading.RLock()

    def availability(self, spec: BackendSpec) -> Availability:
        # Checks may import torch or probe drivers: run each once per discovery.
        with self._lock:
            if spec.name not in self._availability:
                self._availability[spec.name] = check_availability(spec)
            return self._availability[spec.name]


_lock = threading.RLock()
_current: Registry | None = None


def registry() -> Registry:
    """The cached discovery, made on first use."""
    global _current
    with _lock:
        if _current is None:
            _current = _discover()
        return _current


def refresh() -> None:
    """Forget the cached discovery and run it again (raises ``PluginError`` on a name clash)."""
    global _current
    with _lock:
        _current = None
        registry()


def get_plugin_manager() -> pluggy.PluginManager:
    """The pluggy plugin manager holding the built-in and every loaded plugin."""
    return registry().plugin_manager


def backend_specs() -> dict[str, BackendSpec]:
    """Every backend found, by name, sorted by name."""
    return dict(registry().specs)


def check_availability(spec: BackendSpec) -> Availability:
    """Run ``spec.check()`` so that it cannot raise: an exception or a wrong return becomes ``Availability.no``."""
    fix = f"this is a bug in {spec.distribution!r}: report it to its maintainers, or uninstall it"
    try:
        result = spec.check()
    except Exception as e:  # noqa: BLE001 - a check must never take commfuse down with it
        return Availability.no(f"its availability check raised {type(e).__name__}: {e}", fix)
    if not isinstance(result, Availability):
        return Availability.no(
            f"its availability check returned {type(result).__name__} {result!r}, not an Availability", fix
        )
    return result


def _discover() -> Registry:
    # Distributions and modules may have been written since the last discovery.
    importlib.invalidate_caches()
    pm = pluggy.PluginManager(hookspec.PROJECT)
    pm.add_hookspecs(hookspec)
    origins = {_BUILTIN: _Origin("commfuse", builtin.__name__)}
    pm.register(builtin, name=_BUILTIN)

    for ep in sorted(entry_points(group=GROUP), key=lambda ep: (_distribution(ep), ep.name)):
        origin = _Origin(_distribution(ep), f"{ep.name} = {ep.value}")
        plugin_name = f"{origin.distribution}:{ep.name}"
        try:
            plugin = ep.load()
            pm.register(plugin, name=plugin_name)
        except Exception as e:  # noqa: BLE001 - any failure to import skips this plugin only
            if pm.get_plugin(plugin_name) is not None:  # failed validation half-way through register()
                pm.unregister(name=plugin_name)
            _skip(origin, "it failed to load", e)
            continue
        hooks = [caller.name for caller in pm.get_hookcallers(plugin) or ()]
        if "commfuse_backends" not in hooks:
            pm.unregister(plugin)
            found = f"it implements only {hooks}" if hooks else "it implements no commfuse hook"
            _skip(origin, f"{found}; mark a function `commfuse_backends` with @commfuse.plugins.hookimpl")
            continue
        origins[plugin_name] = origin

    specs: dict[str, BackendSpec] = {}
    spec_origins: dict[str, _Origin] = {}
    # Each implementation is called on its own (not through pm.hook) so one failing plugin skips only itself.
    for impl in pm.hook.commfuse_backends.get_hookimpls():
        origin = origins[impl.plugin_name]
        try:
            found = _records(impl.function())
        except Exception as e:  # noqa: BLE001 - includes invalid BackendSpec fields raised while yielding
            _skip(origin, "its commfuse_backends hook failed", e)
            continue
        for spec in found:
            spec = replace(spec, distribution=origin.distribution)
            if spec.name in specs:
                raise PluginError(
                    f"two backends are named {spec.name!r}: one from {spec_origins[spec.name]}, one from {origin}; "
                    f"uninstall {spec_origins[spec.name].distribution!r} or {origin.distribution!r}"
                )
            specs[spec.name] = spec
            spec_origins[spec.name] = origin
    return Registry(pm, specs)


def _records(result: object) -> list[BackendSpec]:
    """The BackendSpecs a hook returned or yielded (a single spec or None also accepted)."""
    if result is None:
        return []
    if isinstance(result, BackendSpec):
        return [result]
    if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
        raise PluginError(f"it returned {type(result).__name__} {result!r}, not BackendSpec records")
    records = list(result)
    for item in records:
        if not isinstance(item, BackendSpec):
            raise PluginError(f"it yielded {type(item).__name__} {item!r}, not a commfuse.plugins.BackendSpec")
    return records


def _distribution(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else "<unknown distribution>"


def _skip(origin: _Origin, what: str, error: BaseException | None = None) -> None:
    cause = f": {type(error).__name__}: {error}" if error is not None else ""
    warnings.warn(f"commfuse skipped the backend plugin at {origin}: {what}{cause}", CommfuseWarning, stacklevel=3)
