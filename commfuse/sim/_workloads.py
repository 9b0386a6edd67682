"""Workloads: the layers commfuse fuses, written as ops the engine can cost.

Every op is a collective fused with a GEMM-like computation whose cost is
linear in the rows of the shard it handles (tokens for TP/SP, weight columns
for FSDP). :class:`ShardedOp` turns that into the engine's :class:`OpCost`:
the rows of each slice follow ``torch.tensor_split`` (shards of a size that
does not divide make ranks unequal, and the full engine then runs), a step's
compute is one kernel over all the rows it names (as the ops concatenate a
step's slices and call one matmul), messages carry ``rows * row_bytes``.

Shapes (T = batch * seq tokens, N = tp, f = ffn, h = hidden, d = bytes per element):

========== ================================================================
ag_matmul  column-parallel linear: all_gather(X (T/N, h)) @ W (h, f/N)
matmul_rs  row-parallel linear: reduce_scatter(X (T, f/N) @ W (f/N, h))
ag_matmul  backward: dX = dY @ W^T fused with the reduce-scatter (a
           matmul_rs of f/N columns), and the weight gradient X^T @ dY
matmul_rs  backward: all-gather of dY with the dgrad and the wgrad per shard
mlp        ag_matmul (fc1), activation, matmul_rs (fc2). Backward: all-gather
           of dY with fc2's dgrad and wgrad, activation backward, fc1's dgrad
           + reduce-scatter, fc1's wgrad (on the gathered X kept from forward).
           ``gated``: SwiGLU, fc1 the gate and up projections (W (h, 2f/N)) in
           one gather, as Llama's MLP
attention  query-split attention under TPSP (paper Algorithm 4): all-gather
           of X with the QKV projection, then per output shard its queries'
           attention plus the out-projection, as the producer of a
           reduce-scatter. ``causal`` (default): query position p attends to
           the p + 1 keys up to itself, so the shards of later positions cost
           more and the ring's steps are unequal across ranks (every rank is
           simulated). Heads (:func:`attention_widths`): ``heads`` query heads
           of ``head_dim``, ``kv_heads`` K/V heads (grouped-query: the QKV
           projection has (heads + 2 kv_heads) head_dim columns, split by head;
           K/V heads fewer than tp are copied, one to each rank), or ``mla``
           (DeepSeek's multi-head latent attention). Backward: all-gather of dY
           with the out-projection's dgrad and wgrad and each query slice's
           attention backward (:data:`ATTENTION_BACKWARD_RATIO` times its
           forward), then the QKV projection's dgrad + reduce-scatter and its
           wgrad
fsdp_linear ZeRO-3 linear over N = dp ranks: Y = X (T, h) @ W (h, f/tp), W
           sharded by output column; forward: all-gather of W fused with the
           GEMM; backward: all-gather of W with dX, reduce-scatter of dW with
           the weight-gradient GEMM
moe        one mixture-of-experts layer under expert parallelism over N = ep
           ranks (``commfuse.nn.MoE``): E SwiGLU experts of size f, E/N per
           rank, top-k routing, T tokens per rank. Forward: dispatch (an
           all-to-all of T*k token rows of h) consumed by the gate/up GEMM
           (x @ [w1|w3], h -> 2f) and SwiGLU per arriving block; combine (the
           produce side, ``produce_all_to_all``): the down GEMM (f -> h) of
           each destination's rows, then sent back. Backward: the mirror (dY
           dispatched to the down GEMM's dgrad + wgrad and SwiGLU's backward;
           the gate/up GEMM's dgrad + wgrad make dX blocks sent back). See
           :func:`_moe`
ring_attention context-parallel self-attention over N = cp ranks, forward and
           backward, causal with a load-balancing layout: commfuse ring
           attention (K/V blocks round the ring), vanilla (all-gather K/V
           first), Ulysses (all-to-all of heads) and the 2-D form; see
           ``commfuse.sim._ring_attention``
========== ================================================================

TP workloads simulate one TP group: with ``dp > 1`` the data-parallel
replicas run the same layer independently (their gradient reduction is not
part of the layer).

MoE's blocks are token rows, ``rows[source][dest]`` of them from each rank to
each rank: balanced routing gives every pair ``T*k/N`` (``skew`` > 1 sends a
larger share to rank 0, a hot expert rank). :class:`ExpertOp` costs them like
:class:`ShardedOp` does slices, with a grouped GEMM over the rank's local
experts in place of one matmul: its memory term reads the weights of every
local expert the rows reach, once per call, which is what makes many small
calls (fine-grained experts, many chunks) lose.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from commfuse.errors import CommfuseValueError, ScheduleError
from commfuse.schedule import CollectiveCall, Schedule, SliceId, Step, Transfer, build, split_sizes
from commfuse.schedule import parse_algorithm as _parse_algorithm
from commfuse.sim._engine import Phase
from commfuse.sim._model import Kernel
from commfuse.sim._profile import DTYPES
from commfuse.sim._ring_attention import BACKWARD_FLOPS_RATIO as ATTENTION_BACKWARD_RATIO
from commfuse.sim._ring_attention import LAYOUTS as _LAYOUTS
from commfuse.sim import _ring_attention

WORKLOADS = ("mlp", "attention", "ag_matmul", "matmul_rs", "fsdp_linear", "moe", "ring_attention")
PASSES = ("forward", "backward", "both")
#: Flops per element of the MLP activation (GELU, tanh form) and of its backward.
ACTIVATION_FLOPS = 8.0
#: Flops per output element of SwiGLU (silu(a) * b: an exp, a divide, two multiplies) and of its backward.
SWIGLU_FLOPS = 6.0
SWIGLU_BACKWARD_FLOPS = 12.0
#: How MoE's expert GEMMs are grouped into calls (:class:`ExpertOp`).
GROUPINGS = ("step", "source")
#: Bytes per routed-row count in the size exchange that opens every MoE call (int64).
COUNT_BYTES = 8

# Limits that refuse, before anything is built, what would take absurd memory or time (``--ep 100000`` was a
# MemoryError after a minute).
#: The largest size a workload takes (tp, dp, ep, seq, hidden, batch, ffn, experts, topk): four billion,
#: beyond any model's dim, and small enough that the products the model forms (at most ~1e49 flops, a MoE
#: layer's) stay finite as floats against any profile's rates (``commfuse.sim._profile``'s bounds).
MAX_DIM = 1 << 32
#: The largest schedule the simulator builds: this many ranks, and about this many steps (world size x parts
#: for the rings, chunks for sliced). Building and validating one takes up to ~30 us a step for the rings and
#: ~0.5 ms a chunk for sliced (~10 s at this bound), and the engine walks every step of every rank it
#: simulates (``commfuse.sim._engine.MAX_SIMULATED_ACTIONS``).
MAX_SCHEDULE_STEPS = 1 << 14
#: The most slices one MoE op's routing table may hold: ep x ep blocks, each cut into the schedule's slices.
#: The table is Python lists (~100 B a slice) walked step by step: ep 1024 with 4 slices a block is ~0.5 GB
#: and about a minute for a table; so this also bounds ep at 2048 (DeepSeek-V3 is served at EP 32 to 320).
MAX_ROUTED_PIECES = 1 << 22


#: Shapes of two well-known MoE layers for ``commfuse simulate --preset``, each at EP 8 with 8192 tokens per rank
#: (batch 1 x seq 8192), bf16. Mixtral-8x7B: Jiang et al., "Mixtral of Experts" (2024) and its released config
#: (hidden 4096, intermediate 14336, 8 experts, top-2). DeepSeek-V3: the DeepSeek-V3 technical report (2024):
#: hidden 7168, 256 routed experts of intermediate 2048, top-8; its one shared expert is left out (a dense
#: MLP on the rank's own tokens, no all-to-all), as are its node-limited routing (moot within 8 ranks) and its
#: dense first layers.
MOE_PRESETS = {
    "mixtral-8x7b": dict(hidden=4096, ffn=14336, experts=8, topk=2, ep=8, batch=1, seq=8192),
    "deepseek-v3": dict(hidden=7168, ffn=2048, experts=256, topk=8, ep=8, batch=1, seq=8192),
}


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3): queries through a ``q_lora``-wide latent, keys and
    values through a ``kv_lora``-wide one plus a ``rope``-wide key part shared by every head; per head a query
    and key of ``nope + rope`` and a value of ``v``."""

    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int

    def __post_init__(self) -> None:
        for f in ("q_lora", "kv_lora", "nope", "rope", "v"):
            _positive(f"mla.{f}", getattr(self, f))


@dataclass(frozen=True)
class AttentionWidths:
    """One TP rank's widths of the attention workload, in elements (:func:`attention_widths`): ``qk``, the
    query (and key) width its heads' scores take (query heads x their dim); ``vw``, the value width (the
    out-projection's input); ``kv``, the K/V elements read per key; ``proj``, the columns of the GEMM fused
    with the all-gather of X (split by head, or with ``mla`` the latents, which every rank computes whole);
    ``up_flops`` and ``up_weights``, per token row the flops and the weight elements of MLA's up-projections
    (0 without), done after the gather on every row."""

    qk: int
    vw: int
    kv: int
    proj: int
    up_flops: float = 0.0
    up_weights: float = 0.0
    up_width: int = 0


def parse_algorithm(text: str) -> tuple[str, int, int]:
    """``"ring:2"`` -> ``("ring", parts=2, chunks=1)``; ``"sliced"`` -> ``("sliced", 1, 2)``: the ops' grammar
    (``commfuse.schedule.parse_algorithm``), less ``auto`` (the simulator is what ``auto`` asks) and
    ``serial`` (it models each schedule with its overlap)."""
    spec = _parse_algorithm(text)
    if spec.name in ("auto", "serial"):
        raise CommfuseValueError(
            f"the simulator models the schedules themselves: give ring, bidirectional, sliced or vanilla "
            f"(optionally ':N'), not {text!r}"
        )
    return spec.name, spec.parts, spec.chunks


#: Above this world size the simulator skips ``build``'s symbolic validation: at 4096 ranks it is ~90% of the
#: build time, and the schedule is the builder's same output (the executor validates it when it builds it).
VALIDATE_LIMIT = 1024


@functools.lru_cache(maxsize=256)
def schedule_for(collective: str, world_size: int, algorithm: str) -> Schedule:
    """The schedule the ops would run for ``algorithm``: ``commfuse.schedule.build``'s, cached."""
    name, parts, chunks = parse_algorithm(algorithm)
    steps = world_size * parts if name in ("ring", "bidirectional") else chunks if name == "sliced" else 1
    if max(world_size, steps) > MAX_SCHEDULE_STEPS:
        what = f"{world_size} ranks" if world_size > MAX_SCHEDULE_STEPS else f"about {steps} steps"
        raise CommfuseValueError(
            f"{collective} over {world_size} ranks with {algorithm!r} is a schedule of {what}, over the simulator's "
            f"limit of {MAX_SCHEDULE_STEPS} (commfuse.sim._workloads.MAX_SCHEDULE_STEPS): give fewer ranks, parts "
            "or chunks")
    return build(collective, world_size, algorithm=name, parts=parts, chunks=chunks,
                 validate=world_size <= VALIDATE_LIMIT)


class ShardedOp:
    """The costs of one fused op whose work and messages are linear in rows of a sharded dim.

    ``rows``: the size of the sharded dim summed over shards (what is gathered,
    or what is scattered); ``row_bytes``: bytes one row of what travels takes;
    ``row_flops`` / ``row_mem``: flops and memory bytes per row computed;
    ``fixed_mem``: memory bytes every kernel touches whatever its rows (the
    weight); ``cat_row_bytes``: bytes copied per row when a step's slices are
    concatenated before the matmul (``cat``: ``"always"`` when a step has more
    than one slice, as the all-gather ops do, ``"gaps"`` only when they are not
    adjacent, as the reduce-scatter ops do); ``add_row_bytes``: bytes per row of
    the running sum that reduce-scatter adds.
    """

    def __init__(self, schedule: Schedule, *, rows: int, row_bytes: float, row_flops: float, row_mem: float = 0.0,
                 fixed_mem: float = 0.0, cat_row_bytes: float = 0.0, cat: str = "always",
                 add_row_bytes: float = 0.0, name: str = "") -> None:
        self.schedule, self.rows, self.row_bytes, self.row_flops = schedule, rows, row_bytes, row_flops
        self.row_mem, self.fixed_mem, self.cat_row_bytes, self.cat = row_mem, fixed_mem, cat_row_bytes, cat
        self.add_row_bytes, self.name = add_row_bytes, name
        n, pieces = schedule.world_size, schedule.pieces
        self.shard_rows = split_sizes(rows, n)
        self.uniform = rows % n == 0 and (rows // n) % pieces == 0
        if self.uniform:  # every slice alike: one row of sizes serves all shards
            same = split_sizes(rows // n, pieces)
            self.piece_rows = [same] * n
        else:
            self.piece_rows = [split_sizes(s, pieces) for s in self.shard_rows]
        self._offsets: list[list[int]] | None = None
        self._compute: dict = {}

    def slice_rows(self, x: SliceId) -> int:
        return self.piece_rows[x.shard][self.schedule.piece(x)]

    def offset(self, x: SliceId) -> int:
        """Where slice ``x`` starts along the sharded dim (its shards laid out in rank order)."""
        if self._offsets is None:
            self._offsets, start = [], 0
            for sizes in self.piece_rows:
                offs = []
                for size in sizes:
                    offs.append(start)
                    start += size
                self._offsets.append(offs)
        return self._offsets[x.shard][self.schedule.piece(x)]

    def _gemm(self, slices: Sequence[SliceId]) -> tuple[Kernel, ...]:
        rows = [self.slice_rows(x) for x in slices]
        total = sum(rows)
        kernels = []
        if len(slices) > 1 and self.cat_row_bytes:
            copy = self.cat == "always"
            if not copy and self.uniform:
                # adjacency in ring order (the last slice of shard N-1 next to the first of shard 0): the
                # same on every rank, so ranks stay alike; it differs from the ops only in the rare step
                # whose two slices meet across that wrap
                pieces = self.schedule.pieces
                around = self.schedule.world_size * pieces
                pos = sorted({x.shard * pieces + self.schedule.piece(x) for x in slices})
                breaks = sum(1 for a, b in zip(pos, pos[1:] + [pos[0] + around]) if b - a != 1)
                copy = len(pos) < around and breaks != 1
            elif not copy:
                spans = sorted((self.offset(x), r) for x, r in zip(slices, rows))
                copy = any(a + ra != b for (a, ra), (b, _) in zip(spans, spans[1:]))
            if copy:
                kernels.append(Kernel(0.0, total * self.cat_row_bytes, f"{self.name} cat"))
        kernels.append(Kernel(total * self.row_flops, total * self.row_mem + self.fixed_mem, self.name))
        return tuple(kernels)

    def compute(self, rank: int, step: Step | None) -> Sequence[Kernel]:
        if step is None or not step.compute:
            return ()
        if self.uniform:  # every slice alike: the kernels depend on how many, and on adjacency for "gaps"
            key = (len(step.compute), step.index if self.cat == "gaps" and len(step.compute) > 1 else None)
            found = self._compute.get(key)
            if found is None:
                found = self._compute[key] = self._gemm(step.compute)
            return found
        return self._gemm(step.compute)

    def add(self, rank: int, step: Step) -> Sequence[Kernel]:
        out = []
        for x in step.accumulate:
            r = self.slice_rows(x)
            out.append(Kernel(r * self.add_row_bytes / 2, 3 * r * self.add_row_bytes, f"{self.name} add"))
        return out

    def transfer_bytes(self, rank: int, transfer: Transfer) -> float:
        return self.slice_rows(transfer.slice) * self.row_bytes

    def collective_bytes(self, rank: int, call: CollectiveCall) -> float:
        # a ring step of the collective moves one rank's piece; the largest piece paces the ring
        return max(sizes[call.part] for sizes in self.piece_rows) * self.row_bytes

    def flops(self, rank: int) -> float:
        return self.rows * self.row_flops


class QuerySliceOp(ShardedOp):
    """The query-split attention's ops: a slice is the queries of sequence positions [start, end) of every batch
    row (the sequence split as ``torch.tensor_split`` splits it, into shards, then each shard into the schedule's
    pieces), and one query row costs ``row_flops`` plus ``key_flops`` per key it attends to: all ``seq``, or with
    ``causal`` the positions up to its own. A step's kernel reads ``kv_key_bytes`` per key of every batch row,
    up to the last key its slices see. With ``causal`` the ranks' steps differ (each computes another shard at
    each step), so the engine simulates every rank."""

    def __init__(self, schedule: Schedule, *, batch: int, seq: int, causal: bool, key_flops: float,
                 kv_key_bytes: float, **kw) -> None:
        super().__init__(schedule, rows=batch * seq, **kw)
        n, pieces = schedule.world_size, schedule.pieces
        self.batch, self.seq, self.causal = batch, seq, causal
        self.key_flops, self.kv_key_bytes = key_flops, kv_key_bytes
        lengths = [split_sizes(s, pieces) for s in split_sizes(seq, n)]
        self.piece_rows = [[batch * x for x in sizes] for sizes in lengths]
        self.shard_rows = [batch * sum(sizes) for sizes in lengths]
        self.uniform = not causal and seq % n == 0 and (seq // n) % pieces == 0
        self._offsets = None

    def span(self, x: SliceId) -> tuple[int, int]:
        """The sequence positions [start, end) of slice ``x``."""
        start = self.offset(x) // self.batch
        return start, start + self.slice_rows(x) // self.batch

    def keys(self, start: int, end: int) -> int:
        """Keys attended to by the queries of positions [start, end) of one batch row, summed over the rows."""
        if not self.causal:
            return (end - start) * self.seq
        return (end * (end + 1) - start * (start + 1)) // 2

    def _gemm(self, slices: Sequence[SliceId]) -> tuple[Kernel, ...]:
        kernels = list(super()._gemm(slices))
        spans = [self.span(x) for x in slices]
        pairs = self.batch * sum(self.keys(a, b) for a, b in spans)
        seen = max(b for _, b in spans) if self.causal else self.seq
        main = kernels[-1]
        kernels[-1] = Kernel(main.flops + pairs * self.key_flops,
                             main.bytes + self.batch * seen * self.kv_key_bytes, main.name)
        return tuple(kernels)

    def flops(self, rank: int) -> float:
        return self.rows * self.row_flops + self.batch * self.keys(0, self.seq) * self.key_flops


class ComputeOnly:
    """A phase with no communication: one kernel on every rank."""

    uniform = True

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel

    def compute(self, rank, step):
        return (self.kernel,)

    def add(self, rank, step):
        return ()

    def transfer_bytes(self, rank, transfer):  # pragma: no cover - never called: no schedule
        return 0.0

    def collective_bytes(self, rank, call):  # pragma: no cover - never called: no schedule
        return 0.0

    def flops(self, rank):
        return self.kernel.flops


class ExpertOp:
    """The costs of one fused op of MoE: all-to-all blocks of token rows and the grouped GEMMs on them.

    ``rows[s][d]``: rows of the block the schedule names ``s>d`` (``SliceId``
    source s, shard d), each ``row_bytes`` on the wire; a block of ``pieces``
    slices is cut as ``torch.tensor_split`` cuts it. ``produce``: False for
    the consume side (``all_to_all``: rank d computes on the blocks ``s>d``
    it received), True for the produce side (``produce_all_to_all``: rank s
    makes its blocks ``s>d``, which later steps send). ``kernels``: per call,
    ``(name, flops per row, memory bytes per row, weight bytes per expert)``;
    a call over r rows reads the weights of the ``min(local_experts, r)``
    experts those rows reach (balanced routing) on top of its rows.

    ``grouping``: ``"step"``, one grouped GEMM per step over every row the
    step names (the schedule as drawn: sliced's chunks and ring:m's parts are
    each computed as they come, and vanilla is one call over everything);
    ``"source"``, what ``commfuse.nn.MoE`` does as of this writing: one call
    per source block, the consume side calling it once all of a block's
    slices have arrived, the produce side making the whole block when its
    first slice is due (so sliced:c and ring:m chunk the messages but not the
    compute).
    """

    def __init__(self, schedule: Schedule, *, rows: Sequence[Sequence[int]], row_bytes: float,
                 kernels: Sequence[tuple[str, float, float, float]], local_experts: int, produce: bool,
                 grouping: str = "step", name: str = "") -> None:
        if grouping not in GROUPINGS:
            raise CommfuseValueError(f"grouping must be one of {', '.join(GROUPINGS)}, got {grouping!r}")
        n, pieces = schedule.world_size, schedule.pieces
        if n * n * pieces > MAX_ROUTED_PIECES:
            raise CommfuseValueError(
                f"{name}: {n} x {n} blocks of {pieces} slices each is over the simulator's limit of "
                f"{MAX_ROUTED_PIECES} routed slices (commfuse.sim._workloads.MAX_ROUTED_PIECES): give fewer ranks, "
                "parts or chunks")
        if len(rows) != n or any(len(r) != n for r in rows):
            raise CommfuseValueError(f"{name}: rows must be {n} x {n} (source x destination)")
        self.schedule, self.row_bytes, self.kernels = schedule, row_bytes, tuple(kernels)
        self.local_experts, self.produce, self.grouping, self.name = local_experts, produce, grouping, name
        self.rows = [list(r) for r in rows]
        self.piece_rows = [[split_sizes(b, pieces) for b in r] for r in self.rows]
        first = self.rows[0][0]
        self.uniform = all(b == first for r in self.rows for b in r)
        self._calls: dict[int, tuple[Kernel, ...]] = {}

    def slice_rows(self, x: SliceId) -> int:
        return self.piece_rows[x.source][x.shard][self.schedule.piece(x)]

    def _call(self, rows: int) -> tuple[Kernel, ...]:
        """The kernels of one grouped call over ``rows`` rows."""
        found = self._calls.get(rows)
        if found is None:
            experts = min(self.local_experts, rows)
            found = self._calls[rows] = tuple(
                Kernel(rows * flops, rows * mem + experts * weight, f"{self.name} {what}")
                for what, flops, mem, weight in self.kernels) if rows > 0 else ()
        return found

    def compute(self, rank: int, step: Step | None) -> Sequence[Kernel]:
        if step is None or not step.compute:
            return ()
        if self.grouping == "step":
            return self._call(sum(self.slice_rows(x) for x in step.compute))
        pieces, out = self.schedule.pieces, []
        for x in step.compute:
            due = self.schedule.piece(x) == (0 if self.produce else pieces - 1)
            if due:
                rows = self.rows[x.source][x.shard]
                if pieces > 1 and not self.produce:  # the consumer gets the block's slices concatenated
                    out.append(Kernel(0.0, 2.0 * rows * self.row_bytes, f"{self.name} cat"))
                out.extend(self._call(rows))
        return out

    def add(self, rank: int, step: Step) -> Sequence[Kernel]:
        return ()

    def transfer_bytes(self, rank: int, transfer: Transfer) -> float:
        return self.slice_rows(transfer.slice) * self.row_bytes

    def collective_bytes(self, rank: int, call: CollectiveCall) -> float:
        # a whole all-to-all is costed as (N - 1) pieces per rank: the piece that makes this rank's own
        # traffic (the larger of what it sends and what it receives, its own block excluded)
        n, piece = self.schedule.world_size, call.part
        if n == 1:
            return 0.0
        sent = sum(self.piece_rows[rank][d][piece] for d in range(n) if d != rank)
        got = sum(self.piece_rows[s][rank][piece] for s in range(n) if s != rank)
        return max(sent, got) * self.row_bytes / (n - 1)

    def flops(self, rank: int) -> float:
        n = self.schedule.world_size
        rows = sum(self.rows[rank][d] for d in range(n)) if self.produce else sum(self.rows[s][rank] for s in range(n))
        return rows * sum(k[1] for k in self.kernels)


class SizesOp:
    """MoE's size exchange: one small whole all-to-all of per-expert row counts, no compute."""

    uniform = True

    def __init__(self, count_bytes: float) -> None:
        self.count_bytes = count_bytes

    def compute(self, rank, step):
        return ()

    def add(self, rank, step):
        return ()

    def transfer_bytes(self, rank, transfer):  # pragma: no cover - vanilla only: no point-to-point
        return self.count_bytes

    def collective_bytes(self, rank, call):
        return self.count_bytes

    def flops(self, rank):
        return 0.0


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM:
        raise CommfuseValueError(f"{name} must be an integer from 1 to {MAX_DIM} (commfuse.sim._workloads.MAX_DIM), "
                                 f"got {value!r}")
    return value


@dataclass(frozen=True)
class Workload:
    """A layer and its sizes: ``name`` in :data:`WORKLOADS`, tokens = ``batch * seq`` (per DP rank; for ``moe``
    per EP rank).

    ``moe`` only: ``ep`` ranks, ``experts`` (a multiple of ``ep``), ``topk``
    (at most ``experts``), ``ffn`` per expert, ``skew`` (>= 1, at most ``ep``:
    rank 0's share of every rank's routed rows over the balanced share, a hot
    expert rank) and ``grouping`` (:class:`ExpertOp`). ``tp`` and ``dp`` stay 1.

    ``ring_attention`` only (``commfuse.sim._ring_attention``): ``cp`` ranks, ``heads`` query heads (default
    hidden / 128), ``kv_heads`` (default ``heads``), ``head_dim`` (default hidden / heads), ``layout``
    (zigzag, contiguous or none: not causal) and ``kv_replicate`` (let Ulysses run over more ranks than
    K/V heads). ``tp`` and ``dp`` stay 1.

    ``attention`` only: ``causal`` (None: True), ``heads`` (None: multi-head attention whose heads times
    head dim make ``hidden``, split over tp), ``kv_heads`` (default ``heads``; fewer: grouped-query),
    ``head_dim`` (default hidden / heads) or ``mla`` (:class:`MLA`, with ``heads``; its own head dims).
    ``mlp`` only: ``gated`` (SwiGLU: fc1 holds the gate and up projections, 2 ffn columns).
    """

    name: str
    tp: int
    seq: int
    hidden: int
    batch: int = 1
    dp: int = 1
    ffn: int | None = None
    dtype: str = "bfloat16"
    passes: str = "forward"
    ep: int = 1
    experts: int = 8
    topk: int = 2
    skew: float = 1.0
    grouping: str = "step"
    cp: int = 1
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    layout: str = "zigzag"
    kv_replicate: bool = False
    causal: bool | None = None
    gated: bool = False
    mla: MLA | None = None

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise CommfuseValueError(f"unknown workload {self.name!r}; expected one of {', '.join(WORKLOADS)}")
        for f in ("tp", "seq", "hidden", "batch", "dp", "ep", "experts", "topk", "cp"):
            _positive(f, getattr(self, f))
        if self.name == "ring_attention":
            self._check_ring_attention()
        elif self.cp != 1:
            raise CommfuseValueError(f"{self.name}: cp={self.cp} applies to the ring_attention workload only")
        if self.name == "moe":
            self._check_moe()
        elif self.ep != 1:
            raise CommfuseValueError(f"{self.name}: ep={self.ep} applies to the moe workload only (the ring of "
                                     f"{self.name} is tp, or dp for fsdp_linear)")
        if self.ffn is None:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        _positive("ffn", self.ffn)
        if self.dtype not in DTYPES:
            raise CommfuseValueError(f"unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        if self.passes not in PASSES:
            raise CommfuseValueError(f"passes must be one of {', '.join(PASSES)}, got {self.passes!r}")
        if self.name == "attention":
            self._check_attention()
        elif self.causal is not None or self.mla is not None:
            what = "causal" if self.causal is not None else "mla"
            raise CommfuseValueError(f"{self.name}: {what} applies to the attention workload only"
                                     + (" (ring_attention: layout='none' is not causal)"
                                        if self.name == "ring_attention" and what == "causal" else ""))
        if self.gated and self.name != "mlp":
            raise CommfuseValueError(f"{self.name}: gated (SwiGLU) applies to the mlp workload only")
        if self.name in ("moe", "ring_attention", "attention"):
            pass
        elif self.name == "fsdp_linear":
            if self.ffn % self.tp:
                raise CommfuseValueError(f"fsdp_linear: ffn {self.ffn} must divide by tp {self.tp} (the TP shard "
                                         f"of the weight's columns)")
        else:
            for f in ("hidden",) if self.name == "attention" else ("ffn",):
                if getattr(self, f) % self.tp:
                    raise CommfuseValueError(f"{self.name}: {f} {getattr(self, f)} must divide by tp {self.tp} "
                                             f"(weights are split evenly across TP ranks)")

    def _check_attention(self) -> None:
        if self.causal is None:
            object.__setattr__(self, "causal", True)
        if self.heads is None:
            for f in ("kv_heads", "head_dim", "mla"):
                if getattr(self, f) is not None:
                    raise CommfuseValueError(f"attention: {f} needs heads (the query heads)")
            if self.hidden % self.tp:
                raise CommfuseValueError(f"attention: hidden {self.hidden} must divide by tp {self.tp} (without "
                                         f"heads, the heads times their dim are the hidden size, split over tp)")
            return
        heads = _positive("heads", self.heads)
        if heads % self.tp:
            raise CommfuseValueError(f"attention: {heads} query heads do not split over tp {self.tp}")
        if self.mla is not None:
            if self.kv_heads not in (None, heads) or self.head_dim is not None:
                raise CommfuseValueError("attention: with mla the heads' dims are mla's and every query head has "
                                         "its own key and value: give no kv_heads or head_dim")
            object.__setattr__(self, "kv_heads", heads)
            return
        kv = heads if self.kv_heads is None else _positive("kv_heads", self.kv_heads)
        if heads % kv:
            raise CommfuseValueError(f"attention: {heads} query heads must be a multiple of the {kv} K/V heads "
                                     f"(grouped-query attention)")
        if kv % self.tp and self.tp % kv:
            raise CommfuseValueError(f"attention: {kv} K/V heads neither split over tp {self.tp} nor copy evenly "
                                     f"to its ranks (tp a multiple of them)")
        if self.head_dim is None and self.hidden % heads:
            raise CommfuseValueError(f"attention: hidden {self.hidden} does not divide by {heads} heads; give "
                                     f"head_dim")
        object.__setattr__(self, "kv_heads", kv)
        object.__setattr__(self, "head_dim", self.hidden // heads if self.head_dim is None else
                           _positive("head_dim", self.head_dim))

    def _check_ring_attention(self) -> None:
        if self.tp != 1 or self.dp != 1:
            raise CommfuseValueError(f"ring_attention models one context-parallel group: give its size as cp, not "
                                     f"tp={self.tp} / dp={self.dp}")
        heads = self.hidden // 128 if self.heads is None else self.heads
        _positive("heads", heads)
        kv = heads if self.kv_heads is None else self.kv_heads
        _positive("kv_heads", kv)
        if heads % kv:
            raise CommfuseValueError(f"ring_attention: {heads} query heads must be a multiple of the {kv} K/V heads "
                                     f"(grouped-query attention)")
        if self.head_dim is None and self.hidden % heads:
            raise CommfuseValueError(f"ring_attention: hidden {self.hidden} does not divide by {heads} heads; give "
                                     f"head_dim")
        dim = self.hidden // heads if self.head_dim is None else self.head_dim
        _positive("head_dim", dim)
        object.__setattr__(self, "heads", heads)
        object.__setattr__(self, "kv_heads", kv)
        object.__setattr__(self, "head_dim", dim)
        if self.layout not in _LAYOUTS:
            raise CommfuseValueError(f"ring_attention: layout must be one of {', '.join(_LAYOUTS)}, "
                                     f"got {self.layout!r}")
        per = 2 * self.cp if self.layout == "zigzag" else self.cp
        if self.seq % per:
            raise CommfuseValueError(f"ring_attention: seq {self.seq} must divide into {per} equal chunks (cp "
                                     f"{self.cp}, {self.layout} layout)")

    def _check_moe(self) -> None:
        if self.tp != 1 or self.dp != 1:
            raise CommfuseValueError(f"moe models one expert-parallel group: give its size as ep, not tp={self.tp} "
                                     f"/ dp={self.dp} (experts are not tensor-parallel here)")
        if self.ep * self.ep > MAX_ROUTED_PIECES:
            raise CommfuseValueError(
                f"moe: ep={self.ep} routes over a table of {self.ep} x {self.ep} blocks, over the simulator's limit of "
                f"{MAX_ROUTED_PIECES} (commfuse.sim._workloads.MAX_ROUTED_PIECES; ep up to "
                f"{int(MAX_ROUTED_PIECES ** 0.5)})")
        if self.experts % self.ep:
            raise CommfuseValueError(f"moe: {self.experts} experts do not divide over ep={self.ep} ranks (each rank "
                                     f"holds experts/ep of them)")
        if self.topk > self.experts:
            raise CommfuseValueError(f"moe: topk={self.topk} is more than the {self.experts} experts")
        if isinstance(self.skew, bool) or not isinstance(self.skew, (int, float)) or not 1.0 <= self.skew <= self.ep:
            raise CommfuseValueError(f"moe: skew must be a number from 1 (balanced) to ep={self.ep} (every row to "
                                     f"rank 0), got {self.skew!r}")
        if self.grouping not in GROUPINGS:
            raise CommfuseValueError(f"moe: grouping must be one of {', '.join(GROUPINGS)}, got {self.grouping!r}")

    @property
    def world_size(self) -> int:
        """Ranks of the group the layer's collectives run over: ``dp`` for FSDP, ``ep`` for MoE, else ``tp``."""
        if self.name == "ring_attention":
            return self.cp
        return self.dp if self.name == "fsdp_linear" else self.ep if self.name == "moe" else self.tp

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    def routed_rows(self) -> list[list[int]]:
        """MoE: ``rows[s][d]``, the token rows rank s sends rank d (``batch * seq * topk`` per source).

        Balanced (``skew`` 1): split as evenly as ``torch.tensor_split`` would. Otherwise rank 0 takes
        ``skew / ep`` of every source's rows and the other ranks share the rest evenly.
        """
        n, total = self.ep, self.tokens * self.topk
        if self.skew == 1.0 or n == 1:
            row = split_sizes(total, n)
        else:
            hot = min(total, round(total * self.skew / n))
            row = [hot, *split_sizes(total - hot, n - 1)]
        return [list(row) for _ in range(n)]

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype]

    def describe(self) -> str:
        if self.name == "moe":
            text = (f"moe {self.passes}, ep {self.ep}, {self.experts} experts ({self.local_experts} per rank), "
                    f"top-{self.topk}, {self.tokens} tokens per rank, hidden {self.hidden}, expert ffn {self.ffn}")
            if self.skew != 1.0:
                text += f", skew {self.skew:g}"
            if self.grouping != "step":
                text += f", one GEMM call per {self.grouping}"
            return text + f", {self.dtype}"
        if self.name == "ring_attention":
            causal = "not causal" if self.layout == "none" else f"causal, {self.layout} layout"
            return (f"ring_attention {self.passes}, cp {self.cp}, batch {self.batch}, seq {self.seq}, {self.heads} "
                    f"query heads, {self.kv_heads} K/V heads, head dim {self.head_dim}, {causal}, {self.dtype}")
        text = (f"{self.name} {self.passes}, tp {self.tp}" + (f", dp {self.dp}" if self.dp > 1 else "")
                + f", (b, s, h) = ({self.batch}, {self.seq}, {self.hidden})")
        if self.name in ("mlp", "ag_matmul", "matmul_rs", "fsdp_linear"):
            text += f", ffn {self.ffn}" + (" (SwiGLU)" if self.gated else "")
        if self.name == "attention":
            if self.mla is not None:
                m = self.mla
                text += (f", {self.heads} heads of MLA (latents q {m.q_lora}, kv {m.kv_lora}; head dims "
                         f"{m.nope} + {m.rope} rope, v {m.v})")
            elif self.heads is not None:
                text += f", {self.heads} query heads, {self.kv_heads} K/V heads, head dim {self.head_dim}"
            text += ", causal" if self.causal else ", not causal"
        return text + f", {self.dtype}"

    def phases(self, algorithm: str) -> list[Phase]:
        """The ops of this layer, each with the schedule ``algorithm`` names."""
        return _BUILD[self.name](self, algorithm)

    def check_algorithm(self, algorithm: str) -> None:
        """Refuse an ``algorithm`` this workload has no model of, before anything runs."""
        if self.name == "ring_attention":
            _ring_attention.check_heads(self, _ring_attention.parse(algorithm, self.cp))
        else:
            parse_algorithm(algorithm)


def _op(collective: str, w: Workload, algorithm: str, name: str, **kw) -> Phase:
    schedule = schedule_for(collective, w.world_size, algorithm)
    return Phase(name, ShardedOp(schedule, name=name, **kw), schedule)


def _ag_matmul(w: Workload, algorithm: str, name: str = "ag_matmul", extra: int = 1,
               cols: int | None = None) -> Phase:
    """All-gather of X (T/N, h) fused with X @ W (h, cols); ``extra`` 2: also the weight gradient per shard (the
    backward of a row-parallel linear: dY gathered, its dgrad and wgrad)."""
    d, h = w.dtype_bytes, w.hidden
    cols = w.ffn // w.tp if cols is None else cols
    return _op("all_gather", w, algorithm, name, rows=w.tokens, row_bytes=h * d, row_flops=2.0 * h * cols * extra,
               row_mem=(h + cols) * d * extra, fixed_mem=h * cols * d * extra, cat_row_bytes=2.0 * h * d)


def _matmul_rs(w: Workload, algorithm: str, name: str = "matmul_rs", cols: int | None = None) -> Phase:
    """X (T, cols) @ W (cols, h) fused with the reduce-scatter of the product (T/N, h) per rank."""
    d, h = w.dtype_bytes, w.hidden
    cols = w.ffn // w.tp if cols is None else cols
    return _op("reduce_scatter", w, algorithm, name, rows=w.tokens, row_bytes=h * d, row_flops=2.0 * cols * h,
               row_mem=(cols + h) * d, fixed_mem=cols * h * d, cat_row_bytes=2.0 * cols * d, cat="gaps",
               add_row_bytes=h * d)


def _wgrad(w: Workload, name: str, cols: int) -> Phase:
    """A column-parallel linear's weight gradient, X^T (h, T) @ dY (T, cols), on the X gathered in the forward."""
    d, h, t = w.dtype_bytes, w.hidden, w.tokens
    return Phase(name, ComputeOnly(Kernel(2.0 * t * h * cols, (t * (h + cols) + h * cols) * d, name)))


def _column_backward(w: Workload, algorithm: str, name: str, cols: int) -> list[Phase]:
    """The backward of a column-parallel linear (h -> cols) with SP: dX = dY @ W^T fused with its reduce-scatter,
    then the weight gradient."""
    return [_matmul_rs(w, algorithm, f"{name}.dgrad", cols), _wgrad(w, f"{name}.wgrad", cols)]


def _elementwise(name: str, elements: float, d: int, flops_per: float) -> Phase:
    return Phase(name, ComputeOnly(Kernel(elements * flops_per, 2.0 * elements * d, name)))


def _swiglu(name: str, elements: float, d: int, backward: bool) -> Phase:
    """SwiGLU on ``elements`` outputs: silu(a) * b reads two elements and writes one; its backward reads three
    (a, b and the output gradient) and writes two."""
    if backward:
        return Phase(name, ComputeOnly(Kernel(elements * SWIGLU_BACKWARD_FLOPS, 5.0 * elements * d, name)))
    return Phase(name, ComputeOnly(Kernel(elements * SWIGLU_FLOPS, 3.0 * elements * d, name)))


def _forward(w: Workload) -> bool:
    return w.passes in ("forward", "both")


def _backward(w: Workload) -> bool:
    return w.passes in ("backward", "both")


def _linear(w: Workload, algorithm: str, collective: str) -> list[Phase]:
    """The ag_matmul (column-parallel) or matmul_rs (row-parallel) workload, forward and/or backward."""
    cols = w.ffn // w.tp
    phases = []
    if collective == "all_gather":
        if _forward(w):
            phases.append(_ag_matmul(w, algorithm))
        if _backward(w):
            phases += _column_backward(w, algorithm, "ag_matmul", cols)
    else:
        if _forward(w):
            phases.append(_matmul_rs(w, algorithm))
        if _backward(w):
            phases.append(_ag_matmul(w, algorithm, "matmul_rs.backward", extra=2))
    return phases


def _mlp(w: Workload, algorithm: str) -> list[Phase]:
    cols, d, t = w.ffn // w.tp, w.dtype_bytes, w.tokens
    up = 2 * cols if w.gated else cols  # SwiGLU: the gate and up projections in one GEMM
    phases = []
    if _forward(w):
        phases += [
            _ag_matmul(w, algorithm, "fc1", cols=up),
            _swiglu("act", t * cols, d, False) if w.gated else _elementwise("act", t * cols, d, ACTIVATION_FLOPS),
            _matmul_rs(w, algorithm, "fc2"),
        ]
    if _backward(w):
        phases += [
            # all-gather dY; per shard: dgrad dH_rows = dY_rows @ W2^T and wgrad dW2 += H_rows^T @ dY_rows
            _ag_matmul(w, algorithm, "fc2.backward", extra=2),
            _swiglu("act.backward", t * cols, d, True) if w.gated
            else _elementwise("act.backward", t * cols, d, ACTIVATION_FLOPS),
            *_column_backward(w, algorithm, "fc1", up),
        ]
    return phases


def attention_widths(w: Workload) -> AttentionWidths:
    """One TP rank's widths of the attention workload ``w`` (:class:`AttentionWidths`).

    Without ``heads``: multi-head attention of hidden / tp query, key and value columns per rank. With
    ``heads``, ``kv_heads`` and ``head_dim``: heads / tp query heads per rank and kv_heads / tp K/V heads, or
    one where tp exceeds kv_heads (each K/V head copied to tp / kv_heads ranks). With ``mla``: heads / tp
    heads of ``nope + rope`` query/key and ``v`` value dims; the gathered X feeds the down-projections to the
    latents (q_lora + kv_lora + rope columns, the same on every rank); the up-projections (q_lora -> the
    queries, kv_lora -> the keys' nope part and the values) run on every gathered row; a key is its heads'
    nope parts plus the one shared rope part.
    """
    if w.heads is None:
        cols = w.hidden // w.tp
        return AttentionWidths(qk=cols, vw=cols, kv=2 * cols, proj=3 * cols)
    q = w.heads // w.tp
    if w.mla is not None:
        m = w.mla
        q_out, kv_out = q * (m.nope + m.rope), q * (m.nope + m.v)  # the up-projections' columns
        up = m.q_lora * q_out + m.kv_lora * kv_out  # and their weights' elements
        return AttentionWidths(qk=q_out, vw=q * m.v, kv=q * (m.nope + m.v) + m.rope,
                               proj=m.q_lora + m.kv_lora + m.rope, up_flops=2.0 * up, up_weights=float(up),
                               up_width=q_out + kv_out)
    kv = max(1, w.kv_heads // w.tp)
    return AttentionWidths(qk=q * w.head_dim, vw=q * w.head_dim, kv=2 * kv * w.head_dim,
                           proj=(q + 2 * kv) * w.head_dim)


def _query_slices(w: Workload, algorithm: str, collective: str, name: str, *, row_flops: float, key_flops: float,
                  row_mem: float, kv_key_bytes: float, fixed_mem: float, cat_row_bytes: float, cat: str,
                  add_row_bytes: float = 0.0) -> Phase:
    schedule = schedule_for(collective, w.world_size, algorithm)
    cost = QuerySliceOp(schedule, batch=w.batch, seq=w.seq, causal=w.causal, key_flops=key_flops,
                        kv_key_bytes=kv_key_bytes, row_bytes=w.hidden * w.dtype_bytes, row_flops=row_flops,
                        row_mem=row_mem, fixed_mem=fixed_mem, cat_row_bytes=cat_row_bytes, cat=cat,
                        add_row_bytes=add_row_bytes, name=name)
    return Phase(name, cost, schedule)


def _attention(w: Workload, algorithm: str) -> list[Phase]:
    d, h, t = w.dtype_bytes, w.hidden, w.tokens
    a = attention_widths(w)
    pair = 2.0 * a.qk + 2.0 * a.vw  # flops per (query, key) pair of this rank's heads: Q K^T and P V
    phases = []
    up = None
    if w.mla is not None:  # the up-projections read the latents and write every head's query, key and value
        latents = w.mla.q_lora + w.mla.kv_lora
        up = Kernel(t * a.up_flops, (t * (latents + a.up_width) + a.up_weights) * d, "mla.up")
    if _forward(w):
        phases.append(_ag_matmul(w, algorithm, "qkv", cols=a.proj))
        if up is not None:
            phases.append(Phase("mla.up", ComputeOnly(up)))
        # per query row: its attention over the keys it sees, and the out-projection (vw -> h) of its output
        phases.append(_query_slices(
            w, algorithm, "reduce_scatter", "attention+out", row_flops=2.0 * a.vw * h, key_flops=pair,
            row_mem=(a.qk + h) * d, kv_key_bytes=a.kv * d, fixed_mem=a.vw * h * d, cat_row_bytes=2.0 * a.vw * d,
            cat="gaps", add_row_bytes=h * d))
    if _backward(w):
        # all-gather dY; per query slice: the out-projection's dgrad and wgrad, and its attention's backward
        # (the K/V read and their gradients accumulated per key)
        phases.append(_query_slices(
            w, algorithm, "all_gather", "attention+out.backward", row_flops=4.0 * a.vw * h,
            key_flops=ATTENTION_BACKWARD_RATIO * pair, row_mem=(h + 2 * a.qk + 2 * a.vw) * d,
            kv_key_bytes=2.0 * a.kv * d, fixed_mem=3.0 * a.vw * h * d, cat_row_bytes=2.0 * h * d, cat="always"))
        if up is not None:
            phases.append(Phase("mla.up.backward", ComputeOnly(Kernel(2 * up.flops, 2 * up.bytes, "mla.up.backward"))))
        phases += _column_backward(w, algorithm, "qkv", a.proj)
    return phases


def _fsdp_linear(w: Workload, algorithm: str) -> list[Phase]:
    d, h, t, cols = w.dtype_bytes, w.hidden, w.tokens, w.ffn // w.tp
    phases = []
    if w.passes in ("forward", "both"):
        # gathered dim: W's output columns; per column: Y[:, c] = X @ W[:, c]
        phases.append(_op("all_gather", w, algorithm, "fsdp.forward", rows=cols, row_bytes=h * d,
                          row_flops=2.0 * t * h, row_mem=(t + h) * d, fixed_mem=t * h * d,
                          cat_row_bytes=2.0 * h * d))
    if w.passes in ("backward", "both"):
        # dX += dY[:, cols] @ W[:, cols]^T per gathered shard (dX read and written every step)
        phases.append(_op("all_gather", w, algorithm, "fsdp.dgrad", rows=cols, row_bytes=h * d,
                          row_flops=2.0 * t * h, row_mem=(t + h) * d, fixed_mem=3 * t * h * d,
                          cat_row_bytes=2.0 * h * d))
        # dW[:, cols of dest] = X^T @ dY[:, cols of dest], reduce-scattered over dp
        phases.append(_op("reduce_scatter", w, algorithm, "fsdp.wgrad", rows=cols, row_bytes=h * d,
                          row_flops=2.0 * t * h, row_mem=(t + h) * d, fixed_mem=t * h * d,
                          cat_row_bytes=2.0 * t * d, cat="gaps", add_row_bytes=h * d))
    return phases


def _moe(w: Workload, algorithm: str) -> list[Phase]:
    """One MoE layer as ``commfuse.nn.MoE`` runs it (Comet's split, ByteDance MLSys'25: dispatch fused with the
    first expert GEMM, the second with combine).

    Outside the fused ops (the same under every algorithm): the router and
    the sort of rows by expert before dispatch, the gate-weighted sum after
    combine, and their backwards. The size exchange opens the forward (one
    small whole all-to-all of per-expert counts, which the backward reuses).
    DeepSeek-V3's shared expert is not part of this layer: it is a dense MLP
    on the rank's own tokens, outside expert parallelism.
    """
    d, h, f, e = w.dtype_bytes, w.hidden, w.ffn, w.experts
    t, k, n, local = w.tokens, w.topk, w.ep, w.local_experts
    routed = w.routed_rows()
    back = [list(col) for col in zip(*routed)]  # combine's block r>s carries the rows s sent r
    try:
        dispatch = schedule_for("all_to_all", n, algorithm)
        combine = schedule_for("produce_all_to_all", n, algorithm)
    except ScheduleError as err:
        raise CommfuseValueError(f"moe: {err} (the all-to-all has no bidirectional form: each pairwise step "
                                 f"already uses a different link per rank)" if "bidirectional" in str(err)
                                 else f"moe: {err}") from None

    def op(name, schedule, rows, produce, kernels):
        return Phase(name, ExpertOp(schedule, rows=rows, row_bytes=h * d, kernels=kernels, local_experts=local,
                                    produce=produce, grouping=w.grouping, name=name), schedule)

    # (name, flops per row, memory bytes per row, weight bytes per local expert) of each kernel of a call
    up = ("gate/up", 2.0 * h * 2 * f, (h + 2 * f) * d, h * 2 * f * d)
    act = ("swiglu", SWIGLU_FLOPS * f, 3.0 * f * d, 0.0)
    down = ("down", 2.0 * f * h, (f + h) * d, f * h * d)
    phases = []
    if w.passes in ("forward", "both"):
        count_bytes = local * COUNT_BYTES
        sizes = schedule_for("all_to_all", n, "vanilla")
        phases += [
            # router logits (t, e) and the copy of every routed row into expert order
            _outside("moe.route", Kernel(2.0 * t * h * e, (t * h + e * h + t * e) * d + 2.0 * t * k * h * d)),
            Phase("moe.sizes", SizesOp(count_bytes), sizes),
            op("moe.dispatch", dispatch, routed, False, (up, act)),
            op("moe.combine", combine, back, True, (down,)),
            # rows times their gate weights, summed back into token order
            _outside("moe.unroute", Kernel(2.0 * t * k * h, 3.0 * t * k * h * d)),
        ]
    if w.passes in ("backward", "both"):
        # dY dispatched; per block: d_act = dY @ w2^T, dw2 += act^T @ dY, SwiGLU's backward
        down_dgrad = ("down.dgrad", 2.0 * h * f, (h + f) * d, f * h * d)
        down_wgrad = ("down.wgrad", 2.0 * f * h, (f + h) * d, 3.0 * f * h * d)  # write, then += into dw2
        act_back = ("swiglu.backward", SWIGLU_BACKWARD_FLOPS * f, 5.0 * f * d, 0.0)
        # dX made per destination: dx = dh13 @ w13^T, dw13 += x^T @ dh13
        up_dgrad = ("gate/up.dgrad", 2.0 * 2 * f * h, (2 * f + h) * d, h * 2 * f * d)
        up_wgrad = ("gate/up.wgrad", 2.0 * h * 2 * f, (h + 2 * f) * d, 3.0 * h * 2 * f * d)
        phases += [
            _outside("moe.unroute.backward", Kernel(2.0 * t * k * h, 3.0 * t * k * h * d)),
            op("moe.dispatch.backward", dispatch, routed, False, (down_dgrad, down_wgrad, act_back)),
            op("moe.combine.backward", combine, back, True, (up_dgrad, up_wgrad)),
            # dX rows summed back into token order; the router's dgrad and wgrad
            _outside("moe.route.backward", Kernel(4.0 * t * h * e, 3.0 * t * k * h * d + (2 * t * h + e * h) * d)),
        ]
    return phases


def _outside(name: str, kernel: Kernel) -> Phase:
    return Phase(name, ComputeOnly(Kernel(kernel.flops, kernel.bytes, name)))


_BUILD = {
    "mlp": _mlp,
    "attention": _attention,
    "ag_matmul": lambda w, a: _linear(w, a, "all_gather"),
    "matmul_rs": lambda w, a: _linear(w, a, "reduce_scatter"),
    "fsdp_linear": _fsdp_linear,
    "moe": _moe,
    "ring_attention": _ring_attention.phases,
}
