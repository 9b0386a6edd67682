"""Attention under tensor + sequence parallelism (query-split) and under Ulysses sequence parallelism.

``ParallelAttention`` (TPSP, the paper's Algorithm 4): the input (b, s/N, h)
is all-gathered in a ring fused with the Q, K and V projections of this
rank's heads (one gather serving three GEMMs); then the sequence's queries are
split into N slices, and the attention of slice d together with its share of
the output projection is the *producer* of the reduce-scatter ring: rank d's
output rows are produced while the running sums of the others travel.
Backward: the output gradient is all-gathered in a ring and every arriving
slice is back-propagated through the attention that produced it; then the
QKV dgrad reduce-scatter ring. Un-overlapped: nothing but the per-rank
softmax bookkeeping inside each step.

``UlyssesAttention`` (the paper's Algorithm 5, pairwise all-to-all): Q, K and
V are projected locally on the sequence shard; K and V go to the ranks that
own their heads in a pairwise ring; then the queries follow, and the
attention of every arriving query chunk (its rows, this rank's heads, against
the whole sequence) is computed while the next chunk is in flight; the
outputs go back in a last pairwise ring. Backward mirrors it: each arriving
output-gradient chunk is back-propagated through its attention while the next
travels. Un-overlapped: the K/V exchange (nothing to compute yet), the
projections. The exchanges and the attention fused with them, forward and
backward, are ``commfuse.fused.ulysses``'s (with the plain exchange that ring
attention's 2-D form runs); this module is the layer and its front door.

Both support a causal mask and grouped-query attention (``num_kv_heads``).
Their options that change what the ranks compute but not the shapes (the
mask, the head counts and size, a bias) join the fingerprint of their rings,
so a rank whose layer was built otherwise is named on every rank
(``MismatchError``) instead of giving wrong results.
"""

from __future__ import annotations

import torch
from torch import nn

import commfuse.ops as ops
from commfuse.errors import CommfuseValueError
from commfuse.fused import attention as fused_attention
from commfuse.fused import ulysses as fused_ulysses

# the attention and its masks live in commfuse.fused.attention (one implementation for these layers, the tp
# styles and the compiled op); their public names are re-exported here, where they have always been
from commfuse.fused.attention import (  # noqa: F401
    CUMULATIVE_MASK_NAMES,
    DENSE_MASK_NAMES,
    DOCUMENT_MASK_NAMES,
    MASK_KINDS,
    MASK_NAMES,
    AttentionMask,
    attend,
    is_block_mask,
    is_mask,
    is_varlen,
    mask_kind,
    query_slices,
    resolve_mask,
)
from commfuse.nn._common import (
    algorithm_option,
    as_param,
    gather_dim,
    is_mesh,
    layer_mesh,
    local,
    replicated,
    replicated_linear,
    resolve_group,
    site_forward,
    world,
)
from commfuse.nn.linear import _init_linear, _placement
from commfuse.planning.derive import layer_config
from commfuse.planning.agreement import agree_around, agree_shared, carries
from commfuse.runtime.checkpointing import as_custom_op, atomic
from commfuse.runtime.admission import op_calls
from commfuse.schedule import Collective


def _heads(hidden_size: int, num_heads: int, num_kv_heads: int | None, n: int) -> tuple[int, int, int]:
    num_kv_heads = num_kv_heads or num_heads
    if hidden_size % num_heads:
        raise CommfuseValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise CommfuseValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if value % n:
            raise CommfuseValueError(f"{name} {value} is not divisible by the world size {n}: every rank needs whole heads")
    return hidden_size // num_heads, num_heads, num_kv_heads


class ParallelAttention(nn.Module):
    """Multi-head attention with heads split over the group and the sequence sharded (TPSP, query-split).

    Input and output (b, s/N, hidden). This rank holds the Q/K/V projection
    rows and output-projection columns of its heads; the output bias is
    replicated.
    """

    algorithm = algorithm_option(Collective.ALL_GATHER, Collective.REDUCE_SCATTER)

    def __init__(self, hidden_size: int, num_heads: int, *, num_kv_heads: int | None = None, causal: bool = True,
                 bias: bool = False, group=None, sequence_dim: int = 1, algorithm: str = "auto",
                 device=None, dtype=None) -> None:
        super().__init__()
        if sequence_dim != 1:
            raise CommfuseValueError(f"ParallelAttention takes (batch, seq, hidden) with sequence_dim=1, got {sequence_dim}")
        self.group = resolve_group(group)
        self.rank, self.world_size = world(self.group)
        self.head_dim, self.num_heads, self.num_kv_heads = _heads(hidden_size, num_heads, num_kv_heads, self.world_size)
        self.hidden_size, self.causal, self.algorithm, self.sequence_dim = hidden_size, causal, algorithm, 1
        self.backend = None  # a backend name or object for the ops; None: the one that fits the tensors
        hq = self.num_heads // self.world_size * self.head_dim
        hkv = self.num_kv_heads // self.world_size * self.head_dim
        kw = dict(device=device, dtype=dtype)
        wq, wk, wv = (torch.empty(hq, hidden_size, **kw), torch.empty(hkv, hidden_size, **kw),
                      torch.empty(hkv, hidden_size, **kw))
        wo = torch.empty(hidden_size, hq, **kw)
        bq, bk, bv, bo = ((torch.empty(hq, **kw), torch.empty(hkv, **kw), torch.empty(hkv, **kw),
                           torch.empty(hidden_size, **kw)) if bias else (None,) * 4)
        for w, b in ((wq, bq), (wk, bk), (wv, bv)):
            _init_linear(w, b, hidden_size)
        _init_linear(wo, bo, self.num_heads * self.head_dim)
        # With more than one rank: DTensors on the group's mesh with the placements of torch's styles (the
        # projections' rows Shard(0), the out-projection's columns Shard(1), its bias replicated), so that
        # clip_grad_norm_, state_dict and checkpoints see the whole layer; the ops work on the local shards.
        mesh = self._mesh = layer_mesh(group, self.group, self.world_size, device)
        from_rows, full_q, full_kv = _placement("shard", 0), self.num_heads * self.head_dim, \
            self.num_kv_heads * self.head_dim
        self.wq = as_param(wq, mesh, from_rows, (full_q, hidden_size))
        self.wk = as_param(wk, mesh, from_rows, (full_kv, hidden_size))
        self.wv = as_param(wv, mesh, from_rows, (full_kv, hidden_size))
        self.wo = as_param(wo, mesh, _placement("shard", 1), (hidden_size, full_q))
        self.bq = as_param(bq, mesh, from_rows, (full_q,)) if bias else None
        self.bk = as_param(bk, mesh, from_rows, (full_kv,)) if bias else None
        self.bv = as_param(bv, mesh, from_rows, (full_kv,)) if bias else None
        self.bo = as_param(bo, mesh, _placement("replicate"), (hidden_size,)) if bias else None

    def _config(self, mask: AttentionMask | None = None) -> tuple:
        """The options every rank must share (see ``planning.derive.layer_config``), the kind of mask included."""
        return layer_config("ParallelAttention", causal=bool(self.causal), num_heads=self.num_heads,
                                      num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                      bias=self.bq is not None, mask="none" if mask is None else mask.kind)

    @site_forward
    def forward(self, x: torch.Tensor, attn_mask=None, *, document_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x (b, s/N, hidden) -> (b, s/N, hidden). A mask, over the whole (unsharded) sequence and the same on
        every rank, applies with ``causal`` (see :func:`resolve_mask`):

        - ``attn_mask``: ``scaled_dot_product_attention``'s, boolean (True attends) or added to the scores,
          (s, s) up to (b, num_heads, s, s); or FlexAttention's ``BlockMask``; or torchtitan's
          ``VarlenMetadata`` (its ``cu_seq_q``, as ``cu_seqlens``);
        - ``document_ids`` (b, s) or (s,): each position's document; a query sees its own document's keys only;
        - ``cu_seqlens``: cumulative document lengths over the flattened batch (0, ..., b * s), as
          flash-attention's varlen functions take them.

        Every query slice of the reduce-scatter ring takes its rows of the mask and its keys' columns.
        The ranks' masks are compared (``commfuse.fused.attention.shared_mask``): ``cu_seqlens`` and
        ``document_ids`` on the CPU on every call, a dense ``attn_mask`` and ``document_ids`` on an accelerator
        only under ``COMMFUSE_CHECK=always``, a ``BlockMask`` never, nothing under ``COMMFUSE_CHECK=0``. A
        digest of each rank's rides the attention's reduce-scatter ring on gloo (``commfuse.runtime.rider``),
        or is exchanged before the first projection elsewhere; where they differ every rank raises
        ``MismatchError`` naming the ranks and both values, and no rank returns a result.
        """
        b, rows_here, _ = x.shape
        n = self.world_size
        given = None if attn_mask is None and document_ids is None and cu_seqlens is None else \
            {"attn_mask": attn_mask, "document_ids": document_ids, "cu_seqlens": cu_seqlens}
        if torch.compiler.is_compiling() or (self.backend is None and as_custom_op()):
            # one op in the graph (and, under selective activation checkpointing, to its policy)
            return self._run(x, self._mask(given, b, rows_here * n), None)
        # auto decided here, on the partials' size (the same on every rank), as for every other op: left to
        # produce_reduce_scatter it would run one attention slice an extra time to learn that size
        call = fused_attention.reduce_scatter_call(
            self.algorithm, batch=b, rows=rows_here, hidden=self.hidden_size,
            dtype=ops.autocast_dtype(x) or x.dtype,  # under autocast the partials are in its dtype
            group=self.group, backend=self.backend, device=x.device)
        # the mask the ranks compare on this call (fused_attention.shared_mask: names, types, devices): its
        # digest rides the attention's reduce-scatter where the transport can carry it (gloo), else one exchange
        # of digests more before any projection; a rank whose mask is refused leaves every call: its peers,
        # waiting, are told why
        shared = None if given is None or call is None else fused_attention.shared_mask(given, call.check)
        if shared is None:
            with op_calls(call.be if call is not None else None, "ParallelAttention.forward", 2):
                return self._run(x, self._mask(given, b, rows_here * n), call)
        riding = carries(call)  # the same on every rank: the digest rides the attention's reduce-scatter
        with op_calls(call.be, "ParallelAttention.forward", 2 if riding else 3):
            mask = self._mask(given, b, rows_here * n)
            compared = ("ParallelAttention's mask", *fused_attention.mask_shared(*shared))
            if not riding:
                agree_shared(self.group, *compared, label="ParallelAttention.mask", device=x.device)
                return self._run(x, mask, call)
            return self._run(x, mask, call, compared)

    def _mask(self, given: dict | None, batch: int, seq: int) -> AttentionMask | None:
        if given is None:
            return None
        return resolve_mask("ParallelAttention", given, batch=batch, seq=seq, heads=self.num_heads // self.world_size,
                            world_size=self.world_size, rank=self.rank)

    def _run(self, x: torch.Tensor, mask: AttentionMask | None, call, compared: tuple | None = None) -> torch.Tensor:
        """The layer's two calls: the projections' gather, then the attention's reduce-scatter, whose transfers
        carry the ranks' masks' digest where ``compared`` (``(what, digest, described)``) is given
        (:func:`commfuse.planning.agreement.agree_around`)."""
        b = x.shape[0]
        config = self._config(mask)
        q, k, v = ops.all_gather_matmul(x, [local(self.wq).t(), local(self.wk).t(), local(self.wv).t()],
                                        group=self.group, gather_dim=1, algorithm=self.algorithm,
                                        backend=self.backend, config=config)
        if self.bq is not None:  # in the projections' dtype (autocast's, under it), as nn.Linear adds its bias
            q, k, v = q + local(self.bq).to(q.dtype), k + local(self.bk).to(k.dtype), v + local(self.bv).to(v.dtype)
        s, d = q.shape[1], self.head_dim
        q, k, v = q.view(b, s, -1, d), k.view(b, s, -1, d), v.view(b, s, -1, d)
        causal = self.causal
        if call is None and (torch.compiler.is_compiling() or as_custom_op()):  # one op (commfuse.library)
            from commfuse import library

            if self.backend is not None:
                raise CommfuseValueError(f"ParallelAttention under torch.compile takes its group's backend; "
                                         f"backend={self.backend!r} cannot be given")
            out = library.attention_reduce_scatter(q, k, v, local(self.wo), causal=causal, group=self.group,
                                                   algorithm=self.algorithm, mask=mask)
        else:
            def run():
                return fused_attention.attention_reduce_scatter(call, q, k, v, local(self.wo), causal=causal,
                                                                mask=mask, config=config)

            out = run() if compared is None else agree_around(call, self.group, *compared, run,
                                                               label="ParallelAttention.mask", device=x.device)
        return out + replicated(local(self.bo), self.group).to(out.dtype) if self.bo is not None else out

    @classmethod
    def from_linears(cls, q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear, o_proj: nn.Linear, *,
                     num_heads: int, num_kv_heads: int | None = None, causal: bool = True, group=None,
                     algorithm: str = "auto") -> "ParallelAttention":
        """This rank's heads of an attention given as its four ``nn.Linear`` projections (copied exactly)."""
        w = q_proj.weight
        with torch.random.fork_rng(devices=[]):  # converting must not move the global RNG
            layer = cls(q_proj.in_features, num_heads, num_kv_heads=num_kv_heads, causal=causal,
                        bias=q_proj.bias is not None, group=group, algorithm=algorithm, device=w.device, dtype=w.dtype)
        r = layer.rank
        hq, hkv = local(layer.wq).shape[0], local(layer.wk).shape[0]
        with torch.no_grad():
            local(layer.wq).copy_(q_proj.weight[r * hq : (r + 1) * hq])
            local(layer.wk).copy_(k_proj.weight[r * hkv : (r + 1) * hkv])
            local(layer.wv).copy_(v_proj.weight[r * hkv : (r + 1) * hkv])
            local(layer.wo).copy_(o_proj.weight[:, r * hq : (r + 1) * hq])
            if layer.bq is not None:
                local(layer.bq).copy_(q_proj.bias[r * hq : (r + 1) * hq])
                local(layer.bk).copy_(k_proj.bias[r * hkv : (r + 1) * hkv])
                local(layer.bv).copy_(v_proj.bias[r * hkv : (r + 1) * hkv])
                local(layer.bo).copy_(o_proj.bias)
        return layer

    def to_linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
        """(q_proj, k_proj, v_proj, o_proj) of the whole attention, on every rank."""
        h, g = self.hidden_size, self.group
        out = []
        for w, bias, rows in ((self.wq, self.bq, self.num_heads), (self.wk, self.bk, self.num_kv_heads),
                              (self.wv, self.bv, self.num_kv_heads)):
            lin = nn.Linear(h, rows * self.head_dim, bias=bias is not None, device=local(w).device, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(gather_dim(w, 0, rows * self.head_dim, g))
                if bias is not None:
                    lin.bias.copy_(gather_dim(bias, 0, rows * self.head_dim, g))
            out.append(lin)
        o = nn.Linear(self.num_heads * self.head_dim, h, bias=self.bo is not None, device=local(self.wo).device,
                      dtype=self.wo.dtype)
        with torch.no_grad():
            o.weight.copy_(gather_dim(self.wo, 1, self.num_heads * self.head_dim, g))
            if self.bo is not None:
                o.bias.copy_(local(self.bo))
        out.append(o)
        return tuple(out)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, group=None,
                      algorithm: str = "auto", timeout: float | None = None, backend=None) -> torch.Tensor:
    """Attention of sequence-sharded q (b, s/N, H, d), k, v (b, s/N, Hkv, d) over the whole sequence.

    Differentiable; see ``commfuse.fused.ulysses`` (its ``_UlyssesAttention``) for the schedule. Returns
    (b, s/N, H, d). Not an op (it is built on the pairwise all-to-all's consumer
    form): under ``torch.compile`` it refuses, and a graph break runs it eagerly.
    ``causal`` joins the exchanges' fingerprint: every rank must pass the same.
    """
    return _ulysses(q, k, v, causal, group, algorithm, timeout, backend,
                    layer_config("ulysses_attention", causal=bool(causal)))


@atomic
def _ulysses(q, k, v, causal, group, algorithm, timeout, backend, config) -> torch.Tensor:
    """:func:`ulysses_attention` with the options (``config``) its fingerprints carry."""
    if torch.compiler.is_compiling():
        raise CommfuseValueError(
            "ulysses_attention (and UlyssesAttention) is built on all_to_all_consume, which takes Python "
            "callables and cannot be part of a torch.compile graph: compile with fullgraph=False (torch.compile "
            "then runs it eagerly at a graph break); the layers that compile are listed in docs/compile.md"
        )
    return fused_ulysses.attention(q, k, v, causal=causal, group=resolve_group(group), algorithm=algorithm,
                                   timeout=timeout, backend=backend, config=config)


class UlyssesAttention(nn.Module):
    """Attention under Ulysses sequence parallelism: weights replicated, sequence sharded.

    Input and output (b, s/N, hidden); every rank holds all projection
    weights (their gradients are summed over the group, since each rank sees
    other tokens). Needs num_heads and num_kv_heads divisible by the world size.
    """

    algorithm = algorithm_option(Collective.ALL_TO_ALL)

    def __init__(self, hidden_size: int, num_heads: int, *, num_kv_heads: int | None = None, causal: bool = True,
                 bias: bool = False, group=None, algorithm: str = "auto", device=None, dtype=None) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self._mesh = group if is_mesh(group) else None  # its parameters are replicated, plain: only for its name
        self.rank, self.world_size = world(self.group)
        self.head_dim, self.num_heads, self.num_kv_heads = _heads(hidden_size, num_heads, num_kv_heads, self.world_size)
        self.hidden_size, self.causal, self.algorithm = hidden_size, causal, algorithm
        self.backend = None  # a backend name or object for the ops; None: the one that fits the tensors
        kv = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=bias, device=device, dtype=dtype)
        self.k_proj = nn.Linear(hidden_size, kv, bias=bias, device=device, dtype=dtype)
        self.v_proj = nn.Linear(hidden_size, kv, bias=bias, device=device, dtype=dtype)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=bias, device=device, dtype=dtype)

    def _linear(self, lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return replicated_linear(lin, x, self.group)

    @site_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        d = self.head_dim
        q = self._linear(self.q_proj, x).view(b, length, -1, d)
        k = self._linear(self.k_proj, x).view(b, length, -1, d)
        v = self._linear(self.v_proj, x).view(b, length, -1, d)
        config = layer_config("UlyssesAttention", causal=bool(self.causal), num_heads=self.num_heads,
                                        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                        bias=self.q_proj.bias is not None)
        o = _ulysses(q, k, v, self.causal, self.group, self.algorithm, None, self.backend, config)
        return self._linear(self.o_proj, o.reshape(b, length, -1))

    @classmethod
    def from_linears(cls, q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear, o_proj: nn.Linear, *,
                     num_heads: int, num_kv_heads: int | None = None, causal: bool = True, group=None,
                     algorithm: str = "auto") -> "UlyssesAttention":
        w = q_proj.weight
        with torch.random.fork_rng(devices=[]):  # converting must not move the global RNG
            layer = cls(q_proj.in_features, num_heads, num_kv_heads=num_kv_heads, causal=causal,
                        bias=q_proj.bias is not None, group=group, algorithm=algorithm, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            for mine, theirs in ((layer.q_proj, q_proj), (layer.k_proj, k_proj), (layer.v_proj, v_proj),
                                 (layer.o_proj, o_proj)):
                mine.weight.copy_(theirs.weight)
                if mine.bias is not None:
                    mine.bias.copy_(theirs.bias)
        return layer

    def to_linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
        import copy

        return tuple(copy.deepcopy(lin) for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj))


from commfuse.runtime.eager import eager_only  # noqa: E402

eager_only(ulysses_attention, _ulysses)  # a graph break runs them, and all they call, as plain Python
