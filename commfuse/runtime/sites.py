"""Where commfuse runs in a model, and what each place took.

A *site* is one module that commfuse runs: a module a ``commfuse.tp`` style
was applied to, or a ``commfuse.nn`` layer. While a site's forward runs (in
eager mode) it is this thread's current site, and every call it resolves with
its own ``algorithm`` is written down on it: which collective, the ring hop's
bytes, what was taken and why. ``COMMFUSE_LOG=info`` prints that once per site
and signature, and each fallback to DTensor once per site and reason;
``commfuse.explain(model)`` lists every site of a model with what it took.

Under ``torch.compile`` a site's forward is traced, not run, so nothing is
written down on the site: the ops in the graph still log what ``auto`` took
for each new signature, without the site's name.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["Site", "at_site", "current", "fallback", "here", "layer_site", "saw", "took"]

log = logging.getLogger("commfuse")
class _Here(threading.local):
    #: None outside a site: a class attribute, so that reading it where nothing was set raises nothing (a
    #: failed look-up of a thread-local attribute costs microseconds inside a call: the flight recorder reads
    #: it on every call)
    site = None


#: ``here.site``: this thread's current site, or None (``at_site`` sets it; :func:`current` reads it)
here = _Here()

#: Signatures (collective, ring hop bytes) kept per site: a model whose sequence length changes every step
#: would otherwise grow the table without end.
MAX_TAKEN = 64


class Site:
    """One commfuse site: its kind (``commfuse.tp.ColwiseParallel``...), the object whose ``algorithm`` it
    runs (the style, or the layer itself), its group, its world size, and what it took once run."""

    __slots__ = ("kind", "owner", "group", "world_size", "described", "path", "taken", "fallbacks")

    def __init__(self, kind: str, owner, group, world_size: int, described: str) -> None:
        self.kind, self.owner, self.group, self.world_size = kind, owner, group, world_size
        self.described = described
        self.path: str | None = None  # the module's name in its model, once commfuse.explain has seen it
        self.taken: dict[tuple[str, int], tuple[str, str]] = {}  # (collective, hop bytes) -> (taken, why)
        self.fallbacks: list[str] = []

    @property
    def algorithm(self):
        return getattr(self.owner, "algorithm", None)

    @property
    def label(self) -> str:
        return self.path if self.path is not None else self.described

    @property
    def heading(self) -> str:
        """How its log lines begin: ``path (Kind, N ranks)``."""
        return f"{self.label} ({self.kind.rsplit('.', 1)[-1]}, {self.world_size} ranks)"

    def __repr__(self) -> str:
        return f"Site({self.kind!r} at {self.label!r}, world size {self.world_size}, algorithm {self.algorithm!r})"


#: The site entered last by any thread and not left yet (None outside every site): what the flight recorder
#: (``runtime.recorder``) files each call under. A module attribute, not a thread-local one: reading a
#: thread-local attribute cost the recorder almost a microsecond per call in the step loop (measured with
#: ``benchmarks/host_overhead.py --recorder``). With several threads inside sites at once, a call may be filed
#: under another thread's site; what the site decides (``here``) is per thread as before.
active: "Site | None" = None


class at_site:  # noqa: N801 - used as a statement: ``with at_site(site):``
    """Make ``site`` this thread's current site for the ``with`` block (and :data:`active`)."""

    __slots__ = ("site", "previous", "outer")

    def __init__(self, site: Site) -> None:
        self.site = site

    def __enter__(self) -> Site:
        global active
        self.previous = getattr(here, "site", None)
        here.site = self.site
        self.outer, active = active, self.site
        return self.site

    def __exit__(self, *exc) -> bool:
        global active
        here.site = self.previous
        active = self.outer
        return False


def current() -> Site | None:
    """This thread's current site, or None outside one."""
    return getattr(here, "site", None)


def saw(site: Site, collective, asked, slice_bytes: int, call) -> None:
    """``resolve_call`` resolved ``call`` for ``asked`` inside ``site`` (this thread's current one): if it is the
    site's own algorithm (not a small call of its own such as the sizes' exchange), write it down there, once
    per signature."""
    if asked != site.algorithm:
        return
    key = (getattr(collective, "value", str(collective)), int(slice_bytes))
    if key in site.taken or (not key[1] and any(c == key[0] for c, _ in site.taken)):
        return  # known; or a named algorithm's second look, which needs no hop size (0), at what is known
    took(site, key[0], key[1], call)


def took(site: Site | None, collective: str, slice_bytes: int, call, *, replace: bool = False) -> None:
    """Write down on ``site`` (None: the current one) that its ``collective`` of ``slice_bytes`` per ring hop
    takes ``call`` and why, and say so at INFO the first time. ``replace``: a layer that decides past
    ``resolve_call`` (MoE's two halves at two ranks) corrects what was written."""
    site = site if site is not None else getattr(here, "site", None)
    if site is None:
        return
    key = (collective, int(slice_bytes))
    if key in site.taken and not replace:
        return
    if key not in site.taken and len(site.taken) >= MAX_TAKEN:
        return
    shown = "nothing (world size 1)" if call is None or getattr(call, "be", None) is None else call.spec.shown
    why = "world size 1: nothing to communicate" if call is None else call.reason
    if site.taken.get(key) == (shown, why):
        return
    site.taken[key] = (shown, why)
    if log.isEnabledFor(logging.INFO):
        log.info("%s: %s%s takes %s: %s", site.heading, collective,
                 f" of {slice_bytes} bytes per hop" if slice_bytes else "", shown, why)


def fallback(message: str) -> None:
    """The current site moves an activation through DTensor instead of a fused op: write down why, once per
    site and reason, and say so at INFO. Outside a site, say it once per process."""
    site = getattr(here, "site", None)
    if site is None:
        from commfuse.log import once

        once(("fallback", message), "%s", message)
        return
    message = message.removeprefix(f"{site.kind}: ")
    if message in site.fallbacks or len(site.fallbacks) >= MAX_TAKEN:
        return
    site.fallbacks.append(message)
    log.info("%s: %s", site.heading, message)


def layer_site(layer) -> Site:
    """A ``commfuse.nn`` layer's site, made on first use and kept on the layer."""
    site = layer.__dict__.get("_commfuse_site")
    if site is None:
        kind = f"commfuse.nn.{type(layer).__name__}"
        shown = layer.extra_repr()
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        site = Site(kind, layer, getattr(layer, "group", None), int(getattr(layer, "world_size", 1)),
                    f"{type(layer).__name__}({shown})")
        layer.__dict__["_commfuse_site"] = site
    return site
