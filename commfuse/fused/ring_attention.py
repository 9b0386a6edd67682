"""Ring attention (context parallelism): K/V shards travel around the ring, each block's attention computed
while the next flies, merged with the log-sum-exp; dK/dV travel back as a reduce-scatter's running sums.

The sequence is cut over the ranks of a group (``commfuse.context``: contiguous or zigzag). Rank r holds its
queries, keys and values. Forward is the consume form of an all-gather of K/V (only the Hkv heads travel,
never expanded for grouped-query attention): for every source rank s, in the ring's order (r, r-1, ...), the
block "my queries against s's keys" is computed and merged into a running output with the log-sum-exp, in
float32 whatever the inputs' dtype. Backward is the produce form of a reduce-scatter: ``producer(s)`` is this
rank's contribution to the gradient of s's K/V (flash-attention's backward with the saved log-sum-exp:
``P = exp(S - lse)``, ``dS = P * (dP - rowsum(dO * O))``), the running float32 sums travel around the ring and
each rank ends with dK/dV of its own shard; dQ accumulates here. The K/V blocks gathered in the forward are
kept for the backward (memory: N times this rank's K/V; no second gather).

================================== ==========================================================================
name                               what it is
================================== ==========================================================================
:func:`ring_attention`             the op: checks, resolves the two rings' calls, runs :class:`_RingAttention`
:func:`block_attention`            one block's attention in float32 and its log-sum-exp per query row
:func:`merge_lse`                  two partial attentions of the same rows merged by their log-sum-exps
:func:`block_plans`                which part of each block is computed: rows and keys with any allowed pair
                                   (fully masked blocks skipped), and the block's mask where it is not full
:func:`ring_attention_reference`   the same blocks and merges in the ring's order over per-rank lists, in one
                                   process (reference semantics, STYLE 3)
================================== ==========================================================================

The 2-D form (``ulysses_group``: Ulysses inside, ring across, a cp x ulysses mesh): each rank holds 1/U of its
cp rank's shard (in shard order); a pairwise all-to-all over the Ulysses group gives every rank the whole cp
shard for Hq/U query heads and Hkv/U K/V heads, ring attention runs over the cp group on those heads, and a
last all-to-all brings the output back to sequence shards (``commfuse.fused.ulysses``: ``to_heads`` and
``to_sequence``, whose backwards exchange the gradients the other way). ``ulysses_positions`` lives there and
is importable from here as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

import torch

from commfuse import backends
from commfuse.context import check_layout, chunks_of, positions
from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.fused.matmul import check_tensor
from commfuse.fused.once import plan_once
from commfuse.fused.ulysses import exchange_call, heads_in, to_sequence, ulysses_positions
from commfuse.planning.agreement import agree_around, digest, shown
from commfuse.planning.calls import resolve_call
from commfuse.planning.consumers import StandIn
from commfuse.planning.derive import configured, layer_config
from commfuse.planning.gather import all_gather_consume_core
from commfuse.planning.scatter import produce_reduce_scatter_core
from commfuse.runtime.checkpointing import atomic
from commfuse.runtime.programs import config_words
from commfuse.schedule import Collective

__all__ = ["BlockPlan", "block_attention", "block_plans", "merge_lse", "ring_attention", "ring_attention_reference",
           "ulysses_positions"]

config_words("contiguous", "zigzag")


# -- one block, and the merge ----------------------------------------------------------------------------------


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q (b, Lq, Hq, d) over k, v (b, Lk, Hkv, d) in float32, and its log-sum-exp.

    Returns ``(o, lse)``: o (b, Lq, Hq, d) and lse (b, Hq, Lq) in float32 (float64 for float64 inputs).
    ``mask`` (Lq, Lk), or (b, Lq, Lk) per batch row, boolean, True attends; a row with no key allowed has lse
    -inf and o 0 (it merges as nothing). Grouped-query: query head h uses K/V head h // (Hq / Hkv); K/V are
    never expanded.

    Where the device has a fused kernel that returns the log-sum-exp (:func:`_kernel`: the CPU's flash
    attention), it computes the block in float32 tiles without the (Lq, Lk) scores; elsewhere the scores
    are formed whole, in float32."""
    acc = _acc(q.dtype)
    kernel = _kernel(q, acc)
    mask = _rows_mask(mask)
    if kernel is not None:
        qt, kt, vt = (t.to(acc).transpose(1, 2) for t in (q, k, v))
        o, lse = kernel[0](qt, kt, vt, 0.0, False, attn_mask=_additive(mask, acc), scale=scale)
        o = o.transpose(1, 2)
        if mask is not None:  # the kernel gives a row without keys lse 0: make it the empty attention
            empty = ~mask.any(-1)  # (1 or b, Lq)
            if bool(empty.any()):
                lse = lse.masked_fill(empty[:, None, :], float("-inf"))
                o = o.masked_fill(empty[:, :, None, None], 0.0)
        return o, lse
    b, lq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.to(acc).view(b, lq, hkv, hq // hkv, d)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.to(acc)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    o = torch.einsum("bhgqk,bkhd->bqhgd", p, v.to(acc)).reshape(b, lq, hq, d)
    return o, lse.reshape(b, hq, lq)


def _kernel(q: torch.Tensor, acc: torch.dtype):
    """The fused block kernel for q's device and the compute dtype, as (forward, backward), or None: the CPU's
    flash attention (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, which take
    grouped-query heads as they are and return the log-sum-exp; float32 and float64). Other devices take the
    einsum path: their kernels (CUDA's flash and efficient attention) are unverified here."""
    if q.device.type != "cpu" or acc not in (torch.float32, torch.float64) or _CPU_KERNEL is None:
        return None
    return _CPU_KERNEL


def _cpu_kernel():
    aten = torch.ops.aten
    try:
        return (aten._scaled_dot_product_flash_attention_for_cpu.default,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    except AttributeError:  # a torch without it: the einsum path
        return None


_CPU_KERNEL = _cpu_kernel()


def _rows_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A block's mask as (1 or b, Lq, Lk): one for every batch row, or one per row (per-row documents)."""
    return mask if mask is None or mask.ndim == 3 else mask[None]


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (1 or b, Lq, Lk), True attends, as the kernel takes it: (1 or b, 1, Lq, Lk), 0 where
    allowed and -inf elsewhere."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))[:, None]


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks are computed and merged in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows that saw no key) as 0, so that ``exp(x - lse)`` is 0 there, never NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge_lse(o: torch.Tensor, lse: torch.Tensor, o_blk: torch.Tensor,
              lse_blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax attentions of the same query rows over disjoint keys, merged into the attention over all
    of them: ``lse' = log(e^lse + e^lse_blk)``, ``o' = o e^(lse - lse') + o_blk e^(lse_blk - lse')``.

    o, o_blk (b, L, H, d) and lse, lse_blk (b, H, L), all float32 (or all float64); a -inf lse (no keys yet)
    is the empty attention and merges as nothing."""
    new = torch.logaddexp(lse, lse_blk)
    base = _finite(new)
    a = torch.exp(lse - base).transpose(1, 2).unsqueeze(-1)
    c = torch.exp(lse_blk - base).transpose(1, 2).unsqueeze(-1)
    return o * a + o_blk * c, new


# -- which part of each block is computed ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """The part of block (this rank's queries, one source's keys) that has any allowed pair: query rows
    ``r0:r1`` and key rows ``c0:c1`` of the shards, and the mask of that part (None: every pair allowed)."""

    r0: int
    r1: int
    c0: int
    c1: int
    mask: torch.Tensor | None


def _documents(lengths, seq: int, rank: int, batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(start, end) of the document of every position of the whole sequence, int64: (seq,) for one list of
    lengths that every batch row shares, (batch, seq) for one list per row; None without documents.

    ``lengths``: ints (a list, or a 1-D integer tensor) summing to ``seq``; or one such list per batch row (a
    list of lists or of 1-D tensors, or a 2-D integer tensor whose rows are the lists), for packed rows whose
    documents differ. Refuses lengths that are not positive ints summing to ``seq``, and a row count that is
    not ``batch``, naming the rank, the row and the sums."""
    if lengths is None:
        return None
    if isinstance(lengths, torch.Tensor):
        if lengths.ndim not in (1, 2) or not _integer(lengths):
            raise CommfuseValueError(
                f"rank {rank}: document_lengths must be integer lengths: a 1-D tensor or a list of ints (one "
                "length per document, the same for every batch row), or one such list per row (a 2-D tensor "
                f"or a list of lists), got {lengths.dtype} of shape {list(lengths.shape)}")
        lengths = lengths.tolist()
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise CommfuseTypeError(f"rank {rank}: document_lengths must be a list of ints or a 1-D integer tensor, "
                                f"or one per batch row, got {type(lengths).__name__}")
    rows = [_row(x, rank, i) for i, x in enumerate(lengths)] if lengths and not _is_int(lengths[0]) else None
    if rows is None:
        return _spans(lengths, seq, rank, "document_lengths")
    if batch is not None and len(rows) != batch:
        raise CommfuseValueError(
            f"rank {rank}: document_lengths has {len(rows)} rows of lengths but the batch has {batch} rows; give "
            "one list per batch row, or one list of ints that every row shares")
    spans = [_spans(row, seq, rank, f"document_lengths[{i}]") for i, row in enumerate(rows)]
    return torch.stack([a for a, _ in spans]), torch.stack([b for _, b in spans])


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _integer(t: torch.Tensor) -> bool:
    """Whether ``t`` holds integers (not floats, complex numbers or booleans)."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _row(x, rank: int, i: int) -> list:
    """Row ``i`` of per-row document lengths, as a list (from a list, a tuple or a 1-D integer tensor)."""
    if isinstance(x, torch.Tensor) and x.ndim == 1 and _integer(x):
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return list(x)
    raise CommfuseValueError(f"rank {rank}: document_lengths[{i}] = {x!r} is neither a document length (an int >= "
                             "1) nor a row's list of lengths; give ints, or one list of ints per batch row")


def _spans(lengths: Sequence, seq: int, rank: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) (seq,) int64 of every position's document, from one row's lengths (checked)."""
    for i, x in enumerate(lengths):
        if not _is_int(x) or x < 1:
            raise CommfuseValueError(f"rank {rank}: {name}[{i}] = {x!r} is not a document length (an int >= 1)")
    total = sum(lengths)
    if total != seq:
        raise CommfuseValueError(
            f"rank {rank}: {name} sum to {total}, but the whole sequence has {seq} positions (world size times "
            "this rank's shard); the lengths describe the whole (unsharded) sequence")
    sizes = torch.tensor(lengths, dtype=torch.int64)
    ends = sizes.cumsum(0)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), sizes)
    end = ends[doc]
    return end - sizes[doc], end


def _bounds(seq: int, rank: int, world_size: int, layout: str, causal: bool, documents=None):
    """This rank's query positions (L,), and the interval of key positions each may see (lo, hi: inclusive;
    (L,), or (batch, L) with per-row documents)."""
    qpos = positions(seq, rank, world_size, layout)
    if documents is None:
        return qpos, torch.zeros_like(qpos), qpos if causal else torch.full_like(qpos, seq - 1)
    start, end = documents
    lo = start[..., qpos]
    return qpos, lo, qpos.expand_as(lo).contiguous() if causal else end[..., qpos] - 1


def _block_plan(seq: int, queries, kpos: torch.Tensor, causal: bool, documents, device) -> BlockPlan | None:
    """The :class:`BlockPlan` of this rank's queries (``queries``: :func:`_bounds`) over the keys at ``kpos``
    (sorted positions), or None where no pair is allowed. With per-row documents the part kept bounds every
    row's allowed pairs, and its mask is per row, (batch, rows, keys)."""
    qpos, lo_q, hi_q = queries
    if documents is None:
        lo_k, hi_k = kpos if causal else torch.zeros_like(kpos), torch.full_like(kpos, seq - 1)
    else:
        hi_k = documents[1][..., kpos] - 1
        lo_k = kpos.expand_as(hi_k).contiguous() if causal else documents[0][..., kpos]
    per_row = torch.searchsorted(kpos, hi_q, right=True) - torch.searchsorted(kpos, lo_q)
    per_key = torch.searchsorted(qpos, hi_k, right=True) - torch.searchsorted(qpos, lo_k)
    if per_row.ndim == 2:  # per-row documents: a query row or key is kept where any batch row needs it
        rows, keys = per_row.amax(0).nonzero().flatten(), per_key.amax(0).nonzero().flatten()
    else:
        rows, keys = per_row.nonzero().flatten(), per_key.nonzero().flatten()
    if rows.numel() == 0:
        return None
    r0, r1, c0, c1 = rows[0].item(), rows[-1].item() + 1, keys[0].item(), keys[-1].item() + 1
    mask = None
    if not bool((per_row[..., r0:r1] == c1 - c0).all()):
        k_sub = kpos[c0:c1].to(device)
        mask = (k_sub >= lo_q[..., r0:r1, None].to(device)) & (k_sub <= hi_q[..., r0:r1, None].to(device))
    return BlockPlan(r0, r1, c0, c1, mask)


def block_plans(seq: int, rank: int, world_size: int, layout: str, causal: bool, documents=None,
                device=None) -> list[BlockPlan | None]:
    """For every source rank s, the :class:`BlockPlan` of block (rank's queries, s's keys), or None where no
    pair is allowed (a fully masked block: skipped, not computed).

    A query at position p may see keys in one interval of positions: its document's start (0 without
    documents) to p (causal) or to its document's end; a key at p is seen by queries in one interval too.
    So the rows and keys with any allowed pair are counted with two sorted searches, without the block's
    mask; the mask of the part kept is made only where that part is not fully allowed. ``documents``: what
    :func:`_documents` returns."""
    queries = _bounds(seq, rank, world_size, layout, causal, documents)
    return [_block_plan(seq, queries, positions(seq, s, world_size, layout), causal, documents, device)
            for s in range(world_size)]


class _SlicePlans:
    """The :class:`BlockPlan` of every slice of a source's block that the ring hands over (rows ``start:start
    + rows`` of the source's keys), made on first use and kept: a ``ring:m`` ring delivers and takes back
    each block in m slices, and each is attended to, or skipped, on its own."""

    def __init__(self, seq: int, rank: int, world_size: int, layout: str, causal: bool, documents, device):
        self.seq, self.n, self.layout, self.causal, self.documents = seq, world_size, layout, causal, documents
        self.device, self.length = device, seq // world_size
        self.queries = _bounds(seq, rank, world_size, layout, causal, documents)
        #: every source's whole block (what block_plans gives), on this one ``queries``
        self.whole = [self._plan(positions(seq, s, world_size, layout)) for s in range(world_size)]
        self.cut: dict[tuple[int, int, int], BlockPlan | None] = {}

    def _plan(self, kpos: torch.Tensor) -> BlockPlan | None:
        return _block_plan(self.seq, self.queries, kpos, self.causal, self.documents, self.device)

    def __call__(self, s: int, start: int, rows: int) -> BlockPlan | None:
        whole = self.whole[s]
        if whole is None or (start == 0 and rows == self.length):
            return whole
        key = (s, start, rows)
        if key not in self.cut:
            self.cut[key] = self._plan(positions(self.seq, s, self.n, self.layout)[start:start + rows])
        return self.cut[key]


# -- the autograd Function -------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Ring:
    """What one ring attention call runs on: the two rings' calls (None: world size 1), the block plans by
    source and slice, the scores' scale, and the K/V heads (the gathered K/V shard is (b, L, 2 * Hkv, d))."""

    gather: object
    scatter: object
    plans: _SlicePlans
    scale: float
    hkv: int
    rank: int
    #: the document lengths every rank must pass, as ``(digest, described)`` for ``agree_shared`` (None: none)
    shared: tuple | None = None


def _forward(ring: _Ring, q: torch.Tensor, kv: torch.Tensor | None, keep: bool,
             sources: Sequence[torch.Tensor] | None = None):
    """The merged float32 output (b, L, Hq, d), its log-sum-exp (b, Hq, L) and, with ``keep``, the K/V block of
    every source (its slices as they arrived, joined: kept for the backward). ``sources`` (the reference):
    every rank's K/V block, consumed in the ring's order here, in one process.

    Each slice the ring hands over is attended to as it arrives (``by_slice``): under ``ring:m`` the
    attention of a block's first slices runs while its last ones still fly."""
    b, length, hq, d = q.shape
    out = q.new_zeros((b, length, hq, d), dtype=_acc(q.dtype))
    lse = q.new_full((b, hq, length), float("-inf"), dtype=_acc(q.dtype))
    n = len(ring.plans.whole)
    pieces: list[list] = [[] for _ in range(n)]

    def kept(block: torch.Tensor, s: int, start: int = 0) -> None:
        # measure("comm_only") removes the compute but not the backward's need of every source's block
        if keep:
            pieces[s].append((start, block))

    def consume(block: torch.Tensor, s: int, start: int = 0) -> None:
        kept(block, s, start)
        plan = ring.plans(s, start, block.shape[1])
        if plan is None:  # fully masked: nothing to compute
            return
        r0, r1, c0, c1 = plan.r0, plan.r1, plan.c0, plan.c1
        o_blk, l_blk = block_attention(q[:, r0:r1], block[:, c0:c1, : ring.hkv], block[:, c0:c1, ring.hkv :],
                                       ring.scale, plan.mask)
        out[:, r0:r1], lse[:, :, r0:r1] = merge_lse(out[:, r0:r1], lse[:, :, r0:r1], o_blk, l_blk)

    if sources is not None:
        for step in range(n):
            consume(sources[(ring.rank - step) % n], (ring.rank - step) % n)
    elif ring.gather is None:
        consume(kv, 0)
    else:
        all_gather_consume_core(ring.gather, kv, StandIn(consume, kept), 1, keep=keep, label="ring_attention",
                                by_slice=True)
    blocks: list[torch.Tensor | None] = [None] * n
    for s, got in enumerate(pieces):
        if got:
            got.sort(key=lambda x: x[0])
            blocks[s] = got[0][1] if len(got) == 1 else torch.cat([t for _, t in got], dim=1)
    return out, lse, blocks


def _block_backward(ring: _Ring, plan: BlockPlan, q, block, out, lse, do, delta, dq) -> torch.Tensor:
    """This rank's gradient of one source's K/V block, (b, L, 2 * Hkv, d) float32 (zero outside the plan's
    keys); adds the block's share of dQ into ``dq`` (float32). With the whole call's output and log-sum-exp,
    the block's own ``P = exp(S - lse)`` is its share of the softmax over every key, so the flash backward of
    the block alone gives its exact share (the fused kernel where :func:`_kernel` has one)."""
    b, _, hq, d = q.shape
    hkv, g = ring.hkv, hq // ring.hkv
    r0, r1, c0, c1 = plan.r0, plan.r1, plan.c0, plan.c1
    lq = r1 - r0
    acc = out.dtype
    partial = block.new_zeros(block.shape, dtype=acc)
    kernel = _kernel(q, acc)
    mask = _rows_mask(plan.mask)
    if kernel is not None:
        qt = q[:, r0:r1].to(acc).transpose(1, 2)
        kt, vt = block[:, c0:c1, :hkv].to(acc).transpose(1, 2), block[:, c0:c1, hkv:].to(acc).transpose(1, 2)
        dq_b, dk_b, dv_b = kernel[1](do[:, r0:r1].transpose(1, 2), qt, kt, vt, out[:, r0:r1].transpose(1, 2),
                                     lse[:, :, r0:r1], 0.0, False, attn_mask=_additive(mask, acc),
                                     scale=ring.scale)
        dq[:, r0:r1] += dq_b.transpose(1, 2)
        partial[:, c0:c1, :hkv] = dk_b.transpose(1, 2)
        partial[:, c0:c1, hkv:] = dv_b.transpose(1, 2)
        return partial
    qg = q[:, r0:r1].to(acc).view(b, lq, hkv, g, d)
    dog = do[:, r0:r1].view(b, lq, hkv, g, d)
    k, v = block[:, c0:c1, :hkv].to(acc), block[:, c0:c1, hkv:].to(acc)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * ring.scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    p = torch.exp(s - lse[:, :, r0:r1].reshape(b, hkv, g, lq, 1))
    dp = torch.einsum("bqhgd,bkhd->bhgqk", dog, v)
    ds = p * (dp - delta[:, :, r0:r1].reshape(b, hkv, g, lq, 1))
    dq[:, r0:r1] += torch.einsum("bhgqk,bkhd->bqhgd", ds, k).reshape(b, lq, hq, d) * ring.scale
    partial[:, c0:c1, :hkv] = torch.einsum("bhgqk,bqhgd->bkhd", ds, qg) * ring.scale
    partial[:, c0:c1, hkv:] = torch.einsum("bhgqk,bqhgd->bkhd", p, dog)
    return partial


class _RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over the whole sequence, K/V travelling around the ring.

    ======== ================================================ ==========================================
    pass     computes                                         communication
    ======== ================================================ ==========================================
    forward  o, lse = merge_s block_attention(q, K_s, V_s)     all-gather ring of [K|V] (b, L, 2Hkv, d),
             (fp32, over the sources s in ring order)          consumed block by block (overlapped)
    dgrad    dq += dS_s K_s * scale per source s               none (dQ stays local)
    wgrad    [dK_s|dV_s] = [dS_s^T q * scale | P_s^T dO]      reduce-scatter ring of the fp32 partials
             (produced for s in ring order)                   (b, L, 2Hkv, d): rank s ends with its own
    ======== ================================================ ==========================================

    Shapes: q (b, L, Hq, d), k and v (b, L, Hkv, d), L = s / N rows on this rank (the layout's chunks);
    o like q in q's dtype; lse (b, Hq, L) float32, saved for the backward with the float32 output and the
    K/V block of every source (N * L rows of K/V: the memory of keeping them instead of gathering again).
    ``dS = P * (dP - rowsum(dO * O))``, ``P = exp(S - lse)``, ``dP = dO V^T``.
    """

    @staticmethod
    def forward(ctx, ring: _Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        keep = any(ctx.needs_input_grad[1:])
        with _no_autocast(q.device):
            out, lse, blocks = _forward(ring, q, torch.cat([k, v], dim=2), keep)
        ctx.ring, ctx.kdtype = ring, (k.dtype, v.dtype)
        ctx.save_for_backward(q, out, lse, *blocks)  # the blocks: None where no gradient is wanted
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        with _no_autocast(do.device):
            return _RingAttention._backward(ctx, do)

    @staticmethod
    def _backward(ctx, do: torch.Tensor):
        q, out, lse, *blocks = ctx.saved_tensors
        ring = ctx.ring
        do = do.to(out.dtype)
        delta = (do * out).sum(-1).transpose(1, 2)  # (b, Hq, L): rowsum(dO * O)
        dq = torch.zeros_like(out)

        def producer(s: int, start: int, rows: int) -> torch.Tensor:
            # the slice of source s's partial that the ring sends in this step (all of it without ring:m)
            block = blocks[s][:, start:start + rows]
            plan = ring.plans(s, start, rows)
            if plan is None:
                return block.new_zeros(block.shape, dtype=out.dtype)
            return _block_backward(ring, plan, q, block, out, lse, do, delta, dq)

        if ring.scatter is None:
            dkv = producer(0, 0, blocks[0].shape[1])
        else:
            shape = tuple(blocks[ring.rank].shape)
            dkv = produce_reduce_scatter_core(ring.scatter, producer, 1, label="ring_attention.backward",
                                              inplace=True, slices=(shape, out.dtype))
        hkv = ring.hkv
        kd, vd = ctx.kdtype
        return None, dq.to(q.dtype), dkv[:, :, :hkv].to(kd), dkv[:, :, hkv:].to(vd)


# -- the op -----------------------------------------------------------------------------------------------------


def _no_autocast(device: torch.device):
    """A context where the blocks' float32 einsums stay float32. Autocast would run them (their bmm) in its
    dtype: under it the op's inputs arrive cast already (``commfuse.ring_attention`` casts them at entry), and
    the blocks and merges must still be float32, as outside it."""
    kind = device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


def _check(q, k, v, rank: int, n: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.ndim != 4:
            raise CommfuseValueError(f"rank {rank}: {name} has shape {list(t.shape)}; ring_attention takes "
                                     "(batch, local sequence, heads, head_dim)")
        if not t.is_floating_point():
            raise CommfuseTypeError(f"rank {rank}: {name} has dtype {t.dtype}; attention needs floating point")
    if k.shape != v.shape:
        raise CommfuseValueError(f"rank {rank}: k has shape {list(k.shape)} but v has {list(v.shape)}; they must "
                                 "match")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise CommfuseValueError(
            f"rank {rank}: q has shape {list(q.shape)} but k has {list(k.shape)}: batch, local sequence and "
            "head_dim (dims 0, 1, 3) must match")
    if q.shape[2] % k.shape[2]:
        raise CommfuseValueError(f"rank {rank}: q has {q.shape[2]} heads, not a multiple of k's {k.shape[2]} "
                                 "(grouped-query attention shares each K/V head among Hq / Hkv query heads)")
    if len({q.dtype, k.dtype, v.dtype}) > 1 or len({q.device, k.device, v.device}) > 1:
        raise CommfuseTypeError(f"rank {rank}: q, k, v must share one dtype and device, got {q.dtype}/{k.dtype}/"
                                f"{v.dtype} on {q.device}/{k.device}/{v.device}")
    chunks_of(q.shape[1] * n, rank, n, layout)  # refuses a shard that the layout cannot cut, by name


def _plan(q, k, v, group, causal, scale, layout, algorithm, document_lengths, timeout) -> _Ring:
    check_layout(layout)
    be = backends.resolve(None, group, q.device)
    rank, n = (0, 1) if be is None else (be.rank, be.world_size)
    _check(q, k, v, rank, n, layout)
    seq = q.shape[1] * n
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise CommfuseValueError(f"rank {rank}: scale must be a finite number or None, got {scale!r}")
    documents = _documents(document_lengths, seq, rank, q.shape[0])
    config = layer_config("ring_attention", causal=bool(causal), layout=layout, documents=documents is not None,
                          scale=float(scale))
    kv_bytes = 2 * k.numel() * k.element_size()
    # halves: every slice of K/V is attended to as it arrives, every slice of dK/dV made just before it leaves
    # (by_slice), so auto cuts each block in two on two ranks (planning.calls._halved)
    gather = resolve_call(Collective.ALL_GATHER, algorithm, group=group, device=q.device, slice_bytes=kv_bytes,
                          timeout=timeout, halves=True)
    scatter = resolve_call(Collective.REDUCE_SCATTER, algorithm, group=group, device=q.device,
                           slice_bytes=2 * k.numel() * _acc(k.dtype).itemsize, timeout=timeout, halves=True)
    plans = _SlicePlans(seq, rank, n, layout, bool(causal), documents, q.device)
    shared = None if documents is None or gather is None or gather.check == "off" else _shared_lengths(document_lengths)
    return _Ring(configured(gather, config), configured(scatter, config), plans, float(scale), k.shape[2], rank,
                 shared)


def _shared_lengths(lengths) -> tuple[int, object]:
    """Checked ``document_lengths`` as :func:`agree_shared` compares them: their digest, and their description
    (a list of ints, or one per batch row), made only where the digests differ. The lengths are on the host
    already (the block plans are made from them there): no device is read."""
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    rows = tuple(tuple(x.tolist()) if isinstance(x, torch.Tensor) else tuple(x) if isinstance(x, (list, tuple))
                 else x for x in lengths)

    def described() -> list[tuple[str, str]]:
        text = repr([list(x) if isinstance(x, tuple) else x for x in rows])
        return [("document_lengths", shown(text))]

    return digest(rows), described


def _lengths_compared(document_lengths):
    """The 2-D form's ``document_lengths`` as the Ulysses group compares them (``(digest, described)``, as
    :func:`_shared_lengths` makes them); lengths of no known form are compared as written, and refused by the
    ring."""
    try:
        return _shared_lengths(document_lengths)
    except Exception:  # noqa: BLE001 - lengths of no known form: compared as written, refused by the ring
        text = repr(document_lengths)
        return digest(text.encode()), lambda: [("document_lengths", shown(text))]


@atomic
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, causal: bool = True,
                   scale: float | None = None, layout: str = "contiguous", algorithm: str = "auto",
                   document_lengths=None, timeout: float | None = None, ulysses_group=None) -> torch.Tensor:
    """This rank's shard of softmax attention over the whole sequence, the sequence sharded over ``group``
    (and, with ``ulysses_group``, each cp shard cut again over it: the 2-D form).

    See ``commfuse.ring_attention`` (``commfuse.ops``) for the contract; this is the one implementation."""
    if ulysses_group is not None:
        ulysses = plan_once(None, "ring_attention.ulysses", ulysses_group, None, exchange_call,
                            q, k, ulysses_group, timeout)
        if ulysses is not None:
            shared = None if document_lengths is None or ulysses.check == "off" else \
                _lengths_compared(document_lengths)
            q, k, v = heads_in(ulysses, ulysses_group, q, k, v, shared)
            out = ring_attention(q, k, v, group=group, causal=causal, scale=scale, layout=layout,
                                 algorithm=algorithm, document_lengths=document_lengths, timeout=timeout)
            return to_sequence(ulysses, out, label="ring_attention.ulysses")
    ring = plan_once(None, "ring_attention", group, None, _plan,
                     q, k, v, group, causal, scale, layout, algorithm, document_lengths, timeout)
    if ring.shared is None:
        return _RingAttention.apply(ring, q, k, v)
    # the ranks' document lengths compared on every call: their digest rides the K/V ring's own transfers
    # where the transport can carry it (gloo), and no rank returns a result computed with lengths that differ;
    # elsewhere one exchange of digests of its own, before any block is computed
    return agree_around(ring.gather, group, "ring_attention's document_lengths", *ring.shared,
                        lambda: _RingAttention.apply(ring, q, k, v), label="ring_attention.documents",
                        device=q.device)


def ring_attention_reference(qs: Sequence[torch.Tensor], ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], *,
                             causal: bool = True, scale: float | None = None, layout: str = "contiguous",
                             document_lengths=None) -> list[torch.Tensor]:
    """Every rank's output of :func:`ring_attention` (forward), computed in one process over per-rank lists
    with the same blocks, plans and float32 merges in the ring's order (rank r merges sources r, r-1, ...):
    the reference semantics of the ring, against which its numerics at any world size can be judged without
    processes."""
    n = len(qs)
    seq = qs[0].shape[1] * n
    scale = 1.0 / math.sqrt(qs[0].shape[-1]) if scale is None else float(scale)
    documents = _documents(document_lengths, seq, 0, qs[0].shape[0])
    kvs = [torch.cat([k, v], dim=2) for k, v in zip(ks, vs)]
    outs = []
    for r in range(n):
        ring = _Ring(None, None, _SlicePlans(seq, r, n, layout, causal, documents, qs[r].device), scale,
                     ks[0].shape[2], r)
        out, _, _ = _forward(ring, qs[r], None, False, sources=kvs)
        outs.append(out.to(qs[r].dtype))
    return outs
