"""The cost model: what a kernel, a message and a whole collective cost on a profile.

Three pieces, each a small function of a :class:`~commfuse.sim.Profile`:

* :func:`kernel_time`: a roofline with an efficiency curve. A kernel of ``F``
  flops touching ``B`` bytes of memory takes
  ``max((F + F_half) / (peak * efficiency), B / memory_bandwidth)``, which is
  ``F / (peak * eff(F))`` with ``eff(F) = efficiency * F / (F + F_half)``:
  big kernels run at ``efficiency`` of peak, a kernel of ``F_half`` flops at
  half of that, tiny ones cost about ``F_half / (peak * efficiency)`` whatever
  they do (launch and tail effects). That fall-off is why over-slicing loses.
* messages: ``latency`` then ``bytes`` at a rate that is the link's rate
  divided among the messages sharing a port, link or bus (:func:`resources`
  says which a message uses; the engine does the sharing over time);
* :func:`collective_time`: a whole collective over N ranks at the standard
  ring cost, ``(N - 1) * (latency + piece / (efficiency * rate))``, where
  ``rate`` is what one message of a ring step gets when every rank sends to
  its neighbour at once; an all-to-all's bytes are spread over the links
  all its messages use at once (:func:`all_to_all_spread`).
"""

from __future__ import annotations

from dataclasses import dataclass

from commfuse.sim._profile import Profile


@dataclass(frozen=True, slots=True)
class Kernel:
    """One piece of computation: ``flops`` of arithmetic touching ``bytes`` of memory."""

    flops: float = 0.0
    bytes: float = 0.0
    name: str = ""


def kernel_time(profile: Profile, kernel: Kernel) -> float:
    """Seconds ``kernel`` takes on one device of ``profile`` (see the module docstring)."""
    c = profile.compute
    if kernel.flops <= 0 and kernel.bytes <= 0:
        return 0.0
    compute = (kernel.flops + c.half_efficiency_flops) / (c.peak_flops * c.efficiency)
    memory = kernel.bytes / c.memory_bandwidth
    return compute if compute > memory else memory


def efficiency(profile: Profile, flops: float) -> float:
    """Fraction of peak a kernel of ``flops`` reaches when compute-bound."""
    c = profile.compute
    return c.efficiency * flops / (flops + c.half_efficiency_flops) if flops > 0 else 0.0


Key = tuple
Usage = tuple[tuple[Key, int], ...]


def resources(profile: Profile, src: int, dst: int) -> Usage:
    """What a message from rank ``src`` to rank ``dst`` occupies: ``((resource, weight), ...)``.

    ``switch``: the sender's egress and the receiver's ingress (one shared
    port each when half duplex); ``direct``: the link ``src -> dst`` (the pair's
    one link when half duplex); ``bus``: the one shared medium.
    """
    link = profile.link
    if link.topology == "bus":
        return ((("bus",), 1),)
    if link.topology == "switch":
        if link.duplex == "full":
            return ((("out", src), 1), (("in", dst), 1))
        return ((("port", src), 1), (("port", dst), 1))
    if link.duplex == "full":
        return ((("link", src, dst), 1),)
    return ((("link", min(src, dst), max(src, dst)), 1),)


def class_resources(profile: Profile, world_size: int, shift: int) -> Usage:
    """:func:`resources` for a whole rotation class of messages, seen from rank 0.

    When every rank is alike, the messages "each rank sends ``shift`` hops on"
    form one class: at any moment all of them are in the same state. Rank 0's
    resources then carry, per active class, the weight returned here: how many
    messages of the class use each resource of rank 0. That lets the engine
    simulate one rank and still share bandwidth exactly as the full world
    would.
    """
    n, link = world_size, profile.link
    if link.topology == "bus":
        return ((("bus",), n),)
    if link.topology == "switch":
        if link.duplex == "full":
            return ((("out",), 1), (("in",), 1))
        return ((("port",), 2),)
    s = shift % n
    if link.duplex == "full":
        return ((("link", s), 1),)
    # the half-duplex link {0, s} carries 0 -> s, and also s -> 0 when s is its own inverse
    return ((("link", min(s, n - s)), 2 if (2 * s) % n == 0 else 1),)


def ring_step_rate(profile: Profile, world_size: int) -> float:
    """The rate of one message when every rank sends one message to its ring neighbour at once."""
    load: dict[Key, int] = {}
    usage = class_resources(profile, world_size, 1)
    for key, weight in usage:
        load[key] = load.get(key, 0) + weight
    return min(profile.link.rate / load[key] for key, _ in usage)


def collective_time(profile: Profile, world_size: int, piece_bytes: float, collective: str = "all_gather",
                    free_bytes: float = 0.0) -> float:
    """A whole all-gather / reduce-scatter / all-to-all over ``world_size`` ranks, per-rank piece ``piece_bytes``.

    ``free_bytes``: bytes of each rank's messages a token bucket lets through at once (``link.burst``).
    """
    n = world_size
    if n <= 1:
        return 0.0
    return (n - 1) * profile.collective_latency + max(0.0, collective_bytes(profile, n, piece_bytes, collective)
                                                       - free_bytes) / ring_step_rate(profile, n)


def collective_bytes(profile: Profile, world_size: int, piece_bytes: float, collective: str = "all_gather") -> float:
    """What each rank's messages of a whole collective weigh on the link: ``(N - 1) * piece / efficiency``.

    An efficiency under 1 is a library that moves more than the ring's bytes (gloo's reduce-scatter moves
    twice as much: efficiency 0.5) or moves them less well. An all-to-all is not a ring: every rank sends
    its N - 1 pieces at once, so it weighs that times :func:`all_to_all_spread`.
    """
    nbytes = (world_size - 1) * piece_bytes / profile.collective.efficiency_of(str(collective))
    if str(collective) == "all_to_all":
        nbytes *= all_to_all_spread(profile, world_size)
    return nbytes


def all_to_all_spread(profile: Profile, world_size: int) -> float:
    """A whole all-to-all's time over the ring cost of its bytes: 1 where a rank's N - 1 messages leave
    through one port or share one medium (switch, bus), ``1 / (N - 1)`` where each goes over a link of its
    own (``direct``: a full mesh such as HCCS in an Atlas 800T A2, where the library's all-to-all drives the
    N - 1 links at once, while a pairwise ring step uses one of them)."""
    n = world_size
    if n <= 2:
        return 1.0
    load: dict[Key, int] = {}
    for shift in range(1, n):  # every rank sends one piece to every other rank at once
        for key, weight in class_resources(profile, n, shift):
            load[key] = load.get(key, 0) + weight
    ring: dict[Key, int] = {}
    for key, weight in class_resources(profile, n, 1):
        ring[key] = ring.get(key, 0) + weight
    return max(load.values()) / ((n - 1) * max(ring.values()))


def transfer_time(profile: Profile, nbytes: float, sharing: int = 1) -> float:
    """One message alone on its resources (or sharing them with ``sharing - 1`` others all along)."""
    return profile.link.latency + nbytes * sharing / profile.link.rate
