"""The planner: pick an algorithm with the model, and say why.

:func:`choose` is what ``algorithm="auto"`` asks when a profile applies: it
simulates one call of the op (its shard's bytes and flops) under each
candidate and takes the fastest. :func:`profile_for` finds the profile that
applies to a backend: ``COMMFUSE_PROFILE`` (a name or a file; ``off``
disables the model), else a profile installed for the backend by
``commfuse simulate calibrate --install``, else a shipped profile whose
``[match].device_names`` names the device. :func:`explain` is
``commfuse simulate --explain``: the per-op arithmetic behind the numbers and
the sequence lengths where the winner changes (where vanilla wins).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

from commfuse.errors import CommfuseValueError
from commfuse.runtime.env import text as env_text
from commfuse.schedule import Collective
from commfuse.sim._engine import Phase, simulate_phases
from commfuse.sim._model import class_resources, collective_time, kernel_time, transfer_time
from commfuse.sim._predict import Prediction, compare, predict
from commfuse.sim._profile import Profile, ProfileError, load_profile, shipped, user_dir
from commfuse.sim._workloads import ShardedOp, Workload, schedule_for

#: Rows every shard is cut into for an op-level plan: divisible by the 2 halves of bidirectional.
_PLAN_ROWS = 4


def _collective(value) -> Collective:
    try:
        return Collective(value)
    except ValueError:
        names = ", ".join(c.value for c in Collective)
        raise CommfuseValueError(f"unknown collective {value!r}; expected one of {names}") from None


def candidates(collective: str | Collective) -> tuple[str, ...]:
    """What ``auto`` chooses among for ``collective``."""
    c = _collective(collective)
    # all-to-all and its produce side: no bidirectional form (each pairwise step already uses its own link)
    return ("vanilla", "ring") if c.blocks else ("vanilla", "ring", "bidirectional")


def _op_phase(collective: Collective, n: int, algorithm: str, slice_bytes: float, flops: float,
              compute_bytes: float | None) -> Phase:
    schedule = schedule_for(collective.value, n, algorithm)
    rows = _PLAN_ROWS
    mem = (2 * slice_bytes if compute_bytes is None else compute_bytes) / rows
    kw = dict(rows=n * rows, row_bytes=slice_bytes / rows, row_flops=flops / rows, row_mem=mem, name=collective.value)
    if collective is Collective.ALL_GATHER:
        kw.update(cat_row_bytes=2 * slice_bytes / rows)
    elif collective is Collective.REDUCE_SCATTER:
        kw.update(cat_row_bytes=2 * slice_bytes / rows, cat="gaps", add_row_bytes=slice_bytes / rows)
    return Phase(f"{collective.value}.{algorithm}", ShardedOp(schedule, **kw), schedule)


def op_times(collective: str | Collective, world_size: int, *, slice_bytes: float, flops: float, profile: Profile,
             compute_bytes: float | None = None, algorithms: Sequence[str] | None = None) -> dict[str, float]:
    """Predicted seconds of one call of the op under each algorithm (``slice_bytes``: one shard; ``flops``: per shard)."""
    c = _collective(collective)
    algorithms = tuple(algorithms or candidates(c))
    return {a: simulate_phases([_op_phase(c, world_size, a, slice_bytes, flops, compute_bytes)], profile, world_size,
                               record=False).total for a in algorithms}


@functools.lru_cache(maxsize=4096)
def _choose(collective: Collective, world_size: int, slice_bytes: float, flops: float, profile: Profile,
            compute_bytes: float | None, bidirectional: bool = True) -> tuple[str, str]:
    times = op_times(collective, world_size, slice_bytes=slice_bytes, flops=flops, profile=profile,
                     compute_bytes=compute_bytes)
    if not bidirectional:  # the backend cannot use both directions of a link at once
        times.pop("bidirectional", None)
    best = min(times, key=lambda a: (times[a], a != "ring"))
    shown = ", ".join(f"{a} {1e3 * t:.3f} ms" for a, t in times.items())
    why = {
        "vanilla": "the hops would cost more than the compute they hide (per-message latency, small kernels)",
        "ring": "each hop hides behind one shard of compute and no tail is left",
        "bidirectional": "both link directions carry half of every slice, halving each hop",
    }[best]
    return best, f"model of profile {profile.name!r} predicts {shown}: {best} is fastest; {why}"


def choose(collective: str | Collective, world_size: int, *, slice_bytes: float, flops: float,
           profile: "Profile | str", compute_bytes: float | None = None, bidirectional: bool = True
           ) -> tuple[str, str]:
    """The algorithm the model predicts fastest for one op call, and why.

    ``slice_bytes``: what one ring hop carries (one rank's shard); ``flops``:
    the computation on (all-gather, all-to-all) or for (reduce-scatter) one
    shard; ``compute_bytes``: the memory that computation touches (default
    twice the shard). Candidates: ``vanilla``, ``ring`` and, except for
    all-to-all and where ``bidirectional`` is False (a backend without
    ``Capabilities.bidirectional_links``), ``bidirectional``. World size 1 is
    ``vanilla``.
    """
    c = _collective(collective)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CommfuseValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if world_size == 1:
        return "vanilla", "world size 1: nothing to communicate"
    for name, value in (("slice_bytes", slice_bytes), ("flops", flops)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise CommfuseValueError(f"{name} must be a number >= 0, got {value!r}")
    return _choose(c, world_size, float(slice_bytes), float(flops), load_profile(profile),
                   None if compute_bytes is None else float(compute_bytes), bidirectional)


# -- which profile applies ----------------------------------------------------

#: ``COMMFUSE_PROFILE``'s words for no profile (an empty value is one).
_OFF = ("0", "off", "none", "no", "false")


@functools.lru_cache(maxsize=64)
def _load_cached(spec: str, mtime: float) -> Profile:
    return load_profile(spec)


def _load(spec: str, via: str) -> Profile:
    """``spec``'s profile for ``auto``; a :class:`ProfileError` also says ``via`` what it was asked for."""
    try:
        mtime = os.stat(spec).st_mtime if spec.endswith(".toml") else 0.0
    except (OSError, ValueError):
        mtime = 0.0
    try:
        return _load_cached(spec, mtime)
    except ProfileError as e:
        raise ProfileError(f"{via}: {e}") from None


@functools.lru_cache(maxsize=1)
def _shipped_profiles() -> tuple[Profile, ...]:
    return tuple(load_profile(name) for name in shipped())


def _device_name(device) -> str:
    if device is None or getattr(device, "type", "cpu") == "cpu":
        return ""
    try:
        import torch

        module = getattr(torch, device.type, None)
        return str(module.get_device_name(device)) if module is not None else ""
    except Exception:  # noqa: BLE001 - a device that cannot name itself just matches no profile
        return ""


@functools.lru_cache(maxsize=16)
def _installed_path(name: str, key: tuple) -> str:
    """Where ``commfuse simulate calibrate --install`` puts ``name``'s profile, for one environment
    (``key``: the variables that place it).

    Cached: resolving the folder costs tens of microseconds (``auto`` asks
    once per call signature, ``commfuse.planning.calls.resolve_call``; direct
    ``plan`` callers on every call); the file check that follows is one
    ``stat``, so a profile installed mid-run is seen by the next new signature.
    """
    return str(user_dir() / f"{name}.toml")


def profile_for(backend=None) -> Profile | None:
    """The profile ``auto`` uses for ``backend``, or None when none applies (see the module docstring)."""
    env = env_text("COMMFUSE_PROFILE", empty="off")
    if env is not None:
        if env.lower() in _OFF:
            return None
        return _load(env, f"COMMFUSE_PROFILE={env!r}")
    if backend is None:
        return None
    name = getattr(backend, "name", None)
    if isinstance(name, str) and name:
        where = (env_text("COMMFUSE_PROFILE_DIR"), os.environ.get("XDG_CONFIG_HOME"), os.environ.get("HOME"))
        installed = _installed_path(name, where)
        if os.path.isfile(installed):
            return _load(installed, f"the profile installed for backend {name!r}")
    device = _device_name(getattr(backend, "device", None))
    if device:
        for p in _shipped_profiles():
            if any(s.lower() in device.lower() for s in p.device_names):
                return p
    return None


def plan(collective: str | Collective, world_size: int, slice_bytes: float, flops: float | None,
         backend=None) -> tuple[str, str] | None:
    """``choose`` with the profile that applies to ``backend``; None when no profile applies or flops are unknown."""
    if flops is None or world_size <= 1:
        return None
    profile = profile_for(backend)
    if profile is None:
        return None
    links = getattr(getattr(backend, "capabilities", None), "bidirectional_links", True)
    return choose(collective, world_size, slice_bytes=slice_bytes, flops=flops, profile=profile,
                  bidirectional=bool(links))


# -- explain ----------------------------------------------------------------


def _best(predictions: Sequence[Prediction]) -> Prediction:
    return min(predictions, key=lambda p: p.time)


def _winner(profile: Profile, workload: Workload, seq: int, algorithms: Sequence[str]) -> str:
    w = _with_seq(workload, seq)
    times = {a: predict(profile, w, a).time for a in algorithms}
    return min(times, key=lambda a: (times[a], a))


def _with_seq(workload: Workload, seq: int) -> Workload:
    from dataclasses import replace

    return replace(workload, seq=seq)


def crossovers(profile: "Profile | str", workload: Workload, algorithms: Sequence[str] = ("vanilla", "ring",
               "bidirectional"), *, max_seq: int | None = None) -> list[tuple[int, str]]:
    """Where the fastest algorithm changes as the sequence grows: ``[(first seq, winner from there), ...]``.

    Sequence lengths are multiples of the TP degree (so every rank's shard is
    alike); the first entry starts at the smallest one. Between powers of two
    each change is located exactly by bisection.
    """
    profile = load_profile(profile)
    unit = _seq_unit(workload)
    top = max_seq or max(4 * workload.seq, 64 * unit)
    grid = []
    s = unit
    while s <= top:
        grid.append(s)
        s *= 2
    winners = [(s, _winner(profile, workload, s, algorithms)) for s in grid]
    out = [winners[0]]
    for (lo, a), (hi, b) in zip(winners, winners[1:]):
        if a == b:
            continue
        # bisect on multiples of unit between lo (winner a) and hi (winner b)
        lo_k, hi_k = lo // unit, hi // unit
        while hi_k - lo_k > 1:
            mid = (lo_k + hi_k) // 2
            if _winner(profile, workload, mid * unit, algorithms) == a:
                lo_k = mid
            else:
                hi_k = mid
        out.append((hi_k * unit, _winner(profile, workload, hi_k * unit, algorithms)))
    merged = [out[0]]
    for s, a in out[1:]:
        if a != merged[-1][1]:
            merged.append((s, a))
    return merged


def _seq_unit(workload: Workload) -> int:
    """The step of sequence lengths that keeps every rank alike: tp for the TP workloads (fsdp_linear and moe
    split nothing along the sequence)."""
    return 1 if workload.name in ("fsdp_linear", "moe") else workload.tp


def _ms(t: float) -> str:
    return f"{1e3 * t:.3f} ms"


def explain(profile: "Profile | str", workload: Workload, predictions: Sequence[Prediction] | None = None,
            algorithms: Sequence[str] = ("vanilla", "ring", "bidirectional")) -> str:
    """Why the model ranks the algorithms as it does for ``workload``, and where the ranking changes."""
    profile = load_profile(profile)
    if workload.name == "moe":  # all-to-all has no bidirectional form
        algorithms = tuple(a for a in algorithms if a != "bidirectional")
    predictions = list(predictions) if predictions is not None else compare(profile, workload, algorithms)
    n = workload.world_size
    best = _best(predictions)
    lines = [f"fastest: {best.algorithm} ({_ms(best.time)}; vanilla {_ms(next(p.time for p in predictions if p.algorithm == 'vanilla'))})"]
    link = profile.link
    lines.append(
        f"links: {link.topology}, {link.duplex} duplex, {link.rate / 1e9:.3g} GB/s per message alone, "
        f"{1e6 * link.latency:.3g} us latency; compute {profile.compute.peak_flops * profile.compute.efficiency / 1e12:.4g} "
        f"TFLOPS sustained, half of that at {profile.compute.half_efficiency_flops:.3g}-flop kernels; "
        f"contention {100 * profile.contention.compute_slowdown:.0f}%"
    )
    # per op: what a ring hop costs against the compute it hides behind
    for phase in workload.phases("ring"):
        if phase.schedule is None:
            continue
        cost = phase.cost
        steps = phase.schedule.steps(0)
        hop = next((s for s in steps if s.sends), None)
        work = max(steps, key=lambda s: len(s.compute))
        t_comp = sum(kernel_time(profile, k) for k in cost.compute(0, work))
        if hop is None:
            continue
        nbytes = cost.transfer_bytes(0, hop.sends[0])
        usage = class_resources(profile, n, hop.sends[0].shift)
        sharing = max(w for _, w in usage)
        t_hop = transfer_time(profile, nbytes, sharing)
        verdict = "hidden behind it" if t_hop <= t_comp else f"exposed by {_ms(t_hop - t_comp)} per hop"
        coll = collective_time(profile, n, nbytes, phase.schedule.collective.transport.value)
        lines.append(
            f"{phase.name} ({phase.schedule.collective.value}): {n - 1} hops of {nbytes / 1e6:.4g} MB at "
            f"{_ms(t_hop)} each vs {_ms(t_comp)} of compute per step ({verdict}); vanilla's whole collective "
            f"{_ms(coll)} is exposed; sliced:c leaves a tail of about {_ms(coll)} / c"
        )
    if "bidirectional" in {p.algorithm for p in predictions}:
        if link.topology == "switch":
            lines.append("bidirectional: on a switch both directions leave through the same port, so halving each "
                         "message buys no bandwidth; it only adds messages")
        elif link.topology == "bus":
            lines.append("bidirectional: every message shares one medium, so it buys no bandwidth")
        elif link.duplex == "half":
            lines.append("bidirectional: half-duplex links share their two directions, so it buys no bandwidth")
        else:
            lines.append("bidirectional: each direction has its own full-duplex link, so each hop moves half the "
                         "bytes in the same time: twice the bandwidth")
    cross = crossovers(profile, workload, algorithms)
    parts = []
    for i, (s, a) in enumerate(cross):
        end = cross[i + 1][0] - _seq_unit(workload) if i + 1 < len(cross) else None
        span = f"seq {s}" + (f"..{end}" if end is not None and end != s else ("+" if end is None else ""))
        parts.append(f"{a} for {span}")
    lines.append("winner by sequence length (other sizes fixed): " + "; ".join(parts))
    first = cross[0][0]
    vanilla = [(s, cross[i + 1][0] if i + 1 < len(cross) else None) for i, (s, a) in enumerate(cross) if a == "vanilla"]
    if vanilla:
        spans = ", ".join(
            (f"seq >= {s}" if e is None else f"seq < {e}" if s == first else f"{s} <= seq < {e}") for s, e in vanilla
        )
        lines.append(f"vanilla wins for {spans}: there, per-hop latency and small-kernel efficiency cost more than "
                     f"the overlap saves")
    else:
        lines.append("vanilla never wins in that range")
    return "\n".join(lines)


__all__ = ["candidates", "choose", "crossovers", "explain", "op_times", "plan", "profile_for"]
