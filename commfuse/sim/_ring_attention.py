"""Context-parallel attention (``ring_attention`` workload): ring, vanilla, Ulysses and the 2-D form.

One causal (or full) self-attention layer, forward and backward, with its
sequence split over ``cp`` ranks. Only the attention itself is modelled (the
QKV and output projections are the same under every algorithm and are left
out). Sizes: ``s`` tokens, ``Hq`` query heads, ``Hkv`` key/value heads
(grouped-query), head dim ``d``, ``e`` bytes per element, batch ``b``.

Flops (the flash-attention convention): a block of ``sq`` query rows against
``sk`` key rows costs ``4 * sq * sk * Hq * d`` forward (QK^T and PV, two
flops per multiply-add) times the fraction of the block the causal mask
leaves (:func:`block_fraction`; fully masked blocks are skipped, the
diagonal costs half); the backward costs :data:`BACKWARD_FLOPS_RATIO` (2.5)
times its forward (five GEMMs against two: dV, dP, dQ, dK and the recomputed
QK^T). Kernels run on the profile's GEMM efficiency curve.

The algorithms (``algorithm`` strings of this workload, :func:`parse`):

=============== =============================================================================================
``ring``        commfuse ring attention. Forward: the K/V blocks go round the ring as the all-gather
                ``build("all_gather", cp, "ring")``: step k attends the local queries to the block of rank
                r - k while that block travels on to r + 1. Backward: the produce form of a reduce-scatter,
                ``build("reduce_scatter", cp, "ring")`` on the ring travelled the other way (to r - 1): step
                k makes this rank's dK/dV partial for the block of rank r + 1 + k and adds the running sum
                from r + 1, whose own block comes last, so nothing is left after the last compute; the K/V
                blocks make their second pass on the same ring one step ahead of the sums (channel
                :data:`KV_CHANNEL`), starting from the block the forward's last step held (kept from the
                forward: one K/V block of memory; ring-flash-attention instead sends the finished dK/dV
                one extra, exposed hop at the end). :func:`backward_schedule` builds it.
``bidirectional`` the same with half of the K/V heads (and their dK/dV) going each way round.
``vanilla``     all-gather all K/V (one whole collective, exposed), then attention; backward: all-gather
                K/V again, attention backward, reduce-scatter of dK/dV (exposed): torch
                ``context_parallel``'s ``allgather`` rotation.
``ulysses``     DeepSpeed-Ulysses: an all-to-all turns (s/cp tokens, all heads) into (s tokens, Hq/cp and
                Hkv/cp heads) for Q, K and V; full-sequence attention; an all-to-all of the output back.
                Backward: all-to-all of dO, attention backward, all-to-all of dQ, dK, dV. All exposed.
                Needs ``cp <= Hkv`` (each rank a whole K/V head) unless ``kv_replicate``: then (``cp`` a
                multiple of ``Hkv``) every K/V head is copied to ``cp / Hkv`` ranks, and the all-to-all
                carries one K/V head per rank.
``2d:RxU``      the 2-D form (USP, LoongTrain's double ring without its inner ring): cp = R x U, Ulysses
                over U ranks inside a node, ring attention over the R groups across nodes: the Ulysses
                all-to-all, then the ring over R ranks on (s/R tokens, Hq/U heads), then the output
                all-to-all. Its K/V blocks weigh what the pure ring's do (s/R tokens of Hkv/U heads) but
                there are R - 1 hops, not cp - 1, with U times the compute behind each.
=============== =============================================================================================

Layouts (``layout``): ``zigzag`` (rank r holds sequence chunks r and 2cp-1-r of 2cp: every (query rank,
key rank) block is exactly half unmasked, so every ring step of every rank has the same work),
``contiguous`` (rank r holds chunk r of cp: rank r's queries see blocks 0..r, so at ring step k only ranks
r >= k compute and the last rank does 2cp - 1 times the first's work) and ``none`` (not causal).

Bytes: a K/V block is ``2 * (s/cp) * Hkv * d * e`` per batch row (only the K/V heads travel); the dK/dV
running sums travel in float32 (:data:`GRAD_PARTIAL_BYTES`, as ring-flash-attention accumulates them),
and vanilla reduce-scatters the same float32 partials. The profiles have one link figure (the links
inside one 8-device server), so the 2-D form's "across nodes" ring uses it too: at cp 8 on one server
that is what it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from commfuse.errors import CommfuseValueError
from commfuse.schedule import Ring, Schedule, SliceId, Step, Transfer, build
from commfuse.sim._engine import Phase
from commfuse.sim._model import Kernel

#: Backward flops over forward flops of an attention block (flash-attention's convention: 5 GEMMs vs 2).
BACKWARD_FLOPS_RATIO = 2.5
#: Bytes per element of the dK/dV running sums on the wire (float32, as ring-flash-attention sends them).
GRAD_PARTIAL_BYTES = 4
#: The channel of the backward's K/V pass (the reduce-scatter's sums use the schedule's own 0 and 1).
KV_CHANNEL = 2
LAYOUTS = ("zigzag", "contiguous", "none")
#: The algorithms ``commfuse simulate -w ring_attention`` shows when not told.
DEFAULT_ALGORITHMS = ("vanilla", "ring", "bidirectional", "ulysses")

_TWO_D = re.compile(r"^2d:(\d+)x(\d+)$")


@dataclass(frozen=True)
class Plan:
    """What one ``algorithm`` string means: ``ring`` ranks in the ring, ``ulysses`` in the all-to-all group."""

    name: str  # "vanilla" | "ring" | "bidirectional" | "ulysses" | "2d"
    ring: int
    ulysses: int


def parse(algorithm: str, cp: int) -> Plan:
    """``"ring"``, ``"bidirectional"``, ``"vanilla"``, ``"ulysses"`` or ``"2d:RxU"`` (R x U = cp)."""
    text = str(algorithm).strip()
    if text in ("ring", "bidirectional", "vanilla"):
        return Plan(text, cp, 1)
    if text == "ulysses":
        return Plan("ulysses", 1, cp)
    m = _TWO_D.match(text)
    if m:
        r, u = int(m.group(1)), int(m.group(2))
        if r < 1 or u < 1 or r * u != cp:
            raise CommfuseValueError(f"ring_attention: {text!r} is a ring of {r} x an all-to-all of {u} ranks = "
                                     f"{r * u}, but cp is {cp}: give 2d:RxU with R x U = {cp}")
        return Plan("2d", r, u)
    raise CommfuseValueError(f"ring_attention: unknown algorithm {text!r}; expected ring, bidirectional, vanilla, "
                             f"ulysses or 2d:RxU (ring R x Ulysses U = cp), e.g. 2d:2x4")


def chunks(layout: str, world: int, rank: int) -> tuple[tuple[int, int], ...]:
    """``rank``'s pieces of the sequence under ``layout``, as ``(chunk index, chunks in the sequence)``."""
    if layout == "zigzag":
        return ((rank, 2 * world), (2 * world - 1 - rank, 2 * world))
    return ((rank, world),)


def block_fraction(layout: str, world: int, q_rank: int, kv_rank: int) -> float:
    """The share of the (s/world x s/world) score block of ``q_rank``'s queries against ``kv_rank``'s keys
    that the causal mask leaves: 1 when not causal, 0 when fully masked (skipped), the diagonal half."""
    if layout == "none":
        return 1.0
    total = 0.0
    for qc, qn in chunks(layout, world, q_rank):
        for kc, kn in chunks(layout, world, kv_rank):
            pair = 1.0 if kc < qc else 0.5 if kc == qc else 0.0
            total += pair * (world / qn) * (world / kn)
    return total


def backward_schedule(world: int, algorithm: str = "ring") -> Schedule:
    """Ring attention's backward: Flash-RS of the dK/dV sums on the reversed ring, with the K/V blocks'
    second pass (channel :data:`KV_CHANNEL`, and ``+ 1`` for the bidirectional ring's other half) fused
    into the same steps, one step ahead of the sums. Checked here: every step's block is held when it
    is computed (the rank's own, the one kept from the forward, or one received in an earlier step)."""
    rs = build("reduce_scatter", world, algorithm=algorithm, ring=Ring(world).reversed())
    if world == 1:
        return rs
    steps = []
    for step in rs.template:  # ring offsets from position 0, as the builders write them
        sends, recvs = list(step.sends), list(step.recvs)
        for x in step.compute:
            # half 0's sums go `way` = 1 hop a step, half 1's world - 1 (the other way round); the K/V
            # block of the next step (one `back` along the offsets) comes the same way, from -way
            way, back = (1, -1) if x.half == 0 else (world - 1, 1)
            if step.index < world - 2:  # the blocks of steps 1..n-2; the last step's is the rank's own
                nxt = SliceId((x.shard + back) % world, x.part, x.half)
                sends.append(Transfer(x, way % world, way, KV_CHANNEL + x.half))
                recvs.append(Transfer(nxt, -way % world, way, KV_CHANNEL + x.half))
        steps.append(Step(step.index, tuple(sends), tuple(recvs), step.collectives, step.compute, step.accumulate))
    schedule = Schedule(rs.collective, world, rs.algorithm, rs.parts, rs.chunks, rs.ring, tuple(steps))
    _check_backward(schedule)
    return schedule


def _check_backward(schedule: Schedule) -> None:
    n = schedule.world_size
    first = {x for x in schedule.template[0].compute}  # kept from the forward's last step
    held = {SliceId(0, 0, h) for h in range(schedule.halves)} | first
    for step in schedule.template:
        for x in step.compute:
            if x not in held:
                raise CommfuseValueError(f"ring attention backward over {n} ranks: step {step.index} computes on "
                                         f"K/V block {x}, which has not arrived")
        held |= {t.slice for t in step.recvs if t.channel >= KV_CHANNEL}


class AttentionOp:
    """The costs of one op of the ring_attention workload (the engine's ``OpCost``).

    ``unit_flops``: flops of a whole (s/world x s/world) block of all the op's heads (forward or
    backward); ``layout`` decides what share of the block of (rank, shard) is computed
    (:func:`block_fraction`); a step's slices are computed as one kernel. ``block_bytes``: bytes of one
    whole shard on the schedule's own channels (K/V in the forward, the dK/dV sums in the backward);
    ``kv_bytes``: of a K/V block on :data:`KV_CHANNEL` (the backward's second pass); ``mem_bytes``: memory
    a whole block's kernel touches; ``collective_piece``: bytes of one rank's piece of a whole collective
    (default ``block_bytes``). ``compute_all``: False for an op that only communicates.
    """

    def __init__(self, schedule: Schedule, *, name: str, layout: str, unit_flops: float, block_bytes: float,
                 kv_bytes: float = 0.0, mem_bytes: float = 0.0, add_bytes: float = 0.0,
                 collective_piece: float | None = None, compute_all: bool = True) -> None:
        self.schedule, self.name, self.layout = schedule, name, layout
        self.unit_flops, self.block_bytes, self.kv_bytes = unit_flops, block_bytes, kv_bytes
        self.mem_bytes, self.add_bytes, self.compute_all = mem_bytes, add_bytes, compute_all
        self.piece = block_bytes if collective_piece is None else collective_piece
        self.uniform = layout != "contiguous" or schedule.world_size == 1 or not compute_all
        self._cache: dict = {}

    def _share(self, rank: int, x: SliceId) -> float:
        return block_fraction(self.layout, self.schedule.world_size, rank, x.shard) / self.schedule.halves

    def compute(self, rank, step):
        if step is None or not step.compute or not self.compute_all:
            return ()
        key = (rank if not self.uniform else 0, step.index)
        found = self._cache.get(key)
        if found is None:
            share = sum(self._share(rank, x) for x in step.compute)
            found = (Kernel(share * self.unit_flops, share * self.mem_bytes, self.name),) if share > 0 else ()
            self._cache[key] = found
        return found

    def add(self, rank, step):
        h = self.schedule.halves
        return tuple(Kernel(self.add_bytes / h / 4, 3 * self.add_bytes / h, f"{self.name} add")
                     for _ in step.accumulate) if self.add_bytes else ()

    def transfer_bytes(self, rank, transfer):
        size = self.kv_bytes if transfer.channel >= KV_CHANNEL else self.block_bytes
        return size / self.schedule.halves

    def collective_bytes(self, rank, call):
        return self.piece

    def flops(self, rank):
        if not self.compute_all:
            return 0.0
        n = self.schedule.world_size
        return self.unit_flops * sum(block_fraction(self.layout, n, rank, j) for j in range(n))


def _all_to_all(world: int, piece: float, name: str) -> Phase:
    schedule = build("all_to_all", world, algorithm="vanilla")
    return Phase(name, AttentionOp(schedule, name=name, layout="none", unit_flops=0.0, block_bytes=piece,
                                   compute_all=False), schedule)


def phases(w, algorithm: str) -> list[Phase]:
    """The ops of one ring_attention layer (``w``: a ``Workload``) under ``algorithm``."""
    plan = parse(algorithm, w.cp)
    b, s, hq, hkv, d, e = w.batch, w.seq, w.heads, w.kv_heads, w.head_dim, w.dtype_bytes
    u, r = plan.ulysses, plan.ring
    check_heads(w, plan)
    # per rank after the Ulysses all-to-all (u = 1: no all-to-all): query and K/V heads, tokens s/r
    q_heads = hq // u
    kv_heads = hkv // u if hkv >= u else 1
    tokens = s // r  # the ring's shard: one rank's (or one Ulysses group's) tokens
    unit = 4.0 * tokens * tokens * q_heads * d * b  # a whole block's forward flops
    kv_block = 2.0 * tokens * kv_heads * d * e * b
    grad_block = 2.0 * tokens * kv_heads * d * GRAD_PARTIAL_BYTES * b
    mem = (2.0 * tokens * q_heads * d + 2.0 * tokens * kv_heads * d) * e * b
    out: list[Phase] = []
    local = s // w.cp  # tokens per rank before the all-to-all
    # all-to-all pieces: what one rank sends each other rank of its Ulysses group
    q_piece = local * (hq // u) * d * e * b
    kv_piece = 2.0 * local * kv_heads * d * e * b
    forward = w.passes in ("forward", "both")
    backward = w.passes in ("backward", "both")
    name = "ring" if plan.name == "2d" else plan.name
    if forward:
        if u > 1:
            out.append(_all_to_all(u, q_piece + kv_piece, "qkv.all_to_all"))
        out += _attention_forward(w, name, r, unit, kv_block, mem)
        if u > 1:
            out.append(_all_to_all(u, q_piece, "out.all_to_all"))
    if backward:
        if u > 1:
            out.append(_all_to_all(u, q_piece, "dout.all_to_all"))
        out += _attention_backward(w, name, r, BACKWARD_FLOPS_RATIO * unit, kv_block, grad_block, 2 * mem)
        if u > 1:
            out.append(_all_to_all(u, q_piece + kv_piece, "dqkv.all_to_all"))
    return out


def _attention_forward(w, name: str, world: int, unit: float, kv_block: float, mem: float) -> list[Phase]:
    if name == "ulysses":  # the whole sequence is local: one kernel over every (query, key) block
        name = "vanilla"
    algorithm = name if world > 1 else "vanilla"
    schedule = build("all_gather", world, algorithm=algorithm)
    return [Phase("attention", AttentionOp(schedule, name="attention", layout=w.layout, unit_flops=unit,
                                           block_bytes=kv_block, mem_bytes=mem), schedule)]


def _attention_backward(w, name: str, world: int, unit: float, kv_block: float, grad_block: float,
                        mem: float) -> list[Phase]:
    if name in ("ring", "bidirectional") and world > 1:
        schedule = backward_schedule(world, name)
        return [Phase("attention.backward", AttentionOp(schedule, name="attention.backward", layout=w.layout,
                                                        unit_flops=unit, block_bytes=grad_block, kv_bytes=kv_block,
                                                        mem_bytes=mem, add_bytes=grad_block), schedule)]
    # vanilla (and Ulysses' local attention): gather K/V, compute every block, reduce-scatter the dK/dV partials
    gather = build("all_gather", world, algorithm="vanilla")
    scatter = build("reduce_scatter", world, algorithm="vanilla")
    return [Phase("attention.backward", AttentionOp(gather, name="attention.backward", layout=w.layout,
                                                    unit_flops=unit, block_bytes=kv_block, mem_bytes=mem), gather),
            Phase("dkv.reduce_scatter", AttentionOp(scatter, name="dkv.reduce_scatter", layout="none",
                                                    unit_flops=0.0, block_bytes=grad_block, compute_all=False),
                  scatter)]


def check_heads(w, plan: Plan) -> None:
    """Ulysses needs a whole K/V head per rank of its group, or ``kv_replicate``; heads split evenly."""
    u = plan.ulysses
    if w.heads % u:
        raise CommfuseValueError(f"ring_attention: {w.heads} query heads do not split over an all-to-all of {u} "
                                 f"ranks ({plan.name})")
    if w.kv_heads % u == 0:
        return
    if w.kv_heads > u:
        raise CommfuseValueError(f"ring_attention: {w.kv_heads} K/V heads do not split evenly over an all-to-all of "
                                 f"{u} ranks ({plan.name})")
    if not w.kv_replicate:
        raise CommfuseValueError(
            f"ring_attention: Ulysses over {u} ranks needs at least {u} K/V heads (each rank attends with whole "
            f"K/V heads), but there are {w.kv_heads}: use at most {w.kv_heads} Ulysses ranks (a 2d:RxU form), or "
            f"kv_replicate=True (--kv-replicate) to copy every K/V head to several ranks")
    if u % w.kv_heads:
        raise CommfuseValueError(f"ring_attention: kv_replicate copies each of the {w.kv_heads} K/V heads to the same "
                                 f"number of ranks, so the {u} Ulysses ranks must be a multiple of {w.kv_heads}")
