"""Where commfuse runs in a model, and what each place took.

A *site* is one module that commfuse runs: a module a ``commfuse.tp`` style
was applied to, or a ``commfuse.nn`` layer. While a site's forward runs (in
eager mode) it is this thread's current site, and every call it makes with
its own ``algorithm`` is written down on it: which collective, the ring hop's
bytes, what was taken and why. ``COMMFUSE_LOG=info`` prints that once per site
and signature, and each fallback to DTensor once per site and reason;
``commfuse.explain(model)`` lists every site of a model with what it took.

Every site is named by its module path in the model, whether or not
``commfuse.explain`` saw the model: at a site's first forward, the outermost
module whose forward is running (read from this thread's stack) is walked
once, and every site under it is named. A ``CommfuseError`` that leaves a
site's forward (a call's failure, a timeout, a mismatch, bad input) is named
by it: its message begins with the site's path, kind and world size, and the
flight recorder files each call under its site, so ``commfuse trace
analyze`` says the path too.

Identical layers share one plan per call signature, so the fused matmul ops'
repeated calls find their plan without resolving anything (the fast path of
``commfuse.ops``). So that each of them still says what it took, a site
*watches* its forward when something was planned since its last one (its
first forward, or a new signature anywhere): while any site watches, the fast
path's look-up tells the thread's site what the entry it found took, as
planning the entry told the site that planned it. When no site is due to
watch, the sites and the fast path run as they did before any of this
(``at_site`` takes its plain methods, the ops their plain look-up): the
repeated call pays nothing for it.

Under ``torch.compile`` a site's forward is traced, not run, so nothing is
written down on the site: the ops in the graph still log what ``auto`` took
for each new signature, without the site's name.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Callable

from commfuse.errors import CommfuseError

__all__ = ["Site", "at_site", "current", "fallback", "here", "layer_site", "module_paths", "name_error",
           "on_watch", "planned", "saw", "site_of", "took"]

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

#: The attribute :func:`commfuse.nn._common.site_forward` sets on the method it makes: a module whose class has
#: one is a ``commfuse.nn`` layer, and so a site (made when first asked for: :func:`layer_site`).
LAYER_FORWARD = "_commfuse_site_forward"

#: Module names that torch's wrappers put into a path (``torch.compile``'s, ``checkpoint_wrapper``'s), left out
#: of a site's path as torch's distributed checkpoint leaves them out of a parameter's name.
WRAPPERS = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})


class Site:
    """One commfuse site: its kind (``commfuse.tp.ColwiseParallel``...), the style whose ``algorithm`` it runs
    (None for a layer: its own), its group, its world size, its module (a weak reference: the flight recorder
    keeps sites after their model is gone), its path in the model once known, and what it took once run."""

    __slots__ = ("kind", "owner", "group", "world_size", "described", "path", "taken", "fallbacks", "module",
                 "seen")

    def __init__(self, kind: str, owner, group, world_size: int, described: str, module) -> None:
        self.kind, self.owner, self.group, self.world_size = kind, owner, group, world_size
        self.described = described
        #: the module's path in its model: named at the site's first forward, or by commfuse.explain
        self.path: str | None = None
        self.taken: dict[tuple[str, int], tuple[str, str]] = {}  # (collective, hop bytes) -> (taken, why)
        self.fallbacks: list[str] = []
        self.module = weakref.ref(module, _gone)
        #: the planning generation its last forward watched (-1: no forward has completed)
        self.seen = -1
        _born(self)

    @property
    def algorithm(self):
        owner = self.owner if self.owner is not None else self.module()
        return getattr(owner, "algorithm", None)

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

# -- watching: which sites' next forward tells them what the fast path found ------------------------------------

#: bumped by :func:`planned` (a new entry on a fast path); a site whose ``seen`` differs is due to watch
generation = 0
#: every site whose module lives, and those due to watch their next forward, under their modules' weak references
#: (a module collected takes its site out of both: :func:`_gone`)
_live: "dict[weakref.ref, Site]" = {}
_due: "dict[weakref.ref, Site]" = {}
_watching = 0  # forwards watching now, over all threads
_switches: list[Callable[[bool], None]] = []
_lock = threading.RLock()  # reentrant: a reference's callback may run inside a block that holds it


def on_watch(switch: Callable[[bool], None]) -> None:
    """Have ``switch(True)`` called when a site starts watching its forward while none watched, and
    ``switch(False)`` when the last one stops: how ``commfuse.ops`` turns its fast path's watching look-up on
    and off."""
    _switches.append(switch)


def planned() -> None:
    """A new entry was planned on a fast path (the fused matmul ops' table): every site's next forward watches,
    so that the sites whose calls find it there, planned for another, say what it took."""
    global generation
    with _lock:
        generation += 1
        _due.update(_live)
        if _due:
            _arm()


def _born(site: Site) -> None:
    with _lock:
        _live[site.module] = _due[site.module] = site
        _arm()


def _gone(ref: weakref.ref) -> None:
    """A site's module was collected (a model let go): it is no site to wait for any more."""
    with _lock:
        _live.pop(ref, None)
        _due.pop(ref, None)
        _disarm()


def _arm() -> None:
    at_site.__enter__, at_site.__exit__ = at_site._enter_watching, at_site._exit_watching


def _disarm() -> None:
    """The plain methods again, once no site is due and none watches (under ``_lock``)."""
    if not _due and not _watching:
        at_site.__enter__, at_site.__exit__ = at_site._enter, at_site._exit


def _switch(on: bool) -> None:
    """Turn the fast paths' watching look-ups on or off (under ``_lock``)."""
    for switch in _switches:
        switch(on)


class at_site:  # noqa: N801 - used as a statement: ``with at_site(site):``
    """Make ``site`` this thread's current site for the ``with`` block (and :data:`active`); a
    ``CommfuseError`` leaving the block is named by the site (:func:`name_error`).

    While some site is due to watch (:func:`planned`), ``__enter__`` and ``__exit__`` are the watching
    methods, which name a site at its first forward and watch a due one; else the plain ones."""

    __slots__ = ("site", "previous", "outer", "watched")

    def __init__(self, site: Site) -> None:
        self.site = site

    def _enter(self) -> Site:
        global active
        self.previous = getattr(here, "site", None)
        here.site = self.site
        self.outer, active = active, self.site
        return self.site

    def _exit(self, kind, error, tb) -> bool:
        global active
        here.site = self.previous
        active = self.outer
        if error is not None:
            name_error(error, self.site)
        return False

    __enter__, __exit__ = _enter, _exit

    def _enter_watching(self) -> Site:
        global _watching
        site = self.site
        if site.seen == generation:
            self.watched = None
        else:
            if site.seen < 0 and site.path is None:
                _name(site)
            with _lock:
                self.watched = generation
                _watching += 1
                if _watching == 1:
                    _switch(True)
        return self._enter()

    def _exit_watching(self, kind, error, tb) -> bool:
        global _watching
        self._exit(kind, error, tb)
        try:
            watched = self.watched  # None: not due
        except AttributeError:  # entered by the plain method: a site fell due during this forward
            return False
        if watched is None:
            return False
        site = self.site
        with _lock:
            _watching -= 1
            if error is None:  # a forward that raised may not have made every call: it watches again
                site.seen = watched
                if watched == generation:
                    _due.pop(site.module, None)
            if not _watching:
                _switch(False)
            _disarm()
        return False


def current() -> Site | None:
    """This thread's current site, or None outside one."""
    return getattr(here, "site", None)


# -- names ------------------------------------------------------------------------------------------------------


def site_of(module) -> Site | None:
    """``module``'s site: the one a style made, or a ``commfuse.nn`` layer's (made now if need be); None if it
    is no site."""
    site = module.__dict__.get("_commfuse_site")
    if site is None and _is_layer(type(module)):
        site = layer_site(module)
    return site


_layer_classes: dict[type, bool] = {}


def _is_layer(cls: type) -> bool:
    """Whether ``cls`` runs a forward as a site (a method of it or of a base was made by ``site_forward``)."""
    known = _layer_classes.get(cls)
    if known is None:
        known = _layer_classes[cls] = any(getattr(value, LAYER_FORWARD, False)
                                          for base in cls.__mro__ for value in vars(base).values())
    return known


def module_paths(model):
    """``(path, module)`` for every module of ``model`` (``named_modules``), each path as in the model the user
    wrapped: the names in :data:`WRAPPERS` left out."""
    for path, module in model.named_modules():
        yield ".".join(p for p in path.split(".") if p not in WRAPPERS) if path else "", module


def _callers() -> list:
    """The modules whose ``__call__`` runs on this thread, outermost first (read from the frames of
    ``nn.Module``'s call)."""
    from torch import nn

    code = nn.Module._call_impl.__code__
    found = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                found.append(module)
        frame = frame.f_back
    found.reverse()
    return found


def _name(site: Site) -> None:
    """Name ``site`` (and every other site on the way) by its path in the outermost module running whose
    modules hold it. A site whose module runs on its own, as the model itself, keeps its description."""
    module = site.module()
    if module is None:
        return
    try:
        for root in _callers():
            if root is module:
                return
            held = False
            for path, m in module_paths(root):
                other = site_of(m) if path else None
                if other is not None and other.path is None:
                    other.path = path
                held = held or m is module
            if held:
                return
    except Exception:  # noqa: BLE001 - a name is never worth a forward: the site keeps its description
        return


def name_error(error: BaseException, site: Site) -> None:
    """Name ``site`` in ``error``, an exception leaving its forward: a ``CommfuseError``'s message begins with
    the site's path, kind and world size; any other ``Exception`` (the user's own, raised in a hook the site
    called) keeps its message and gets a note that says the same. An error is named once, by the innermost
    site it left."""
    if not isinstance(error, Exception) or getattr(error, "_commfuse_named", False):
        return
    try:
        error._commfuse_named = True
    except AttributeError:  # an error that takes no attributes
        return
    args = error.args
    if not isinstance(error, CommfuseError):
        add = getattr(error, "add_note", None)  # Python 3.11+
        if add is not None:
            add(f"commfuse: raised in the forward of {site.heading}")
    elif len(args) == 1 and isinstance(args[0], str) and not args[0].startswith(site.label):
        error.args = (f"{site.heading}: {args[0]}",)


# -- what a site took -------------------------------------------------------------------------------------------


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
        site = Site(kind, None, getattr(layer, "group", None), int(getattr(layer, "world_size", 1)),
                    f"{type(layer).__name__}({shown})", layer)
        layer.__dict__["_commfuse_site"] = site
    return site
