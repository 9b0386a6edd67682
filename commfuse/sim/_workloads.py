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
mlp        ag_matmul (fc1), activation, matmul_rs (fc2). Backward: all-gather
           of dY with fc2's dgrad and wgrad, activation backward, fc1's dgrad
           + reduce-scatter, fc1's wgrad (on the gathered X kept from forward)
attention  query-split attention under TPSP (paper Algorithm 4): all-gather
           of X with the QKV projection (W (h, 3h/N)), then per output shard
           its queries' attention over the whole sequence plus the
           out-projection, as the producer of a reduce-scatter. Forward only;
           not causal
fsdp_linear ZeRO-3 linear over N = dp ranks: Y = X (T, h) @ W (h, f/tp), W
           sharded by output column; forward: all-gather of W fused with the
           GEMM; backward: all-gather of W with dX, reduce-scatter of dW with
           the weight-gradient GEMM
========== ================================================================

TP workloads simulate one TP group: with ``dp > 1`` the data-parallel
replicas run the same layer independently (their gradient reduction is not
part of the layer).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from commfuse.errors import CommfuseValueError
from commfuse.schedule import CollectiveCall, Schedule, SliceId, Step, Transfer, build, split_sizes
from commfuse.schedule import parse_algorithm as _parse_algorithm
from commfuse.sim._engine import Phase
from commfuse.sim._model import Kernel
from commfuse.sim._profile import DTYPES

WORKLOADS = ("mlp", "attention", "ag_matmul", "matmul_rs", "fsdp_linear")
PASSES = ("forward", "backward", "both")
#: Flops per element of the MLP activation (GELU, tanh form) and of its backward.
ACTIVATION_FLOPS = 8.0


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


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CommfuseValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class Workload:
    """A layer and its sizes: ``name`` in :data:`WORKLOADS`, tokens = ``batch * seq`` (per DP rank)."""

    name: str
    tp: int
    seq: int
    hidden: int
    batch: int = 1
    dp: int = 1
    ffn: int | None = None
    dtype: str = "bfloat16"
    passes: str = "forward"

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise CommfuseValueError(f"unknown workload {self.name!r}; expected one of {', '.join(WORKLOADS)}")
        for f in ("tp", "seq", "hidden", "batch", "dp"):
            _positive(f, getattr(self, f))
        if self.ffn is None:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        _positive("ffn", self.ffn)
        if self.dtype not in DTYPES:
            raise CommfuseValueError(f"unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        if self.passes not in PASSES:
            raise CommfuseValueError(f"passes must be one of {', '.join(PASSES)}, got {self.passes!r}")
        if self.name == "attention" and self.passes != "forward":
            raise CommfuseValueError("the attention workload models the forward pass only; use passes='forward'")
        if self.name in ("ag_matmul", "matmul_rs") and self.passes != "forward":
            raise CommfuseValueError(f"{self.name} is one forward op; its backward is the other op "
                                     f"(use workload 'mlp' with passes={self.passes!r})")
        if self.name == "fsdp_linear":
            if self.ffn % self.tp:
                raise CommfuseValueError(f"fsdp_linear: ffn {self.ffn} must divide by tp {self.tp} (the TP shard "
                                         f"of the weight's columns)")
        else:
            for f in ("hidden",) if self.name == "attention" else ("ffn",):
                if getattr(self, f) % self.tp:
                    raise CommfuseValueError(f"{self.name}: {f} {getattr(self, f)} must divide by tp {self.tp} "
                                             f"(weights are split evenly across TP ranks)")

    @property
    def world_size(self) -> int:
        """Ranks of the group the layer's collectives run over: ``dp`` for FSDP, else ``tp``."""
        return self.dp if self.name == "fsdp_linear" else self.tp

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype]

    def describe(self) -> str:
        text = (f"{self.name} {self.passes}, tp {self.tp}" + (f", dp {self.dp}" if self.dp > 1 else "")
                + f", (b, s, h) = ({self.batch}, {self.seq}, {self.hidden})")
        if self.name in ("mlp", "ag_matmul", "matmul_rs", "fsdp_linear"):
            text += f", ffn {self.ffn}"
        return text + f", {self.dtype}"

    def phases(self, algorithm: str) -> list[Phase]:
        """The ops of this layer, each with the schedule ``algorithm`` names."""
        return _BUILD[self.name](self, algorithm)


def _op(collective: str, w: Workload, algorithm: str, name: str, **kw) -> Phase:
    schedule = schedule_for(collective, w.world_size, algorithm)
    return Phase(name, ShardedOp(schedule, name=name, **kw), schedule)


def _ag_matmul(w: Workload, algorithm: str, name: str = "ag_matmul", extra: int = 1) -> Phase:
    d, h, cols = w.dtype_bytes, w.hidden, w.ffn // w.tp
    return _op("all_gather", w, algorithm, name, rows=w.tokens, row_bytes=h * d, row_flops=2.0 * h * cols * extra,
               row_mem=(h + cols) * d * extra, fixed_mem=h * cols * d * extra, cat_row_bytes=2.0 * h * d)


def _matmul_rs(w: Workload, algorithm: str, name: str = "matmul_rs") -> Phase:
    d, h, cols = w.dtype_bytes, w.hidden, w.ffn // w.tp
    return _op("reduce_scatter", w, algorithm, name, rows=w.tokens, row_bytes=h * d, row_flops=2.0 * cols * h,
               row_mem=(cols + h) * d, fixed_mem=cols * h * d, cat_row_bytes=2.0 * cols * d, cat="gaps",
               add_row_bytes=h * d)


def _elementwise(name: str, elements: float, d: int, flops_per: float) -> Phase:
    return Phase(name, ComputeOnly(Kernel(elements * flops_per, 2.0 * elements * d, name)))


def _mlp(w: Workload, algorithm: str) -> list[Phase]:
    cols, d = w.ffn // w.tp, w.dtype_bytes
    phases = []
    if w.passes in ("forward", "both"):
        phases += [
            _ag_matmul(w, algorithm, "fc1"),
            _elementwise("act", w.tokens * cols, d, ACTIVATION_FLOPS),
            _matmul_rs(w, algorithm, "fc2"),
        ]
    if w.passes in ("backward", "both"):
        h = w.hidden
        phases += [
            # all-gather dY; per shard: dgrad dH_rows = dY_rows @ W2^T and wgrad dW2 += H_rows^T @ dY_rows
            _ag_matmul(w, algorithm, "fc2.backward", extra=2),
            _elementwise("act.backward", w.tokens * cols, d, ACTIVATION_FLOPS),
            _matmul_rs(w, algorithm, "fc1.dgrad"),
            Phase("fc1.wgrad", ComputeOnly(Kernel(2.0 * w.tokens * h * cols, (w.tokens * (h + cols) + h * cols) * d,
                                                  "fc1.wgrad"))),
        ]
    return phases


def _attention(w: Workload, algorithm: str) -> list[Phase]:
    d, h, n, s = w.dtype_bytes, w.hidden, w.tp, w.seq
    local = h // n  # this rank's heads, times head dim
    qkv = _op("all_gather", w, algorithm, "qkv", rows=w.tokens, row_bytes=h * d, row_flops=2.0 * h * 3 * local,
              row_mem=(h + 3 * local) * d, fixed_mem=h * 3 * local * d, cat_row_bytes=2.0 * h * d)
    # per query row: QK^T and PV over the s keys of its sequence (2 flops each) and the out-projection
    attn = _op("reduce_scatter", w, algorithm, "attention+out", rows=w.tokens, row_bytes=h * d,
               row_flops=4.0 * s * local + 2.0 * local * h, row_mem=(local + h) * d,
               fixed_mem=(2 * w.tokens * local + local * h) * d, cat_row_bytes=2.0 * local * d, cat="gaps",
               add_row_bytes=h * d)
    return [qkv, attn]


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


_BUILD = {
    "mlp": _mlp,
    "attention": _attention,
    "ag_matmul": lambda w, a: [_ag_matmul(w, a)],
    "matmul_rs": lambda w, a: [_matmul_rs(w, a)],
    "fsdp_linear": _fsdp_linear,
}
