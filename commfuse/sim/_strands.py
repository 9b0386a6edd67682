"""Two strands: one micro-batch's stages beside another's, the pairing and order searched.

A block is cut into stages, each a computation and the communication it depends on (a gather feeding the
QKV GEMM, an attention core with none, an output projection producing a reduce-scatter). One micro-batch
run alone hides each stage's communication behind that stage's own compute at best (a ring's limit,
``max(compute, comm)``); a stage whose communication is the longer, or one without any, leaves the device
or the link idle. Two strands (DHelix, arXiv 2411.15871; DeepSeek-V3's DualPipe and Megatron-Core's
combined 1F1B pair a forward with a backward the same way) run micro-batch i+1's forward beside micro-batch
i's backward, so one strand's transfers travel while the other computes.

:func:`plan` chooses which stages run together and in what order by dynamic programming over the two
strands' stage profiles, as DHelix does: state ``(i, j)`` is "the first i stages of strand A and the first
j of strand B are done"; a slot runs A's next stage alone, B's next alone, or the two together. What a
slot costs (seconds):

- alone: a stage with communication runs as commfuse's ring does it,
  ``max(compute, comm) + min(compute, comm) / n`` (a ring of n steps exposes one step of the shorter);
  a stage without communication, its compute;
- together: the device runs both computes, slowed by the profile's ``contention.compute_slowdown`` while a
  transfer is in flight; the link carries the one stage's transfers while both compute:
  ``max((compute_a + compute_b) * (1 + slowdown), comm_a + comm_b)``.

Two stages that both communicate on one link are never paired by the search (their transfers would
queue on that link: the pairing gains nothing a plan should count on); :func:`alternate`, the naive plan
the search is compared with, pairs stage k of A with stage k of B whatever they do. The search is a
pure function of the profiles, with ties broken by a fixed order, so every rank that is given the same
profiles computes the same plan: no rank can run the strands in another order and deadlock its peers.

The stage profiles come from a hardware profile (:func:`llama_stages`, :func:`moe_stages`: the
simulator's GEMM and link models) or from measurements a caller makes (:class:`Stage` takes any
figures). Only the plan and its prediction are built here; ``commfuse.strands`` runs the stages in its
order (docs/strands.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from commfuse.errors import CommfuseValueError
from commfuse.sim._model import Kernel, collective_time, kernel_time
from commfuse.sim._profile import Profile

__all__ = ["Slot", "Stage", "StrandPlan", "alternate", "llama_stages", "moe_stages", "plan", "predict_step"]


@dataclass(frozen=True)
class Stage:
    """One stage of a block: ``compute`` seconds of work and ``comm`` seconds of transfers on ``link`` that
    the work depends on (0: none), run by a ring of ``ring`` ranks when alone."""

    name: str
    compute: float
    comm: float = 0.0
    link: str = "link"
    ring: int = 2

    def __post_init__(self) -> None:
        for field in ("compute", "comm"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise CommfuseValueError(f"stage {self.name!r}: {field} must be a finite number of seconds >= 0, "
                                         f"got {value!r}")
        if not isinstance(self.ring, int) or self.ring < 1:
            raise CommfuseValueError(f"stage {self.name!r}: ring must be a rank count >= 1, got {self.ring!r}")

    @property
    def alone(self) -> float:
        """Seconds this stage takes run alone (commfuse's ring: one step of the shorter side exposed)."""
        if self.comm <= 0:
            return self.compute
        return max(self.compute, self.comm) + min(self.compute, self.comm) / self.ring


def together(a: Stage, b: Stage, slowdown: float = 0.0) -> float:
    """Seconds stages ``a`` and ``b`` take run together (see the module docstring)."""
    comm = a.comm + b.comm
    compute = (a.compute + b.compute) * (1.0 + (slowdown if comm > 0 else 0.0))
    return max(compute, comm)


def conflict(a: Stage, b: Stage) -> bool:
    """Whether ``a`` and ``b`` would both send on one link: a pairing the search never makes."""
    return a.comm > 0 and b.comm > 0 and a.link == b.link


@dataclass(frozen=True)
class Slot:
    """One slot of a plan: strand A's stage ``a`` and/or strand B's stage ``b`` (indices; None: not in this
    slot), and the seconds it takes."""

    a: int | None
    b: int | None
    seconds: float


@dataclass(frozen=True)
class StrandPlan:
    """The slots two strands run in, in order, and what they add up to."""

    first: tuple[Stage, ...]
    second: tuple[Stage, ...]
    slots: tuple[Slot, ...]

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.slots)

    @property
    def single(self) -> float:
        """The two strands one after the other, each stage alone (per-op ring)."""
        return sum(s.alone for s in self.first) + sum(s.alone for s in self.second)

    @property
    def bound(self) -> float:
        """No plan beats this: the device's compute or the link's communication of both strands."""
        stages = self.first + self.second
        return max(sum(s.compute for s in stages), sum(s.comm for s in stages))

    def lines(self) -> list[str]:
        """The plan as text, one slot a line."""
        out = []
        for slot in self.slots:
            a = self.first[slot.a].name if slot.a is not None else "-"
            b = self.second[slot.b].name if slot.b is not None else "-"
            out.append(f"  {a:<38} | {b:<38} {1e3 * slot.seconds:9.3f} ms")
        return out


def _check(first: Sequence[Stage], second: Sequence[Stage], slowdown: float) -> tuple[tuple, tuple]:
    for name, strand in (("first", first), ("second", second)):
        if not all(isinstance(s, Stage) for s in strand):
            raise CommfuseValueError(f"the {name} strand must be a sequence of Stage, got "
                                     f"{[type(s).__name__ for s in strand]}")
    if not (math.isfinite(slowdown) and 0 <= slowdown <= 10):
        raise CommfuseValueError(f"slowdown must be between 0 and 10 (a fraction: 0.1 = 10% slower), got {slowdown}")
    return tuple(first), tuple(second)


def plan(first: Sequence[Stage], second: Sequence[Stage], *, slowdown: float = 0.0) -> StrandPlan:
    """The fastest order and pairing of two strands' stages, each strand's stages kept in their order, no two
    stages on one link paired. O(len(first) * len(second)). Ties: a pair first, then A's stage, then B's."""
    a, b = _check(first, second, slowdown)
    n, m = len(a), len(b)
    best = [[math.inf] * (m + 1) for _ in range(n + 1)]
    move = [[None] * (m + 1) for _ in range(n + 1)]
    best[n][m] = 0.0
    for i in range(n, -1, -1):  # best[i][j]: the least time to finish from (i, j)
        for j in range(m, -1, -1):
            if i == n and j == m:
                continue
            options = []
            if i < n and j < m and not conflict(a[i], b[j]):
                options.append((together(a[i], b[j], slowdown) + best[i + 1][j + 1], 0, (i, j)))
            if i < n:
                options.append((a[i].alone + best[i + 1][j], 1, (i, None)))
            if j < m:
                options.append((b[j].alone + best[i][j + 1], 2, (None, j)))
            cost, _, choice = min(options, key=lambda o: (o[0], o[1]))
            best[i][j], move[i][j] = cost, choice
    slots, i, j = [], 0, 0
    while (i, j) != (n, m):
        x, y = move[i][j]
        seconds = together(a[x], b[y], slowdown) if x is not None and y is not None else \
            (a[x].alone if x is not None else b[y].alone)
        slots.append(Slot(x, y, seconds))
        i, j = i + (x is not None), j + (y is not None)
    return StrandPlan(a, b, tuple(slots))


def alternate(first: Sequence[Stage], second: Sequence[Stage], *, slowdown: float = 0.0) -> StrandPlan:
    """The naive plan: stage k of each strand together, whatever they do (two transfers on one link share
    it), the longer strand's remaining stages alone."""
    a, b = _check(first, second, slowdown)
    slots = [Slot(k, k, together(a[k], b[k], slowdown)) for k in range(min(len(a), len(b)))]
    slots += [Slot(k, None, a[k].alone) for k in range(len(b), len(a))]
    slots += [Slot(None, k, b[k].alone) for k in range(len(a), len(b))]
    return StrandPlan(a, b, tuple(slots))


@dataclass(frozen=True)
class StepPrediction:
    """Two micro-batches' forward and backward: sequential with per-op rings, against two strands (the
    second micro-batch's forward beside the first's backward) with the searched and the naive plan."""

    forward: tuple[Stage, ...]
    backward: tuple[Stage, ...]
    searched: StrandPlan
    naive: StrandPlan

    @property
    def vanilla(self) -> float:
        """Every stage's compute then its communication, no overlap, both micro-batches."""
        return 2 * sum(s.compute + s.comm for s in self.forward + self.backward)

    @property
    def per_op(self) -> float:
        """Both micro-batches one after the other, each stage a ring alone (today's commfuse)."""
        return 2 * sum(s.alone for s in self.forward + self.backward)

    def strands(self, which: StrandPlan) -> float:
        """The first forward alone, then ``which`` (the second forward beside the first backward), then the
        second backward alone."""
        return sum(s.alone for s in self.forward) + which.seconds + sum(s.alone for s in self.backward)

    @property
    def limit(self) -> float:
        """max(total compute, total comm) of the two micro-batches: what no schedule beats."""
        stages = self.forward + self.backward
        return 2 * max(sum(s.compute for s in stages), sum(s.comm for s in stages))


def predict_step(forward: Sequence[Stage], backward: Sequence[Stage], *, slowdown: float = 0.0) -> StepPrediction:
    """:class:`StepPrediction` of a block given its forward stages and its backward stages (in the order the
    backward runs them)."""
    f, b = tuple(forward), tuple(backward)
    return StepPrediction(f, b, plan(f, b, slowdown=slowdown), alternate(f, b, slowdown=slowdown))


def _gemm(profile: Profile, m: float, k: float, n: float) -> float:
    d = profile.dtype_bytes
    return kernel_time(profile, Kernel(flops=2.0 * m * k * n, bytes=d * (m * k + k * n + m * n)))


def llama_stages(profile: Profile, *, tp: int, tokens: int, seq: int, hidden: int, ffn: int) -> tuple[list, list]:
    """(forward stages, backward stages) of a Llama block under commfuse's TP with sequence parallelism on
    ``tp`` ranks: ``tokens`` = batch x seq of the whole sequence, causal attention, SwiGLU of ``ffn``. The
    backward's stages run in reverse, each its dgrad and wgrad GEMMs (twice the forward's) with the mirrored
    collective (a gather's backward is a reduce-scatter, and the other way)."""
    if tp < 2:
        raise CommfuseValueError(f"strands under TP need --tp >= 2 (a ring to hide), got {tp}")
    if tokens % tp or hidden % tp or ffn % tp:
        raise CommfuseValueError(f"tokens {tokens}, hidden {hidden} and ffn {ffn} must divide by tp {tp}")
    d = profile.dtype_bytes
    shard = tokens / tp * hidden * d  # one rank's rows of the block's input: what each gather / scatter moves
    ag = collective_time(profile, tp, shard, "all_gather")
    rs = collective_time(profile, tp, shard, "reduce_scatter")
    batch = max(1, tokens // seq)
    attention = kernel_time(profile, Kernel(flops=2.0 * batch * seq * seq * hidden / tp,  # causal: half of 4bs²h
                                            bytes=4.0 * tokens * hidden / tp * d))
    forward = [
        Stage("gather + QKV", _gemm(profile, tokens, hidden, 3 * hidden / tp), ag, ring=tp),
        Stage("attention core", attention),
        Stage("out-proj + reduce-scatter", _gemm(profile, tokens, hidden / tp, hidden), rs, ring=tp),
        Stage("gather + w1/w3", _gemm(profile, tokens, hidden, 2 * ffn / tp), ag, ring=tp),
        Stage("w2 + reduce-scatter", _gemm(profile, tokens, ffn / tp, hidden), rs, ring=tp),
    ]
    mirror = {ag: rs, rs: ag}
    backward = [Stage(s.name + " (backward)", 2 * s.compute, mirror.get(s.comm, s.comm), ring=s.ring)
                for s in reversed(forward)]
    return forward, backward


def moe_stages(profile: Profile, *, ep: int, tokens: int, seq: int, hidden: int, ffn: int, topk: int,
               shared_ffn: int = 0) -> tuple[list, list]:
    """(forward stages, backward stages) of a MoE block under expert parallelism on ``ep`` ranks, ``tokens``
    per rank: attention (local), the router, dispatch fused with the gate/up GEMM, the down GEMM producing
    the combine, and shared experts of ``shared_ffn`` (0: none), which have no communication."""
    if ep < 2:
        raise CommfuseValueError(f"strands under EP need --ep >= 2 (an all-to-all to hide), got {ep}")
    d = profile.dtype_bytes
    rows = tokens * topk  # routed rows each rank sends out and gets back, (ep - 1) / ep of them off-rank
    a2a = collective_time(profile, ep, rows / ep * hidden * d, "all_to_all")
    batch = max(1, tokens // seq)
    attention = (_gemm(profile, tokens, hidden, 4 * hidden)  # QKV and the output projection
                 + kernel_time(profile, Kernel(flops=2.0 * batch * seq * seq * hidden, bytes=4.0 * tokens * hidden * d)))
    forward = [
        Stage("attention", attention),
        Stage("router", _gemm(profile, tokens, hidden, 64)),
        Stage("dispatch + gate/up", _gemm(profile, rows, hidden, 2 * ffn), a2a, ring=ep),
        Stage("down + combine", _gemm(profile, rows, ffn, hidden), a2a, ring=ep),
    ]
    if shared_ffn:
        forward.append(Stage("shared experts", _gemm(profile, tokens, hidden, 3 * shared_ffn)))
    backward = [Stage(s.name + " (backward)", 2 * s.compute, s.comm, ring=s.ring) for s in reversed(forward)]
    return forward, backward
