"""Resolving a call: which backend, which algorithm (``auto``'s policy), which timeout and check.

:func:`resolve_call` is the one public way for ops and layers to turn what a
user passed (``group``, ``backend``, ``algorithm``, ``timeout``, ``check``)
into a :class:`Call`, the resolved options the pipelined primitives
(``commfuse.planning.gather``, ``scatter``, ``all_to_all``) run with. It is remembered per call
signature, so a layer that resolves on every forward pays a dict look-up.

``auto`` decides from sizes that every rank knows (the largest shard of a
``tensor_split``, never this rank's own), so every rank takes the same
algorithm.

The policy logs each decision once, when a signature is resolved, at DEBUG on
the ``commfuse`` logger: the algorithm, why, and the inputs it decided on.
Later calls of the signature find it in the memo and log nothing.
"""

from __future__ import annotations

import logging

from commfuse.errors import CommfuseValueError
from commfuse.planning import table
from commfuse.runtime.groups import check_mode, forget_groups, resolve_timeout
from commfuse.schedule import AlgorithmSpec, Collective, parse_algorithm

__all__ = ["C10D_WORLD", "MIN_SLICE_BYTES", "Call", "choose_algorithm", "resolve_call"]

try:  # a build without torch.distributed: no default group, ever
    from torch.distributed.distributed_c10d import _world as C10D_WORLD
except ImportError:  # pragma: no cover
    class _NoWorld:
        _default_pg = None

    C10D_WORLD = _NoWorld()
#: ``C10D_WORLD._default_pg``, torch.distributed's default group in place, goes into every op's key in the
#: planning table (see ``commfuse.planning.table``).

#: Without a hardware profile, ``auto`` takes ``vanilla`` when one ring slice would carry fewer bytes than
#: this: below it a hop costs about its fixed latency whatever its size, so N hops cost more than one
#: collective and there is little compute to hide. A backend may declare its own
#: (``Capabilities.auto_min_slice_bytes``).
MIN_SLICE_BYTES = 64 * 1024

log = logging.getLogger("commfuse")


class Call:
    """The resolved options of one op call: backend, algorithm, timeout (s) and check mode."""

    __slots__ = ("be", "spec", "timeout", "check", "reason", "_vanilla", "__weakref__")

    def __init__(self, be, spec: AlgorithmSpec, timeout: float, check: str, reason: str = "asked for") -> None:
        self.be, self.spec, self.timeout, self.check, self.reason = be, spec, timeout, check, reason
        self._vanilla: Call | None = None

    @property
    def world_size(self) -> int:
        return self.be.world_size

    @property
    def rank(self) -> int:
        return self.be.rank

    def vanilla(self) -> "Call":
        """This call's backend, timeout and check with one whole collective per exchange (``vanilla``), or
        the pairwise ring where the backend declares no whole all-to-all: for small exchanges such as an
        uneven all-to-all's sizes."""
        found = self._vanilla
        if found is None:
            supported = getattr(getattr(self.be, "capabilities", None), "collectives", None)
            name = "vanilla" if supported is None or "all_to_all" in supported else "ring"
            found = self._vanilla = Call(self.be, parse_algorithm(name), self.timeout, self.check,
                                         "the sizes' exchange")
        return found

    def __repr__(self) -> str:
        return f"Call({self.be!r}, {self.spec.shown!r}, timeout={self.timeout:g}, check={self.check!r})"


def choose_algorithm(collective: str | Collective, world_size: int, slice_bytes: int, capabilities=None, *,
                     flops: float | None = None, backend=None) -> tuple[str, str]:
    """What ``algorithm="auto"`` takes, and why.

    ``slice_bytes`` is what one ring hop would carry (the largest shard's, the
    same on every rank); ``flops`` the computation on (all-gather) or for
    (reduce-scatter) one shard, when the op knows it. When a hardware profile
    applies to ``backend`` (``COMMFUSE_PROFILE``, one installed by ``commfuse
    simulate calibrate --install``, or a shipped one whose device names match)
    and ``flops`` is known, the simulator predicts vanilla, ring and
    bidirectional and the fastest is taken (:func:`commfuse.sim.plan`,
    docs/simulator.md; ``bidirectional`` only where the backend declares
    ``bidirectional_links``). Otherwise world size 1, an eager backend that
    declares no ``overlap`` (its transfers do not progress while the host
    computes, so hops cannot hide), or slices under the backend's
    ``capabilities.auto_min_slice_bytes`` (default :data:`MIN_SLICE_BYTES`),
    take ``vanilla``; else ``ring``.
    """
    name, reason, _ = _decide(collective, world_size, slice_bytes, capabilities, flops, backend)
    return name, reason


def min_slice_bytes(capabilities) -> int:
    """The smallest ring hop ``auto`` takes the ring for: the backend's ``auto_min_slice_bytes``, else
    :data:`MIN_SLICE_BYTES`."""
    limit = getattr(capabilities, "auto_min_slice_bytes", None)
    return MIN_SLICE_BYTES if limit is None else limit


def _decide(collective, world_size, slice_bytes, capabilities, flops, backend) -> tuple[str, str, str]:
    """:func:`choose_algorithm`'s (algorithm, reason), and what the hardware model had to do with it."""
    if world_size == 1:
        return "vanilla", "world size 1: nothing to communicate", "not asked"
    if (capabilities is not None and not getattr(capabilities, "overlap", True)
            and getattr(capabilities, "execution", "eager") == "eager"):
        return "vanilla", (
            "the backend declares no overlap (its transfers do not progress while the host computes): "
            f"{world_size - 1} hops would add up behind the compute instead of hiding, so one collective is cheaper"
        ), "not asked"
    if flops is None:
        model = "not asked (the op gave no flops)"
    else:
        from commfuse.sim import plan  # pure Python, imported on first use

        planned = plan(collective, world_size, slice_bytes, flops, backend)
        if planned is not None:
            return (*planned, "decided (its reason names the profile)")
        model = ("no profile applies (COMMFUSE_PROFILE is unset or off, and none is installed for this backend "
                 "or shipped for its device)")
    limit = min_slice_bytes(capabilities)
    if slice_bytes < limit:
        return "vanilla", (
            f"a ring hop would carry {slice_bytes} bytes, under {limit}: per-step latency would "
            f"outweigh the overlap, so one collective is cheaper"
        ), model
    return "ring", (f"a ring hop carries {slice_bytes} bytes: each of the {world_size - 1} hops hides behind one "
                    "shard of compute"), model


def _halved(collective, world_size: int, slice_bytes: int, capabilities, name: str, reason: str) -> tuple[str, str]:
    """``auto``'s ring as ``ring:2`` on two ranks for a caller whose compute takes half blocks as they arrive
    (the caller says so: ``halves``; an all-to-all's by-slice consumer, ring attention's K/V and dK/dV rings).
    There a ring has one hop per exchange, which hides behind the own block only; cut in two, each half's
    compute leads the other half's hop (schedules/all_to_all/README.md; the all-gather and reduce-scatter
    rings compute a slice in the step after it arrives, or before it leaves, too). Taken while half a
    block still carries :data:`MIN_SLICE_BYTES` (or the backend's own bar, if higher): below it a step's fixed
    cost outweighs what the second half hides."""
    if world_size != 2 or name != "ring":
        return name, reason
    bar = max(MIN_SLICE_BYTES, min_slice_bytes(capabilities))
    if slice_bytes // 2 < bar:
        return name, reason
    return "ring:2", (f"{reason}; two ranks, and half a block carries {slice_bytes // 2} bytes (>= {bar}): each "
                      "block in two halves (ring:2)")


def _log_choice(collective: Collective, name: str, reason: str, *, world_size: int, slice_bytes: int, flops,
                be=None, model: str = "not asked", remembered: bool = True) -> None:
    """Say what ``auto`` took for a new call signature and why (INFO: one short line, ``COMMFUSE_LOG=info``),
    and at DEBUG what it decided on (planning time only)."""
    if log.isEnabledFor(logging.INFO) and _sites.current() is None:  # a site says it itself, with its name
        log.info("auto: %s takes %s on %d ranks: %s", collective.value, name, world_size, reason)
    if not log.isEnabledFor(logging.DEBUG):
        return
    if be is None:
        backend = "none (a single process)"
    else:
        caps = getattr(be, "capabilities", None)
        shown = "none declared" if caps is None else ", ".join(
            f"{field}={getattr(caps, field, None)!r}"
            for field in ("overlap", "execution", "auto_min_slice_bytes", "bidirectional_links"))
        backend = f"{getattr(be, 'name', type(be).__name__)!r} ({shown})"
    memo = (f"this signature was not in the planning table (holding {table.entries('call')} calls); the decision "
            "is remembered until commfuse.backends.release(), or until the table, held to its bound in bytes, "
            "evicts it" if remembered else
            "the call's options cannot be hashed, so nothing is remembered and auto decides on every call")
    log.debug("auto chose %s for %s: %s [world size %d, ring hop %d bytes, flops per shard %s, backend %s, "
              "hardware model: %s; %s]", name, collective.value, reason, world_size, slice_bytes,
              "unknown" if flops is None else f"{flops:g}", backend, model, memo)


def resolve_call(collective: Collective | str, algorithm, *, group=None, backend=None, device=None,
                 slice_bytes: int = 0, flops: float | None = None, timeout: float | None = None,
                 check: bool | str | None = None, report: dict | None = None, halves: bool = False) -> Call | None:
    """The :class:`Call` for these options, or None when there is nothing to communicate (world size 1).

    ``slice_bytes`` and ``flops`` must be the same on every rank (see
    :func:`choose_algorithm`). ``report``, a dict, receives the algorithm taken,
    why, and the world size. Raises ``CommfuseValueError`` for a bad
    ``algorithm``, ``timeout`` or ``check`` whatever the world size.
    """
    _backends.fresh()  # a default group destroyed (and made again) since: forget what was planned on it
    key = ("call", collective, algorithm, group, backend, device, slice_bytes, flops, timeout, check, halves)
    try:
        found = table.lookup(key)
    except TypeError:  # an unhashable argument: resolve without remembering (and let the checks name it)
        found, key = None, None
    if found is None:
        found = _resolve(Collective(collective), algorithm, group, backend, device, slice_bytes, flops, timeout,
                         check, key is not None, halves)
        if key is not None:
            found = table.remember(key, found)
    if report is not None:
        report.update(algorithm=found.spec.shown, reason=found.reason,
                      world_size=1 if found.be is None else found.be.world_size)
    found = None if found.be is None else found
    site = _sites.here.site  # read in place: most calls are made outside a site
    if site is not None:  # inside a layer's or style's forward: written down there
        _sites.saw(site, collective, algorithm, slice_bytes, found)
    return found


def _resolve(collective: Collective, algorithm, group, backend, device, slice_bytes, flops, timeout, check,
             remembered: bool, halves: bool = False):
    spec = parse_algorithm(algorithm, collective)
    if spec.name == "native":
        raise CommfuseValueError(
            "algorithm 'native' (a backend's own fused kernel) exists for all_gather_matmul and "
            "matmul_reduce_scatter only; give ring, bidirectional, serial, sliced, vanilla or auto"
        )
    seconds = resolve_timeout(timeout)
    mode = check_mode(check)
    be = _backends.resolve(backend, group, device)
    if be is None or be.world_size == 1:  # remembered as a Call without a backend: nothing to communicate
        if spec.name == "auto":
            reason = "world size 1: nothing to communicate"
            _log_choice(collective, "vanilla", reason, world_size=1, slice_bytes=slice_bytes, flops=flops, be=be,
                        remembered=remembered)
            return Call(None, parse_algorithm("vanilla"), seconds, mode, reason)
        return Call(None, spec, seconds, mode)
    reason = "asked for"
    if spec.name == "auto":
        caps = getattr(be, "capabilities", None)
        name, reason, model = _decide(collective, be.world_size, slice_bytes, caps, flops, be)
        if halves:
            name, reason = _halved(collective, be.world_size, slice_bytes, caps, name, reason)
        _log_choice(collective, name, reason, world_size=be.world_size, slice_bytes=slice_bytes, flops=flops,
                    be=be, model=model, remembered=remembered)
        spec = parse_algorithm(name, collective)
    _check_collective(be, collective, spec)
    return Call(be, spec, seconds, mode, reason)


def _check_collective(be, collective: Collective, spec: AlgorithmSpec) -> None:
    """``vanilla`` and ``sliced`` run whole collectives: the backend must declare it has them."""
    if spec.name not in ("vanilla", "sliced"):
        return
    supported = getattr(getattr(be, "capabilities", None), "collectives", None)
    if supported is not None and collective.transport.value not in supported:
        raise CommfuseValueError(
            f"algorithm {spec.shown!r} runs whole {collective.transport.value} collectives, which backend "
            f"{getattr(be, 'name', be)!r} does not have (its capabilities list {', '.join(supported) or 'none'}); "
            "use 'ring' or 'bidirectional'"
        )


from commfuse import backends as _backends  # noqa: E402
from commfuse.runtime import sites as _sites  # noqa: E402
from commfuse.runtime.eager import eager_only  # noqa: E402

# the runtime's per-group call numbers go with the plans made on those groups
table.on_forget(forget_groups)

# they ask the process group for its rank and size (see commfuse.runtime.eager); commfuse.backends itself
# imports no torch, so its resolve is marked here
eager_only(resolve_call, _backends.resolve)
