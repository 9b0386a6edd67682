"""Query-split attention fused with the out-projection's reduce-scatter: the one implementation.

Under tensor + sequence parallelism (TPSP, the paper's Algorithm 4) each rank
holds whole heads; the sequence's queries are split into N slices, and slice
d's attention (its rows against the keys it may see, its rows of the mask)
times this rank's columns of the out-projection is this rank's partial of
rank d's output rows: the *producer* of a reduce-scatter ring, so rank d's
rows are produced while the running sums of the others travel.

================================== ==========================================================================
name                               what it is
================================== ==========================================================================
:func:`attend`                     softmax attention of some query rows (causal offset, grouped-query, a mask)
:class:`AttentionMask`,            a mask over the whole sequence, resolved once per forward and cut per
:func:`resolve_mask`               query slice (dense, document ids, cumulative lengths, a BlockMask)
:func:`query_slices`               ``producer(d, q, k, v, wo)``: slice d's attention times ``wo^T``
:func:`partial_bytes`              the size of one slice's partial: what ``auto`` decides on
:func:`reduce_scatter_call`        the ring's call, ``auto`` decided on :func:`partial_bytes`
:func:`attention_reduce_scatter`   the forward: the ring over the slices' partials (differentiable: eager
                                   keeps each slice's graph and back-propagates it as its gradient arrives)
:func:`attention_reduce_scatter_   the backward that recomputes each slice as its output gradient arrives
backward`                          (the compiled op's: a custom op cannot keep graphs from one op to the next)
================================== ==========================================================================

``commfuse.nn.ParallelAttention``, ``commfuse.tp.AttentionParallel`` and the
``torch.ops.commfuse.attention_reduce_scatter`` op (``commfuse.library``) are
shells over these.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn.functional as F

from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.fused.once import plan_once
from commfuse.fused.produce_reduce_scatter import produce_reduce_scatter_fn
from commfuse.planning.agreement import digest, shown
from commfuse.planning.calls import resolve_call
from commfuse.planning.derive import configured
from commfuse.planning.gather import all_gather_consume_core
from commfuse.planning.scatter import produce_reduce_scatter_core
from commfuse.runtime.checkpointing import atomic
from commfuse.runtime.programs import config_words, sum_dtype
from commfuse.schedule import Collective

__all__ = [
    "CUMULATIVE_MASK_NAMES", "DENSE_MASK_NAMES", "DOCUMENT_MASK_NAMES", "MASK_KINDS", "MASK_NAMES", "AttentionMask",
    "attend", "attention_reduce_scatter", "attention_reduce_scatter_backward", "is_block_mask", "is_mask",
    "is_varlen", "mask_kind", "mask_of", "mask_shared", "partial_bytes", "query_slices", "reduce_scatter_call",
    "resolve_mask", "shared_mask",
]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, q_offset: int = 0,
           mask: torch.Tensor | None = None, scale: float | None = None, softcap: float | None = None,
           window: int | None = None) -> torch.Tensor:
    """Softmax attention of q (b, Lq, Hq, d) over k, v (b, Lk, Hkv, d), query rows starting at ``q_offset``.

    With ``causal`` query row i (global position q_offset + i) sees keys 0..q_offset+i; with ``window`` too,
    only the last ``window`` of them (keys j with i - j < window: a sliding window, as transformers' sliding
    layers mask). ``mask`` (what :meth:`AttentionMask.rows` cuts for these rows and keys), broadcastable to
    (b, Hq, Lq, Lk), is ``scaled_dot_product_attention``'s ``attn_mask``: boolean (True attends) or added to
    the scores; with ``causal`` both apply. Grouped-query: every group of Hq/Hkv query heads shares one
    key/value head. ``scale``: the scores' factor, SDPA's (None: ``1 / sqrt(d)``). ``softcap``: the scores
    soft-capped before the mask, ``softcap * tanh(scores / softcap)`` (Gemma 2's attention logit cap), the
    softmax then taken in float32 as transformers' eager attention takes it::

        scores = q @ k^T * scale
        scores = softcap * tanh(scores / softcap)      # with softcap
        scores = scores + mask                         # -inf where causal, window or a boolean mask hides a key
        out = softmax(scores, float32).to(q.dtype) @ v
    """
    hq, hkv = q.shape[2], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if hq != hkv:
        kt = kt.repeat_interleave(hq // hkv, dim=1)
        vt = vt.repeat_interleave(hq // hkv, dim=1)
    allowed = None
    if causal:
        rows = torch.arange(q.shape[1], device=q.device).unsqueeze(1) + q_offset
        cols = torch.arange(k.shape[1], device=q.device).unsqueeze(0)
        allowed = cols <= rows
        if window is not None:
            allowed = allowed & (rows - cols < window)
    if softcap is not None:
        return _capped(qt, kt, vt, allowed, mask, q.shape[-1] ** -0.5 if scale is None else scale,
                       softcap).transpose(1, 2)
    if mask is None:
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed, scale=scale).transpose(1, 2)
    if mask.dtype == torch.bool:
        combined = mask if allowed is None else mask & allowed
    else:  # additive, in the queries' dtype (as SDPA wants it; autocast casts it so too)
        combined = mask.to(q.dtype)
        if allowed is not None:
            combined = combined.masked_fill(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=combined, scale=scale).transpose(1, 2)


def _capped(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, allowed: torch.Tensor | None,
            mask: torch.Tensor | None, scale: float, softcap: float) -> torch.Tensor:
    """Soft-capped attention of (b, H, L, d) heads (:func:`attend`'s docstring has the math)."""
    scores = torch.matmul(qt, kt.transpose(-2, -1)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(
            scores.dtype)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(qt.dtype)
    return torch.matmul(weights, vt)


# -- masks -----------------------------------------------------------------------------------------------------
#
# The query-split attention computes each query slice (rows r0..r1 of the whole sequence, this rank's heads)
# against the keys it may see, so a mask over the whole sequence is cut per slice: its rows r0..r1, the slice's
# keys' columns, this rank's heads; the causal offset is the slice's first row.

#: parameter names whose values are masks (``commfuse.tp.AttentionParallel`` reads a block's forward arguments
#: by these names)
DENSE_MASK_NAMES = ("attn_mask", "attention_mask", "attention_masks", "mask", "block_mask")
DOCUMENT_MASK_NAMES = ("document_ids", "doc_ids")
CUMULATIVE_MASK_NAMES = ("cu_seqlens",)
MASK_NAMES = DENSE_MASK_NAMES + DOCUMENT_MASK_NAMES + CUMULATIVE_MASK_NAMES

#: what a mask is, in the fingerprint of the rings it changes (every rank must pass the same kind)
MASK_KINDS = ("none", "dense", "documents", "block")
config_words(*MASK_KINDS)


def is_block_mask(value) -> bool:
    """Whether ``value`` is FlexAttention's ``BlockMask`` (without importing flex attention when nothing has)."""
    module = sys.modules.get("torch.nn.attention.flex_attention")
    return module is not None and isinstance(value, module.BlockMask)


def is_varlen(value) -> bool:
    """Whether ``value`` carries cumulative document lengths as torchtitan's ``VarlenMetadata`` does
    (``cu_seq_q`` and ``cu_seq_k``)."""
    return not isinstance(value, torch.Tensor) and hasattr(value, "cu_seq_q") and hasattr(value, "cu_seq_k")


def is_mask(name: str | None, value) -> bool:
    """Whether a forward argument is a mask: by its parameter name (:data:`MASK_NAMES`), or by its type
    (FlexAttention's ``BlockMask``, torchtitan's ``VarlenMetadata``)."""
    return name in MASK_NAMES or is_block_mask(value) or is_varlen(value)


def mask_kind(given: dict) -> str:
    """The kind of mask (:data:`MASK_KINDS`) among ``given`` (forward arguments by name) that
    :func:`resolve_mask` resolves, read from names and types only (it joins a fingerprint before the mask is
    checked): "none" when every value is None."""
    kinds = []
    for name, value in given.items():
        if value is None:
            continue
        if is_block_mask(value):
            kinds.append("block")
        elif is_varlen(value) or name in DOCUMENT_MASK_NAMES or name in CUMULATIVE_MASK_NAMES:
            kinds.append("documents")
        else:
            kinds.append("dense")
    return kinds[0] if len(kinds) == 1 else "none" if not kinds else "+".join(kinds)


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """A mask over the whole sequence, resolved once per forward (:func:`resolve_mask`) and cut per query slice.

    ``kind`` "dense": ``tensor`` is SDPA's ``attn_mask`` as 4-D (batch or 1, this rank's heads or 1, seq or 1,
    seq or 1), boolean or additive; "documents": ``tensor`` is (batch or 1, seq) document ids, a query sees
    the keys of its own document only; "block": ``block_mask`` is FlexAttention's BlockMask, its ``mask_mod``
    evaluated for each slice's rows and keys and this rank's heads (``head_offset`` onwards, ``heads`` of them).
    """

    kind: str
    tensor: torch.Tensor | None = None
    block_mask: object = None
    batch: int = 1
    head_offset: int = 0
    heads: int = 1

    def rows(self, start: int, length: int, keys: int) -> torch.Tensor:
        """The mask of query rows ``start .. start + length`` against keys ``0 .. keys``, broadcastable to
        (batch, heads, length, keys): what :func:`attend` takes as ``mask``."""
        if self.kind == "documents":
            ids = self.tensor
            return (ids[:, start : start + length, None] == ids[:, None, :keys]).unsqueeze(1)
        if self.kind == "block":
            from torch.nn.attention.flex_attention import create_mask

            mod, heads = self.block_mask.mask_mod, self.head_offset

            def shifted(b, h, q, kv):  # this slice's rows and this rank's heads, by their global indices
                return mod(b, h + heads, q + start, kv)

            return create_mask(shifted, self.batch, self.heads, length, keys, self.tensor_device)
        m = self.tensor
        if m.shape[-2] != 1:
            m = m[..., start : start + length, :]
        return m if m.shape[-1] == 1 else m[..., :keys]

    @property
    def tensor_device(self):
        return self.block_mask.kv_num_blocks.device if self.kind == "block" else self.tensor.device

    def whole(self, seq: int) -> AttentionMask:
        """This mask with a block mask evaluated once for the whole sequence (a dense mask: what a custom op,
        which takes no callables, can be given)."""
        if self.kind != "block":
            return self
        return AttentionMask("dense", self.rows(0, seq, seq), batch=self.batch, heads=self.heads)


def resolve_mask(who: str, given: dict, *, batch: int, seq: int, heads: int, world_size: int,
                 rank: int) -> AttentionMask | None:
    """The one mask among ``given`` (forward arguments by name, None values left out), checked against the
    attention it masks: ``batch`` rows, a whole sequence of ``seq`` positions, ``heads`` query heads on this
    rank out of ``heads * world_size``. None without a mask. Everything it cannot interpret is refused by
    name (``CommfuseValueError``/``CommfuseTypeError``), never ignored."""
    given = {name: value for name, value in given.items() if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise CommfuseValueError(f"{who}: two masks were given ({', '.join(sorted(given))}); give one: combine "
                                 "them into one boolean or additive attn_mask")
    (name, value), = given.items()
    if is_block_mask(value):
        q_len, kv_len = value.seq_lengths
        if (q_len, kv_len) != (seq, seq):
            raise CommfuseValueError(f"{who}: {name} is a BlockMask for {q_len} queries and {kv_len} keys, but "
                                     f"the whole sequence has {seq}: build it for the whole (unsharded) sequence")
        b_mask = value.kv_num_blocks.shape[0]
        if b_mask not in (1, batch):
            raise CommfuseValueError(f"{who}: {name} is a BlockMask for a batch of {b_mask}, the input has {batch}")
        return AttentionMask("block", block_mask=value, batch=batch, head_offset=rank * heads, heads=heads)
    if is_varlen(value):
        if value.cu_seq_q is not value.cu_seq_k and not torch.equal(value.cu_seq_q, value.cu_seq_k):
            raise CommfuseValueError(f"{who}: {name} has cu_seq_q != cu_seq_k; self-attention needs the same "
                                     "documents for queries and keys")
        return AttentionMask("documents", _from_cumulative(who, f"{name}.cu_seq_q", value.cu_seq_q, batch, seq))
    if isinstance(value, dict):
        raise CommfuseTypeError(f"{who}: {name} is a dict of masks ({sorted(value)}); give the one this attention "
                                "uses")
    if not isinstance(value, torch.Tensor):
        raise CommfuseTypeError(f"{who}: {name} must be a tensor, a FlexAttention BlockMask or a VarlenMetadata "
                                f"(cu_seq_q, cu_seq_k), got {type(value).__name__}")
    if value.requires_grad:
        raise CommfuseValueError(f"{who}: {name} requires a gradient, which the query-split attention does not "
                                 "give a mask: pass it detached (masks are constants here)")
    if name in CUMULATIVE_MASK_NAMES:
        return AttentionMask("documents", _from_cumulative(who, name, value, batch, seq))
    if name in DOCUMENT_MASK_NAMES:
        return AttentionMask("documents", _document_ids(who, name, value, batch, seq))
    return AttentionMask("dense", _dense(who, name, value, batch, seq, heads, world_size, rank))


def _document_ids(who: str, name: str, ids: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise CommfuseTypeError(f"{who}: {name} must hold integer document ids, got {ids.dtype}")
    if ids.ndim == 1:
        ids = ids.unsqueeze(0)
    if ids.ndim != 2 or ids.shape[0] not in (1, batch) or ids.shape[1] != seq:
        raise CommfuseValueError(
            f"{who}: {name} has shape {list(ids.shape)}, but the attention takes ({batch}, {seq}) or ({seq},): one "
            f"id per position of the whole (unsharded) sequence, the same on every rank"
        )
    return ids


def _from_cumulative(who: str, name: str, cu, batch: int, seq: int) -> torch.Tensor:
    """Document ids (batch, seq) from cumulative lengths over the flattened batch (flash-attention's and
    torchtitan's varlen ``cu_seqlens``: 0, end of document 0, ..., batch * seq)."""
    cu = torch.as_tensor(cu)
    if cu.ndim != 1 or cu.is_floating_point() or cu.numel() < 2:
        raise CommfuseValueError(f"{who}: {name} must be a 1-D integer tensor of cumulative lengths, got "
                                 f"{cu.dtype} of shape {list(cu.shape)}")
    ends = cu.tolist()
    total = batch * seq
    if ends[0] != 0 or ends[-1] != total or any(b < a for a, b in zip(ends, ends[1:])):
        raise CommfuseValueError(f"{who}: {name} = {ends} is not cumulative lengths from 0 to batch * seq = "
                                 f"{total}")
    missing = [r * seq for r in range(1, batch) if r * seq not in ends]
    if missing:
        raise CommfuseValueError(f"{who}: {name} has a document that runs from one batch row into the next (no "
                                 f"boundary at position {missing[0]}); every row must end a document")
    positions = torch.arange(total, device=cu.device)
    return torch.searchsorted(cu[1:].to(positions.dtype), positions, right=True).view(batch, seq)


def _dense(who: str, name: str, m: torch.Tensor, batch: int, seq: int, heads: int, world_size: int,
           rank: int) -> torch.Tensor:
    if not (m.dtype == torch.bool or m.is_floating_point()):
        raise CommfuseTypeError(
            f"{who}: {name} has dtype {m.dtype}; it is scaled_dot_product_attention's attn_mask, boolean (True "
            "attends) or floating (added to the scores). A (batch, seq) padding or document index is "
            "document_ids=..."
        )
    if not 2 <= m.ndim <= 4:
        raise CommfuseValueError(f"{who}: {name} has {m.ndim} dims; attn_mask is (seq, seq) up to (batch, heads, "
                                 "seq, seq)")
    shape = list(m.shape)
    while m.ndim < 4:
        m = m.unsqueeze(0)
    total = heads * world_size
    b, h, q, k = m.shape
    if b not in (1, batch) or h not in (1, total) or q not in (1, seq) or k not in (1, seq):
        raise CommfuseValueError(
            f"{who}: {name} has shape {shape}, which does not broadcast to (batch {batch}, heads {total}, "
            f"seq {seq}, seq {seq}): give the mask of the whole (unsharded) sequence and every head, the same on "
            "every rank"
        )
    if h > 1 and world_size > 1:
        m = m[:, rank * heads : (rank + 1) * heads]  # this rank's heads
    return m


def shared_mask(given: dict, check: str) -> tuple[str, object] | None:
    """The mask among ``given`` (forward arguments by name) that the ranks compare on this call, as
    ``(name, value)``, or None, read from names, types and devices only (every rank that passed the same kind
    decides alike, before the mask is checked; :func:`mask_shared` then digests it). ``check``: the call's
    check mode (``COMMFUSE_CHECK``: "off" compares nothing, "always" compares every kind but a BlockMask):

    - ``cu_seqlens`` (or a ``VarlenMetadata``'s ``cu_seq_q``): on every call (its ends are read on the host
      to make the document ids anyway);
    - ``document_ids`` on the CPU: on every call; on an accelerator only with ``always``
      (``COMMFUSE_CHECK=always``): digesting them would read the device on every call;
    - a dense ``attn_mask`` (boolean or additive): only with ``always`` (digesting (s, s) or more values costs);
    - a FlexAttention ``BlockMask``: never (its ``mask_mod`` is a function)."""
    if check == "off":
        return None
    always = check == "always"
    for name, value in given.items():
        if value is None or is_block_mask(value):
            continue
        if is_varlen(value):
            return (name, value.cu_seq_q)
        if not isinstance(value, torch.Tensor):
            return None
        if name in CUMULATIVE_MASK_NAMES:
            return (name, value)
        if name in DOCUMENT_MASK_NAMES:
            return (name, value) if always or value.device.type == "cpu" else None
        return (name, value) if always else None
    return None


def mask_shared(name: str, value: torch.Tensor) -> tuple[int, object]:
    """``(digest, described)`` of a mask :func:`shared_mask` chose (checked already by :func:`resolve_mask`),
    as ``commfuse.planning.agreement`` compares them (carried, or ``agree_shared``): the digest of its dtype, shape and values (the
    whole mask, every head's, before this rank's heads are cut out), and ``described()``, what a
    ``MismatchError`` shows of it, made only where the ranks' digests differ."""
    if name in CUMULATIVE_MASK_NAMES or is_varlen(value):
        ends = tuple(torch.as_tensor(value).tolist())
        return digest(ends), lambda: [(name, shown(repr(list(ends))))]
    t = value.detach().contiguous().cpu()
    raw = t.view(torch.uint8) if t.dtype != torch.bool and t.element_size() > 1 else t
    head = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
    code = digest(head.encode() + raw.numpy().tobytes())

    def described() -> list[tuple[str, object]]:
        if name in DOCUMENT_MASK_NAMES:
            rows = t.reshape(-1, t.shape[-1]) if t.ndim else t.reshape(1, 1)
            lengths = [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in rows]
            return [(name, shown(f"{head}, documents of lengths {lengths[0] if len(lengths) == 1 else lengths}"))]
        if t.dtype == torch.bool:
            return [(name, f"{head}, {int(t.sum())} of {t.numel()} attend, digest {code:#x}")]
        return [(name, f"{head}, {int(torch.isinf(t).sum())} of {t.numel()} are -inf, sum of the finite "
                       f"{float(t[torch.isfinite(t)].double().sum()):.6g}, digest {code:#x}")]

    return code, described


def query_slices(q: torch.Tensor, k: torch.Tensor, *, causal: bool, world_size: int,
                 mask: AttentionMask | None = None, scale: float | None = None, softcap: float | None = None,
                 window: int | None = None):
    """``producer(dest, q, k, v, wo)`` of the query-split reduce-scatter: query slice ``dest``'s attention
    over the keys it may see (with ``causal``, those up to its last row; its rows of ``mask`` and those keys'
    columns; the causal offset of its first row; the scores times ``scale``, capped by ``softcap``, within
    ``window``: :func:`attend`), times ``wo^T``."""
    b, s = q.shape[0], q.shape[1]
    rows = s // world_size

    def producer(dest: int, q, k, v, wo):
        start = dest * rows
        keys = start + rows if causal else s
        cut = None if mask is None else mask.rows(start, rows, keys)
        o = attend(q[:, start : start + rows], k[:, :keys], v[:, :keys], causal=causal, q_offset=start, mask=cut,
                   scale=scale, softcap=softcap, window=window)
        return o.reshape(b, rows, -1) @ wo.t()

    return producer


def partial_bytes(batch: int, rows: int, hidden: int, dtype: torch.dtype) -> int:
    """The bytes of one query slice's partial, (batch, rows, hidden) in ``dtype`` (the partials' dtype:
    autocast's under it): every rank's partials have this one size, known before any attention runs, so
    ``auto`` decides on it without producing a partial early."""
    return batch * rows * hidden * dtype.itemsize


@atomic
def reduce_scatter_call(algorithm: str, *, batch: int, rows: int, hidden: int, dtype: torch.dtype, group=None,
                        backend=None, device=None):
    """The reduce-scatter ring's call for the query-split attention (None at world size 1): ``algorithm``
    resolved, ``auto`` decided on :func:`partial_bytes`, the same on every rank."""
    # a rank whose options are refused still takes the call's number: its peers are told why (as every op does)
    return plan_once(None, "attention_reduce_scatter", group, backend, resolve_call,
                     Collective.REDUCE_SCATTER, algorithm, group=group, backend=backend, device=device,
                     slice_bytes=partial_bytes(batch, rows, hidden, dtype))


@atomic
def attention_reduce_scatter(call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wo: torch.Tensor, *,
                             causal: bool, mask: AttentionMask | None = None, config: tuple | None = None,
                             scale: float | None = None, softcap: float | None = None, window: int | None = None):
    """``RS_d(attend(q_d, k, v) @ wo^T)`` over the query slices d on a resolved ``call``
    (:func:`reduce_scatter_call`; None: world size 1, the whole attention here): q (b, s, Hq, d), k and v
    (b, s, Hkv, d) this rank's heads over the whole sequence, ``wo`` (hidden, Hq * d) this rank's columns of
    the out-projection; returns (b, s / N, hidden), this rank's rows of the sum. ``config``: the options
    every rank must share, for the ring's fingerprint (``planning.derive.layer_config``). ``scale``: the scores'
    factor (None: ``1 / sqrt(head_dim)``); ``softcap`` and ``window`` as :func:`attend` takes them.

    Differentiable with respect to q, k, v and wo when a gradient is wanted: each slice's graph is kept,
    and the backward all-gathers the output gradient in a ring and back-propagates each arriving slice
    through the partial that made it. Each slice's attention runs once."""
    n = 1 if call is None else call.world_size
    producer = query_slices(q, k, causal=causal, world_size=n, mask=mask, scale=scale, softcap=softcap,
                            window=window)
    inputs = (q, k, v, wo)
    if call is None:
        return producer(0, *inputs)
    call = configured(call, config)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return produce_reduce_scatter_fn(call, producer, inputs, 1)
    return produce_reduce_scatter_core(call, lambda d: producer(d, *inputs), 1, None)


def attention_reduce_scatter_backward(call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wo: torch.Tensor,
                                      dout: torch.Tensor, *, causal: bool, mask: AttentionMask | None = None,
                                      config: tuple | None = None, scale: float | None = None,
                                      softcap: float | None = None, window: int | None = None) -> list[torch.Tensor]:
    """The gradients (dq, dk, dv, dwo) of :func:`attention_reduce_scatter` for the output gradient ``dout``
    (b, s / N, hidden), recomputing each slice's attention as its gradient arrives in the all-gather ring
    (through ``torch.func.vjp``: what a custom op's kernel can do, where autograd does not record)."""
    n = 1 if call is None else call.world_size
    producer = query_slices(q, k, causal=causal, world_size=n, mask=mask, scale=scale, softcap=softcap,
                            window=window)
    grads: list[torch.Tensor | None] = [None] * 4

    def consume(g: torch.Tensor, d: int) -> None:
        _, vjp = torch.func.vjp(lambda *t: producer(d, *t), q, k, v, wo)
        for i, gi in enumerate(vjp(g)):  # one piece per arriving slice, summed in float32 for half inputs
            grads[i] = gi.to(sum_dtype(gi.dtype)) if grads[i] is None else grads[i].add_(gi)

    if call is None:
        consume(dout, 0)
    else:
        all_gather_consume_core(configured(call, config), dout.contiguous(), consume, 0, keep=False,
                                label="attention_reduce_scatter.backward")
    return [g.to(t.dtype) if g is not None else torch.zeros_like(t) for g, t in zip(grads, (q, k, v, wo))]


def mask_of(attn_mask: torch.Tensor | None, document_ids: torch.Tensor | None) -> AttentionMask | None:
    """The mask a compiled op was given as tensors (a dense ``attn_mask`` or ``document_ids``), as the
    :class:`AttentionMask` the query slices cut; None without one."""
    if attn_mask is not None:
        return AttentionMask("dense", attn_mask)
    if document_ids is not None:
        return AttentionMask("documents", document_ids)
    return None
