"""Predictions: one workload under one algorithm, run three ways, in the benchmark's terms.

Like ``commfuse bench`` measures an op three times (normally, with its
transfers removed, with its compute removed: ``runtime.measure``), a
prediction runs the engine in the same three modes and reports the same
figures: the time, compute-only, comm-only, the exposed communication
(time minus compute-only), the hidden fraction and the speed-up over vanilla.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from commfuse.schedule import hidden_fraction
from commfuse.sim._engine import Phase, Timeline, check_size, simulate_phases
from commfuse.sim._model import kernel_time
from commfuse.sim._profile import Profile, ProfileError, load_profile
from commfuse.sim._workloads import Workload

#: What ``compare`` predicts when not told: the issue's table rows.
DEFAULT_ALGORITHMS = ("vanilla", "sliced:2", "sliced:4", "ring", "bidirectional")


@dataclass(frozen=True)
class Prediction:
    """The predicted figures of one algorithm on one workload; times in seconds.

    The figures mean what ``commfuse bench``'s do (``commfuse/bench/report.py``):
    ``compute_only`` and ``comm_only`` are the runs with transfers / with the
    fused ops' compute removed; ``outside`` is compute outside the fused ops
    (activations, weight-gradient GEMMs), which all three runs contain.
    """

    workload: Workload
    algorithm: str
    profile: str
    time: float
    compute_only: float
    comm_only: float
    outside: float
    flops: float
    peak_flops: float
    speedup_vs_vanilla: float | None = None
    timeline: Timeline | None = field(default=None, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return self.workload.world_size

    @property
    def exposed(self) -> float:
        """Communication not hidden: the time beyond the compute-only time."""
        return self.time - self.compute_only

    @property
    def comm(self) -> float:
        """Pure communication time: comm-only minus the compute outside the fused ops."""
        return self.comm_only - self.outside

    @property
    def hidden_fraction(self) -> float | None:
        """The bench's figure (``commfuse.schedule.hidden_fraction``) of the predicted run, the compute outside
        the fused ops taken out of every side; None with nothing to communicate."""
        if self.comm <= 0:
            return None
        return hidden_fraction(self.time - self.outside, self.compute_only - self.outside, self.comm)

    @property
    def mfu(self) -> float:
        """Model flops utilisation: useful flops per rank over time times peak."""
        return self.flops / (self.time * self.peak_flops) if self.time > 0 else 0.0

    def record(self) -> dict:
        """The ``commfuse bench --json`` keys (``median_ms`` is the predicted time), plus the simulator's own."""
        w = self.workload
        hidden = self.hidden_fraction

        def ms(t: float) -> float:
            return round(1e3 * t, 6)

        shape = {"batch": w.batch, "seq": w.seq, "hidden": w.hidden, "ffn": w.ffn, "tp": w.tp, "dp": w.dp,
                 "passes": w.passes}
        if w.name == "moe":
            shape.update(ep=w.ep, experts=w.experts, topk=w.topk, skew=w.skew, grouping=w.grouping)
        if w.name == "attention":
            shape.update(heads=w.heads, kv_heads=w.kv_heads, head_dim=w.head_dim, causal=w.causal,
                         mla=None if w.mla is None else vars(w.mla))
        if w.name == "mlp":
            shape.update(gated=w.gated)
        if w.name == "ring_attention":
            shape.update(cp=w.cp, heads=w.heads, kv_heads=w.kv_heads, head_dim=w.head_dim, layout=w.layout,
                         kv_replicate=w.kv_replicate)
        return {
            "workload": w.name,
            "algorithm": self.algorithm,
            "world_size": self.world_size,
            "dtype": w.dtype,
            "shape": shape,
            "median_ms": ms(self.time),
            "compute_only_ms": ms(self.compute_only),
            "comm_only_ms": ms(self.comm_only),
            "outside_ms": ms(self.outside),
            "exposed_ms": ms(self.exposed),
            "speedup_vs_vanilla": None if self.speedup_vs_vanilla is None else round(self.speedup_vs_vanilla, 4),
            "hidden_fraction": None if hidden is None else round(hidden, 4),
            "correct": None,  # the simulator computes no values: correctness is the executor's (bench, tests)
            "predicted": True,
            "profile": self.profile,
            "mfu": round(self.mfu, 4),
        }


def _dtype_check(profile: Profile, workload: Workload) -> None:
    from commfuse.sim._profile import ProfileError

    if profile.compute.dtype != workload.dtype:
        raise ProfileError(
            f"profile {profile.name!r} gives compute rates for {profile.compute.dtype}, but the workload is "
            f"{workload.dtype}: use dtype={profile.compute.dtype!r} or a profile for {workload.dtype}"
        )


def segments(phases: Sequence[Phase]) -> list[tuple[int, list[Phase]]]:
    """``phases`` cut where the world size of their schedules changes (the 2-D forms of ``ring_attention``:
    an all-to-all inside groups of U ranks, a ring over R); a phase without a schedule joins its neighbours.

    Every rank runs the ops one after another and every rank of a segment is alike or simulated, so the
    layer's time is the sum of its segments' (exact for the switch and direct topologies, where the groups'
    messages use separate ports and links; on a ``bus`` the other groups' traffic would share the medium).
    """
    out: list[tuple[int, list[Phase]]] = []
    for p in phases:
        n = p.schedule.world_size if p.schedule is not None else None
        if out and (n is None or out[-1][0] in (None, n)):
            if out[-1][0] is None:
                out[-1] = (n, out[-1][1])
            out[-1][1].append(p)
        else:
            out.append((n, [p]))
    return [(1 if n is None else n, ps) for n, ps in out]


def _run(phases: Sequence[Phase], profile: Profile, world_size: int, **kw) -> Timeline:
    parts = segments(phases)
    if len(parts) == 1 and parts[0][0] == world_size:
        return simulate_phases(phases, profile, world_size, **kw)
    # segments over different world sizes: each simulated on its own, their times summed (no timeline kept)
    kw["record"] = False
    timelines = [simulate_phases(ps, profile, n, **kw) for n, ps in parts]
    total = sum(tl.total for tl in timelines)
    busy = sum(max(tl.compute_busy) for tl in timelines)
    return Timeline(world_size, True, list(phases), [total], [busy])


def predict(profile: "Profile | str", workload: Workload, algorithm: str = "ring", *, record: bool = False,
            symmetric: bool | None = None, check: bool = False) -> Prediction:
    """Predict ``workload`` under ``algorithm`` (``"ring"``, ``"ring:2"``, ``"bidirectional"``, ``"sliced:4"``, ``"vanilla"``).

    ``check``: include a fingerprint exchange before every op (the executor
    checks on the first call of each signature only; ``commfuse bench`` times
    without it unless ``--fingerprint``). ``record``:
    keep the timeline for traces and plots.
    """
    profile = load_profile(profile)
    _dtype_check(profile, workload)
    workload.check_algorithm(algorithm)
    phases = workload.phases(algorithm)
    n = workload.world_size
    main = _run(phases, profile, n, symmetric=symmetric, check=check, record=record)
    compute = _run(phases, profile, n, mode="compute_only", symmetric=symmetric, record=False)
    comm = _run(phases, profile, n, mode="comm_only", symmetric=symmetric, check=check, record=False)
    outside = sum(kernel_time(profile, k) for p in phases if p.schedule is None for k in p.cost.compute(0, None))
    flops = sum(p.cost.flops(0) for p in phases)
    if not all(math.isfinite(x) for x in (main.total, compute.total, comm.total, outside, flops)):
        # the bounds on profiles and sizes keep every figure finite; a table of inf or NaN would be a lie
        raise ProfileError(f"profile {profile.name!r} ({profile.source or 'in memory'}) gives {workload.describe()} "
                           f"under {algorithm} a time that is not a finite number")
    return Prediction(workload, algorithm, profile.name, main.total, compute.total, comm.total, outside, flops,
                      profile.compute.peak_flops, timeline=main if record and main.records else None)


def compare(profile: "Profile | str", workload: Workload, algorithms: Sequence[str] = DEFAULT_ALGORITHMS, *,
            record: bool = False, symmetric: bool | None = None, check: bool = False) -> list[Prediction]:
    """Predict every algorithm in ``algorithms``; ``speedup_vs_vanilla`` is filled in (vanilla is added if missing)."""
    profile = load_profile(profile)
    names = list(dict.fromkeys(algorithms))
    if "vanilla" not in names:
        names.insert(0, "vanilla")
    for a in names:  # refuse a run over the engine's limits before running any
        workload.check_algorithm(a)
        for n, phases in segments(workload.phases(a)):
            check_size(phases, n, symmetric)
    out = [predict(profile, workload, a, record=record, symmetric=symmetric, check=check) for a in names]
    vanilla = next(p for p in out if p.algorithm == "vanilla")
    return [replace(p, speedup_vs_vanilla=vanilla.time / p.time if p.time > 0 else None) for p in out]
