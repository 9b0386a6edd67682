"""Mixture-of-experts under expert parallelism, its dispatch and combine fused with the expert GEMMs.

:class:`MoE` holds E SwiGLU experts, E/N on each of the N ranks of an
expert-parallel group, behind a top-k router (softmax or sigmoid gating; the
gate weights are applied on combine). Routing is dropless: every token goes to
its k experts, however many land on one rank.

One layer is two uneven all-to-alls, each paired with half of the experts'
work (the split Comet, ByteDance MLSys'25, makes: dispatch with the first
GEMM, the second GEMM with combine):

* **dispatch** (``all_to_all_consume``): the token rows for each rank's
  experts. Each source's rows, as they arrive, go through the local experts'
  gate/up GEMM and the SwiGLU activation while the next source's fly;
* **combine** (``produce_all_to_all``): each source's down-projection is
  computed and sent back while the next source's is computed.

The backward is the mirror: the output gradient is dispatched to the expert
ranks, each arriving source runs the down-projection's dgrad and wgrad and the
activation's backward; the input gradient of each source is produced (gate/up
dgrad and wgrad) and sent back while the next is computed.

The two halves are public as well, each differentiable on its own with a
backward that is itself an overlapped exchange, for callers that run other
work between them (``commfuse.models.moe_stages`` cuts a block into
``commfuse.strands`` stages there): :func:`dispatch_experts` (dispatch, gate/up
GEMM, SwiGLU; backward: SwiGLU', gate/up dgrad and wgrad, sent back while the
next is made) and :func:`experts_combine` (down GEMM, combine; backward: the
output gradient dispatched, down dgrad and wgrad as each source arrives).

Sizes are known only after routing, so each layer call first exchanges the
per-expert row counts (one small all-to-all, which also checks that every rank
built the same layer). That exchange reads the counts on the host: on a GPU
it is the one host synchronisation of a call, as for any dropless MoE whose
buffers are sized on the host.

``algorithm`` as elsewhere: ``vanilla`` (a whole all-to-all, the experts,
a whole all-to-all), ``sliced:c``, ``ring`` (pairwise, one source per step),
``ring:m`` (each source's rows in m slices, each computed in the step after it
arrived, so a transfer leads its compute by one slice, not one block) and
``auto``. At two ranks plain ``ring`` has one hop per exchange, which hides
only behind the own block's compute; ``auto`` takes ``ring:2`` there when it
takes the ring and half a block carries at least 64 KiB. The grouped GEMM over a rank's local experts is torch's
``torch.nn.functional.grouped_mm`` where this build runs it for the device and
dtype (:data:`GROUPED_MM` says what a process uses), else a loop over experts.

The router also has torchtitan 0.3's (and DeepSeek-V3's) options: a route
scale, a router bias, the auxiliary-loss-free load-balancing expert bias and
node-limited routing; and the layer may have shared experts, whose GEMMs run
while the dispatch flies. What each costs, what the parameters are
(DTensors: experts sharded by expert, the router replicated), whose loss the
gradients are of (``loss``: each rank's own, or one the group shares, as under
sequence parallelism, where the layer takes a sequence-sharded DTensor), and
what runs in which dtype under ``torch.autocast``: :class:`MoE`. A whole model
with MoE layers on a dp x ep mesh: :mod:`commfuse.ep`.

This module is the layer (its construction, checks, parameters and routing) and the two halves' front
doors; the exchanges fused with the experts' GEMMs, forward and backward, with their autograd Functions,
are :mod:`commfuse.fused.moe`'s.
"""

from __future__ import annotations

import math
import struct
import sys
import weakref
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from commfuse import backends, ops
from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.fused import moe as fused_moe
# the block (the exchanges fused with the experts' GEMMs) lives in commfuse.fused.moe; its public names are
# re-exported here, where they have always been
from commfuse.fused.moe import (  # noqa: F401
    GROUPED_MM,
    expert_parallel,
    grouped_mm,
    grouped_mm_kind,
    grouped_wgrad_add_,
    not_traced,
    swiglu,
)
from commfuse.nn._common import (
    ScaleGrad,
    as_param,
    gather_dim,
    layer_mesh,
    local,
    replicated,
    resolve_group,
    site_forward,
    world,
)
from commfuse.planning.all_reduce import group_sum
from commfuse.planning.consumers import collect
from commfuse.planning.gather import all_gather_consume_core
from commfuse.planning.calls import resolve_call
from commfuse.runtime.checkpointing import atomic
from commfuse.runtime.eager import eager_only
from commfuse.runtime.groups import register_format
from commfuse.runtime.admission import op_calls
from commfuse.schedule import Collective, site_algorithm

__all__ = ["GROUPED_MM", "MoE", "dispatch_experts", "experts_combine", "grouped_mm", "grouped_mm_kind",
           "moe_reference", "route", "sort_by_expert"]

GATINGS = ("softmax", "sigmoid")
#: :class:`MoE`'s parameters, by name, as a module holding it names them (its ``named_parameters``)
_PARAMETERS = ("router", "w13", "w2", "router_bias", "shared_w13", "shared_w2")
#: :class:`MoE`'s ``loss``: whose loss its gradients are of (each rank's own, averaged; or one the group shares).
LOSSES = ("per_rank", "shared")


# -- routing ---------------------------------------------------------------------------------------------------


def route(x: torch.Tensor, router: torch.Tensor, topk: int, gating: str = "softmax", normalize: bool = True, *,
          bias: torch.Tensor | None = None, expert_bias: torch.Tensor | None = None, route_scale: float = 1.0,
          num_expert_groups: int | None = None, num_limited_groups: int | None = None):
    """Top-k routing of tokens ``x`` (tokens, hidden) by ``router`` (experts, hidden; a tensor, or a replicated
    DTensor such as :attr:`MoE.router`, whose local tensor is the whole): torchtitan's ``TokenChoiceTopKRouter``.

    Returns ``(weights, experts)``, both (tokens, topk): the gate weights in
    ``x``'s dtype and the experts picked. ``softmax`` (Mixtral) scores every
    expert with a softmax of its logit, ``sigmoid`` (DeepSeek-V3) with a
    sigmoid, in float32. In order:

    * ``bias`` (experts,): the router linear's bias, added to the logits;
    * ``expert_bias`` (experts,): the load-balancing bias, added to the scores
      only to *choose* the experts; the weights are the unbiased scores of the
      chosen;
    * ``num_expert_groups`` / ``num_limited_groups`` (node-limited routing):
      experts in that many groups of consecutive experts, each scored by the
      sum of its two best (biased) scores; only the ``num_limited_groups``
      best groups of a token may be chosen;
    * ``normalize``: the weights renormalised over the k chosen (a sum guarded
      by 1e-20, as torchtitan's ``route_norm``); then times ``route_scale``.
    """
    weight = local(router)
    logits = x @ weight.t() if bias is None else F.linear(x, weight, local(bias))
    scores = torch.softmax(logits.float(), dim=-1) if gating == "softmax" else torch.sigmoid(logits.float())
    choice = scores if expert_bias is None else scores + expert_bias
    if num_expert_groups is not None:
        choice = _limit_groups(choice, num_expert_groups, num_limited_groups)
    if choice is scores:
        weights, experts = torch.topk(scores, topk, dim=-1)
    else:
        experts = torch.topk(choice, topk, dim=-1).indices
        weights = scores.gather(-1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if route_scale != 1.0:
        weights = weights * route_scale
    return weights.to(x.dtype), experts


def _limit_groups(scores: torch.Tensor, groups: int, limited: int) -> torch.Tensor:
    """``scores`` (tokens, experts) with every expert outside each token's ``limited`` best groups at -inf (a
    group's score: the sum of its two best)."""
    grouped = scores.unflatten(-1, (groups, scores.shape[-1] // groups))
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    kept = torch.topk(group_scores, limited, dim=-1, sorted=False).indices
    dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(-1, kept, False)
    return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).flatten(-2)


def sort_by_expert(experts: torch.Tensor, n_experts: int):
    """The (token, k) slots of ``experts`` (tokens, k), :func:`route`'s choice, sorted by expert (stable):
    ``(order, token, counts)``, the slots' order, each sorted slot's token, and the rows per expert
    (``n_experts``,) int64. ``x.index_select(0, token)`` are the rows :func:`dispatch_experts` takes, and
    ``counts.view(world size, -1)`` its ``send_counts``."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: a shape fixed by n_experts (torch.compile traces it)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, order // experts.shape[-1], counts



def moe_reference(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk: int,
                  gating: str = "softmax", normalize: bool = True, *, router_bias: torch.Tensor | None = None,
                  expert_bias: torch.Tensor | None = None, route_scale: float = 1.0,
                  num_expert_groups: int | None = None, num_limited_groups: int | None = None,
                  shared_w13: torch.Tensor | None = None, shared_w2: torch.Tensor | None = None) -> torch.Tensor:
    """One process holding every expert: what :class:`MoE` computes, with plain autograd ops.

    ``x`` (..., hidden); ``router`` (experts, hidden); ``w13`` (experts,
    hidden, 2 * ffn), the gate projection's columns then the up projection's;
    ``w2`` (experts, ffn, hidden). The routing options are :func:`route`'s
    (``router_bias`` is its ``bias``). ``shared_w13`` (hidden, 2 * shared ffn)
    and ``shared_w2`` (shared ffn, hidden): the shared experts, one SwiGLU
    every token goes through, added to the routed output.
    """
    _check_routing("moe_reference", router.shape[0], topk, route_scale, num_expert_groups, num_limited_groups)
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    weights, experts = route(xt, router, topk, gating, normalize, bias=router_bias, expert_bias=expert_bias,
                             route_scale=route_scale, num_expert_groups=num_expert_groups,
                             num_limited_groups=num_limited_groups)
    order, token, counts = sort_by_expert(experts, w13.shape[0])
    xs = xt.index_select(0, token)
    parts, at = [], 0
    for e, c in enumerate(counts.tolist()):
        rows = xs.narrow(0, at, c)
        parts.append(swiglu(rows @ w13[e]) @ w2[e])
        at += c
    ys = torch.cat(parts) * weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros_like(xt).index_add(0, token, ys)
    if shared_w13 is not None:
        out = out + swiglu(xt @ shared_w13) @ shared_w2
    return out.reshape(shape)


def _check_routing(where: str, experts: int, topk: int, route_scale, num_expert_groups, num_limited_groups) -> None:
    """Refuse routing options :func:`route` cannot honour, naming the option and its value."""
    if isinstance(route_scale, bool) or not isinstance(route_scale, (int, float)) or not (
            math.isfinite(route_scale) and route_scale > 0):
        raise CommfuseValueError(f"{where}: route_scale must be a positive finite number, got {route_scale!r}")
    if (num_expert_groups is None) != (num_limited_groups is None):
        raise CommfuseValueError(
            f"{where}: node-limited routing takes num_expert_groups and num_limited_groups together, got "
            f"num_expert_groups={num_expert_groups!r}, num_limited_groups={num_limited_groups!r}")
    if num_expert_groups is None:
        return
    for name, value in (("num_expert_groups", num_expert_groups), ("num_limited_groups", num_limited_groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CommfuseValueError(f"{where}: {name} must be a positive int, got {value!r}")
    if experts % num_expert_groups:
        raise CommfuseValueError(
            f"{where}: num_expert_groups={num_expert_groups} does not divide the {experts} experts")
    per_group = experts // num_expert_groups
    if per_group < 2:  # a group's score is the sum of its two best
        raise CommfuseValueError(
            f"{where}: num_expert_groups={num_expert_groups} leaves {per_group} expert per group of the {experts}; "
            "a group is scored by its two best experts, so it needs at least 2")
    if num_limited_groups > num_expert_groups:
        raise CommfuseValueError(
            f"{where}: num_limited_groups={num_limited_groups} is more than num_expert_groups={num_expert_groups}")
    if topk > num_limited_groups * per_group:
        raise CommfuseValueError(
            f"{where}: topk={topk} is more than the {num_limited_groups * per_group} experts of "
            f"num_limited_groups={num_limited_groups} groups of {per_group}")


# -- the two halves, for a caller that runs something between them (commfuse.strands' stages) -------------------


def dispatch_experts(xs: torch.Tensor, w13: torch.Tensor, send_counts: torch.Tensor, *, group=None,
                     algorithm: str = "ring") -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of an expert-parallel MoE layer: rows sorted by expert dispatched to their experts' ranks,
    each source's rows through this rank's experts' gate/up GEMM and SwiGLU as they arrive.

    ``xs`` (rows, hidden): this rank's rows, sorted by global expert; ``send_counts`` (world size, local
    experts), integer: the rows for each expert of each rank, in ``xs``'s order (:func:`sort_by_expert`'s
    counts viewed so); ``w13`` (local experts, hidden, 2 * ffn): this rank's experts, the gate projection's
    columns then the up projection's. Returns ``(acts, recv_counts)``: ``acts`` (rows arrived, ffn), source
    rank 0's rows first, each source's by expert; ``recv_counts`` (world size, local experts), int64, the rows
    per local expert from each source. :func:`experts_combine` takes both.

    One small all-to-all of the counts first (read on the host), then the dispatch (``algorithm`` as
    :class:`MoE`'s; ``auto`` decides on this rank's row count, so give every rank the same, or name it). The
    backward makes each source's input gradient (SwiGLU', gate/up dgrad and wgrad) and sends it back while
    the next is made. ``w13``'s gradient is the sum over every source's rows divided by the world size, as
    :class:`MoE` gives it with ``loss="per_rank"`` (that of the mean of the ranks' losses).
    """
    not_traced()
    group = resolve_group(group)
    rank, n = world(group)
    return fused_moe.dispatch_experts(xs, w13, send_counts, group=group, rank=rank, world_size=n, algorithm=algorithm)


def experts_combine(acts: torch.Tensor, w2: torch.Tensor, recv_counts: torch.Tensor, send_counts: torch.Tensor, *,
                    group=None, algorithm: str = "ring") -> torch.Tensor:
    """The second half of an expert-parallel MoE layer: :func:`dispatch_experts`'s activations through this
    rank's experts' down GEMM, each source's made and sent back while the next is made; returns (rows, hidden),
    the rows in the order :func:`dispatch_experts` took them (``xs``'s), not yet weighted by the gate.

    ``acts`` and ``recv_counts``: :func:`dispatch_experts`'s outputs; ``send_counts``: what it was given;
    ``w2`` (local experts, ffn, hidden); ``group`` and ``algorithm``: the same as there. The backward sends the
    output gradient to the expert ranks, each arriving source through the down projection's dgrad and wgrad.
    ``w2``'s gradient is the sum over every source's rows divided by the world size, as :class:`MoE` gives it
    with ``loss="per_rank"``.
    """
    not_traced()
    group = resolve_group(group)
    rank, n = world(group)
    return fused_moe.experts_combine(acts, w2, recv_counts, send_counts, group=group, rank=rank, world_size=n,
                                     algorithm=algorithm)


eager_only(dispatch_experts, experts_combine)


# -- the layer ---------------------------------------------------------------------------------------------------


def _reduced(t: torch.Tensor, group, n: int, scale: float) -> torch.Tensor:
    """``t`` whose gradient is summed over ``group`` in the backward, times ``scale`` (1/``n``: averaged; the
    same on every rank either way)."""
    if n == 1 or not torch.is_grad_enabled() or not t.requires_grad:
        return t
    t = replicated(t, group)
    return t if scale == 1.0 else ScaleGrad.apply(t, scale)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded ``seed``; a CPU one where the device has none of its own."""
    try:
        return torch.Generator(device=device).manual_seed(seed)
    except RuntimeError:
        return torch.Generator().manual_seed(seed)


def _normal_(w: torch.Tensor, std: float, g: torch.Generator) -> None:
    """``w`` drawn from N(0, std^2) by ``g`` (on the CPU and copied, when ``g`` is not on ``w``'s device)."""
    if g.device == w.device:
        nn.init.normal_(w, std=std, generator=g)
    else:
        w.copy_(torch.empty(w.shape, dtype=w.dtype).normal_(std=std, generator=g))


def _placement(kind: str):
    from torch.distributed.tensor import Replicate, Shard

    return Shard(0) if kind == "shard" else Replicate()


class MoE(nn.Module):
    """A mixture-of-experts layer over an expert-parallel group; input and output (..., hidden).

    ``experts`` SwiGLU experts of ``ffn_size`` each, ``experts / N`` held on
    each rank of ``group`` (rank r holds experts r*E/N .. (r+1)*E/N - 1), and
    the router ``router`` (experts, hidden) on every rank. ``group`` is a
    ProcessGroup, a 1-D DeviceMesh (``mesh["ep"]``) or None (the default group).

    **Routing options** (keyword-only, each off by default; each is
    torchtitan 0.3's ``TokenChoiceTopKRouter`` / ``MoE`` option of the same
    name unless said, :func:`route` has the math; DeepSeek-V3's values in
    brackets). None adds a host synchronisation: the one a call has is still
    its size exchange. What each costs:

    * ``route_scale`` (2.5): a factor on the gate weights applied on combine,
      after the renormalisation. One multiply of the (tokens, k) weights.
    * ``router_bias`` (a bool; torchtitan's router ``gate`` linear's ``bias``):
      the router linear gets a bias :attr:`router_bias` (experts,),
      replicated as the router, initialised to zeros. The add in the router's
      GEMM, and one all-reduce of its E gradients in the backward (averaged
      over the group as the router's).
    * ``load_balance_coeff`` (1e-3; torchtitan's default is 1e-3, here None):
      the auxiliary-loss-free load balancing of DeepSeek-V3. A buffer
      :attr:`expert_bias` (experts,) float32 is added to the scores only to
      choose the experts (the gate weights are the unbiased scores), and each
      forward in training mode adds this rank's tokens per expert into the
      buffer :attr:`tokens_per_expert` (an add of E floats on the device). The
      update, :meth:`update_expert_bias`, runs before the optimizer step
      (:meth:`register_expert_bias_update` hooks it there, as torchtitan's
      optimizer hook does): the counts summed over the group (and the
      data-parallel group, if given), ``bias += coeff * sign(mean - counts)``
      centred to mean zero, counts zeroed. One all-reduce of E floats per
      optimizer step. Under DDP over a data-parallel axis pass
      ``broadcast_buffers=False``: DDP would overwrite every rank's counts
      with its first rank's before each forward.
    * ``num_expert_groups`` and ``num_limited_groups`` (8 and 4):
      node-limited routing. The experts fall in groups of consecutive experts
      (so groups that divide the ranks are ranks' experts), each scored per
      token by the sum of its two best biased scores; a token chooses only
      within its ``num_limited_groups`` best groups. A few (tokens, experts)
      ops; the exchanges stay dropless all-to-alls, carrying no rows to the
      groups a token did not keep.
    * ``shared_ffn_size`` (2048 = the routed experts' ffn times the count of
      shared experts, as torchtitan's DeepSeek-V3 builds its
      ``shared_experts`` FeedForward): a dense SwiGLU, replicated on every rank
      of the group (:attr:`shared_w13` (hidden, 2 * shared_ffn_size), the gate
      then the up projection, :attr:`shared_w2` (shared_ffn_size, hidden)),
      through which every token goes; its output is added to the routed
      output. Its GEMMs run while the dispatch flies (in the dispatch's first
      compute step: beside the ring's first hop), its backward while the
      backward's dispatch flies; one all-reduce of its gradients per backward
      (averaged over the group as the router's).

    **Parameters.** With more than one rank they are DTensors, as torchtitan
    holds an expert-parallel MoE's: ``w13`` (experts, hidden, 2 * ffn), the
    gate then the up projection, and ``w2`` (experts, ffn, hidden) placed
    ``Shard(0)`` (this rank's local tensor holds its E/N experts), ``router``
    ``Replicate()``, on the group's mesh (a 1-D DeviceMesh given as ``group``
    is that mesh; a ProcessGroup gets ``DeviceMesh.from_group``). So
    ``state_dict``, ``torch.distributed.checkpoint``, optimizers and
    ``clip_grad_norm_`` see the whole layer: a checkpoint holds every rank's
    experts. The forward runs on the local tensors.

    **Gradients.** ``loss`` says whose loss they are of:

    * ``"per_rank"`` (the default): every rank of the group has tokens and
      a loss of its own, as under DDP. The gradients are those of the *mean*
      of the ranks' losses, as DDP gives for what it replicates: the router's
      gradient (and the router bias's and the shared experts', likewise) is
      averaged over the group in the backward (one all-reduce of (experts,
      hidden)); each expert's is the sum over every token routed to it, from
      every rank, divided by N. So on one expert-parallel axis there is
      nothing to add.
    * ``"shared"``: the ranks hold shards of one batch and share one loss,
      which every rank computes alike (the sequence shards of a
      tensor-parallel model under sequence parallelism). The gradients are
      that loss's: the router's summed over the group, each expert's the sum
      over its tokens. Under ``"per_rank"`` they would be 1/N of it.

    A DTensor input is one tensor sharded over the group, so it takes
    ``"shared"``: placed ``Shard(d)`` (d any dim but the last) on a 1-D mesh
    over the group's ranks, as torch's ``SequenceParallel`` hands on a
    sequence-sharded activation. The layer computes on its local tensor and
    returns a DTensor placed alike (its gradient comes back so too); it refuses
    by name a DTensor under ``"per_rank"``, a replicated or partial one, one
    sharded along its features and one over other ranks. A local tensor says
    nothing of the loss: ``loss`` does. ``loss`` is part of each call's size
    exchange check, so a rank built with the other is named on every rank.

    Beside a data-parallel axis (a dp x ep mesh, each rank with a loss of its
    own): build the layer with ``group=mesh["ep"]``; the model's other (dense)
    parameters are then averaged over all dp x ep ranks and the layer's over
    dp. :func:`commfuse.ep.fully_shard` (FSDP2) and :func:`commfuse.ep.ddp`
    make both reductions, and :func:`commfuse.ep.clip_grad_norm_` clips such a
    model, whose parameters lie on several meshes. Never wrap the layer in
    DDP over (a group holding ranks of) its expert-parallel group with its
    parameters in DDP's care: DDP broadcasts rank 0's parameters, which would
    overwrite every rank's experts with rank 0's. The layer refuses to run
    under such a DDP (a :class:`CommfuseValueError` naming DDP's ranks, at its
    first forward), unless DDP ignores its parameters (as
    :func:`commfuse.ep.ddp` has it); DDP over a plain process group refuses
    the DTensor parameters itself when it is built.

    **Initialisation.** The router is drawn from the global RNG: seed every
    rank alike, as for any replicated parameter. Each expert is drawn from a
    generator seeded by one draw of the global RNG and the expert's global
    index, so the experts differ from each other and from rank to rank, and do
    not depend on the world size.

    **Mixed precision.** Under ``torch.autocast`` (for the input's device
    type), the dispatched rows, the experts' weights and the combined rows are
    cast to the autocast dtype: the experts' GEMMs run in it and both
    exchanges (and the backward's) carry it; the router's matmul is autocast's
    as any matmul is. Output and gradient dtypes are those of
    :func:`moe_reference` under the same autocast (for a float32 input or
    one in the autocast dtype: the output in the input's dtype, as the gate
    weights are; gradients in the input's and the parameters' dtypes; the
    router's gradient is averaged in theirs). Outside autocast an input whose
    dtype is not the parameters' is refused by name, as torch's matmul
    refuses it.

    Every rank must build the same layer (expert count, sizes, top-k,
    gating): each call's size exchange checks it, and a rank that differs is
    named on every rank. ``algorithm`` (the grammar of
    ``commfuse.schedule.parse_algorithm`` for an all-to-all) is checked when
    it is set. ``auto`` decides once, on its first call, on the blocks of
    balanced routing for the most tokens any rank has then.
    """

    def __init__(self, hidden_size: int, ffn_size: int, experts: int, topk: int = 2, *, gating: str = "softmax",
                 normalize: bool = True, route_scale: float = 1.0, router_bias: bool = False,
                 load_balance_coeff: float | None = None, num_expert_groups: int | None = None,
                 num_limited_groups: int | None = None, shared_ffn_size: int | None = None, group=None,
                 loss: str = "per_rank", algorithm: str = "auto", device=None, dtype=None) -> None:
        super().__init__()
        if gating not in GATINGS:
            raise CommfuseValueError(f"gating must be one of {GATINGS}, got {gating!r}")
        for name, value in (("hidden_size", hidden_size), ("ffn_size", ffn_size), ("experts", experts),
                            ("topk", topk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CommfuseValueError(f"MoE: {name} must be a positive int, got {value!r}")
        if topk > experts:
            raise CommfuseValueError(f"MoE: topk={topk} is more than the {experts} experts")
        _check_routing("MoE", experts, topk, route_scale, num_expert_groups, num_limited_groups)
        if not isinstance(router_bias, bool):
            raise CommfuseValueError(f"MoE: router_bias must be True or False, got {router_bias!r}")
        if load_balance_coeff is not None and (
                isinstance(load_balance_coeff, bool) or not isinstance(load_balance_coeff, (int, float))
                or not (math.isfinite(load_balance_coeff) and load_balance_coeff > 0)):
            raise CommfuseValueError(
                f"MoE: load_balance_coeff must be a positive finite number or None, got {load_balance_coeff!r}")
        if shared_ffn_size is not None and (
                isinstance(shared_ffn_size, bool) or not isinstance(shared_ffn_size, int) or shared_ffn_size < 1):
            raise CommfuseValueError(f"MoE: shared_ffn_size must be a positive int or None, got {shared_ffn_size!r}")
        self.algorithm = algorithm  # checked (the property below)
        self.group = resolve_group(group)
        self.rank, self.world_size = world(self.group)
        if experts % self.world_size:
            raise CommfuseValueError(
                f"MoE: rank {self.rank}: {experts} experts do not divide over the {self.world_size} ranks of the "
                "expert-parallel group")
        self.hidden_size, self.ffn_size, self.experts, self.topk = hidden_size, ffn_size, experts, topk
        self.gating, self.normalize = gating, normalize
        self.route_scale = float(route_scale)
        self.load_balance_coeff = None if load_balance_coeff is None else float(load_balance_coeff)
        self.num_expert_groups, self.num_limited_groups = num_expert_groups, num_limited_groups
        self.shared_ffn_size = shared_ffn_size
        self.loss = loss  # checked (the property below)
        self.local_experts = experts // self.world_size
        self.backend = None
        self._calls: dict = {}
        self._ddp_seen = weakref.WeakKeyDictionary()  # the DDP modules this layer ran under, found harmless
        self._inputs_seen: dict = {}  # the DTensor inputs' (mesh, placements, ndim, loss) found right
        kw = dict(device=device, dtype=dtype)
        # DTensors on the group's mesh with more than one rank (None: plain tensors, the whole layer)
        mesh = self._mesh = layer_mesh(group, self.group, self.world_size, device)
        shard, whole = (_placement("shard"), _placement("replicate")) if mesh is not None else (None, None)
        self.router = as_param(torch.empty(experts, hidden_size, **kw), mesh, whole, (experts, hidden_size))
        self.w13 = as_param(torch.empty(self.local_experts, hidden_size, 2 * ffn_size, **kw), mesh, shard,
                            (experts, hidden_size, 2 * ffn_size))
        self.w2 = as_param(torch.empty(self.local_experts, ffn_size, hidden_size, **kw), mesh, shard,
                           (experts, ffn_size, hidden_size))
        self.router_bias = as_param(torch.empty(experts, **kw), mesh, whole, (experts,)) if router_bias else None
        self.shared_w13 = self.shared_w2 = None
        if shared_ffn_size is not None:
            self.shared_w13 = as_param(torch.empty(hidden_size, 2 * shared_ffn_size, **kw), mesh, whole,
                                       (hidden_size, 2 * shared_ffn_size))
            self.shared_w2 = as_param(torch.empty(shared_ffn_size, hidden_size, **kw), mesh, whole,
                                      (shared_ffn_size, hidden_size))
        if self.load_balance_coeff is not None:  # float32 whatever the parameters' dtype, as torchtitan's
            self.register_buffer("expert_bias", torch.zeros(experts, device=device, dtype=torch.float32))
            self.register_buffer("tokens_per_expert", torch.zeros(experts, device=device, dtype=torch.float32),
                                 persistent=False)
        else:
            self.expert_bias = self.tokens_per_expert = None
        self.reset_parameters()

    @property
    def algorithm(self) -> str:
        return self._algorithm

    @algorithm.setter
    def algorithm(self, value: str) -> None:
        self._algorithm = site_algorithm("MoE", value, Collective.ALL_TO_ALL)

    @property
    def loss(self) -> str:
        """Whose loss the gradients are of: ``"per_rank"`` (each rank's own; their mean) or ``"shared"`` (one
        loss the group's ranks share); see the class's **Gradients**."""
        return self._loss

    @loss.setter
    def loss(self, value: str) -> None:
        if value not in LOSSES:
            raise CommfuseValueError(
                f"MoE: loss must be 'per_rank' (every rank of the group has a loss of its own, as under DDP) or "
                f"'shared' (the ranks hold shards of one batch with one loss, as under sequence parallelism), "
                f"got {value!r}")
        self._loss = value
        # the gradients' factor over the group's ranks: the mean of their losses, or the one loss they share
        self._grad_scale = 1.0 / self.world_size if value == "per_rank" else 1.0

    def reset_parameters(self) -> None:
        """The router and the shared experts from the global RNG, the router bias and the expert bias zeros;
        expert e from a generator seeded by one draw of the global RNG and e."""
        router, w13, w2 = local(self.router), local(self.w13), local(self.w2)
        seed = int(torch.randint(0, 2**62, ()))  # the same on every rank seeded alike
        with torch.no_grad():
            nn.init.normal_(router, std=1.0 / math.sqrt(self.hidden_size))
            if self.router_bias is not None:
                nn.init.zeros_(local(self.router_bias))
            if self.shared_w13 is not None:
                nn.init.normal_(local(self.shared_w13), std=1.0 / math.sqrt(self.hidden_size))
                nn.init.normal_(local(self.shared_w2), std=1.0 / math.sqrt(self.shared_ffn_size))
            if self.expert_bias is not None:
                self.expert_bias.zero_()
                self.tokens_per_expert.zero_()
            if w13.device.type == "meta":
                return
            start, _ = self.expert_range
            for i in range(w13.shape[0]):
                g = _generator(w13.device, seed + start + i)
                _normal_(w13[i], 1.0 / math.sqrt(self.hidden_size), g)
                _normal_(w2[i], 1.0 / math.sqrt(self.ffn_size), g)

    @property
    def expert_range(self) -> tuple[int, int]:
        """The global indices [start, stop) of this rank's experts."""
        return self.rank * self.local_experts, (self.rank + 1) * self.local_experts

    def load_experts(self, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                     router_bias: torch.Tensor | None = None, expert_bias: torch.Tensor | None = None,
                     shared_w13: torch.Tensor | None = None, shared_w2: torch.Tensor | None = None) -> "MoE":
        """Copy this rank's share of every expert's weights (``moe_reference``'s layout: ``w13`` (experts,
        hidden, 2 * ffn), ``w2`` (experts, ffn, hidden)) and the router (experts, hidden) into the local
        tensors; and, where given, the router bias (experts,), the expert bias (experts,) and the shared
        experts (``shared_w13`` (hidden, 2 * shared ffn), ``shared_w2`` (shared ffn, hidden)), each of which
        the layer must have."""
        want = {"router": (self.experts, self.hidden_size), "w13": (self.experts, self.hidden_size, 2 * self.ffn_size),
                "w2": (self.experts, self.ffn_size, self.hidden_size), "router_bias": (self.experts,),
                "expert_bias": (self.experts,)}
        if self.shared_ffn_size is not None:
            want["shared_w13"] = (self.hidden_size, 2 * self.shared_ffn_size)
            want["shared_w2"] = (self.shared_ffn_size, self.hidden_size)
        given = {"router": router, "w13": w13, "w2": w2, "router_bias": router_bias, "expert_bias": expert_bias,
                 "shared_w13": shared_w13, "shared_w2": shared_w2}
        for name, t in given.items():
            if t is None:
                continue
            if getattr(self, name) is None:
                raise CommfuseValueError(f"MoE.load_experts: rank {self.rank}: {name} was given, but the layer was "
                                         f"built without it ({self.extra_repr()})")
            if tuple(t.shape) != want[name]:
                raise CommfuseValueError(f"MoE.load_experts: rank {self.rank}: {name} has shape {list(t.shape)}, "
                                         f"the whole layer's is {list(want[name])}")
        start, stop = self.expert_range
        with torch.no_grad():
            local(self.router).copy_(local(router))
            local(self.w13).copy_(w13[start:stop])
            local(self.w2).copy_(w2[start:stop])
            for name in ("router_bias", "expert_bias", "shared_w13", "shared_w2"):
                if given[name] is not None:
                    local(getattr(self, name)).copy_(local(given[name]))
        return self

    def gather_experts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole layer on every rank as ``moe_reference`` (and :meth:`load_experts`) take it: ``(router,
        w13, w2)``, plain tensors. Gathers every rank's experts: a collective over the group."""
        router = local(self.router).detach().clone()
        return (router, gather_dim(self.w13, 0, self.experts, self.group),
                gather_dim(self.w2, 0, self.experts, self.group))

    def _meta(self) -> list[int]:
        return [self.experts, self.hidden_size, self.ffn_size, self.topk, GATINGS.index(self.gating),
                int(self.normalize), self.shared_ffn_size or 0, self.num_expert_groups or 0,
                self.num_limited_groups or 0, int(self.router_bias is not None), int(self.expert_bias is not None),
                _float_bits(self.route_scale), LOSSES.index(self.loss)]

    def update_expert_bias(self, dp_group=None) -> None:
        """One step of the auxiliary-loss-free load balancing (torchtitan's ``_update_expert_bias``): the
        tokens each expert got since the last update, summed over the expert-parallel group and, given one
        (a ProcessGroup or a 1-D DeviceMesh, ``mesh["dp"]``), the data-parallel group (torchtitan sums over
        its loss mesh: every rank whose tokens differ); then ``delta = coeff * sign(mean(counts) - counts)``,
        ``expert_bias += delta - mean(delta)``; the counts zeroed. Every rank of both groups must call it
        (one all-reduce of E floats over each, through commfuse); the bias then is the same on every rank.
        Run it before each optimizer step (:meth:`register_expert_bias_update`), after the step's forwards
        (all of them, under gradient accumulation)."""
        if self.load_balance_coeff is None:
            raise CommfuseValueError(
                f"MoE.update_expert_bias: rank {self.rank}: the layer was built with load_balance_coeff=None: it "
                "has no expert bias to update")
        with torch.no_grad():
            counts = self.tokens_per_expert.clone()
            if self.world_size > 1:
                counts = _summed(counts, self.group)
            if dp_group is not None and world(resolve_group(dp_group))[1] > 1:
                counts = _summed(counts, resolve_group(dp_group))
            delta = self.load_balance_coeff * torch.sign(counts.mean() - counts)
            self.expert_bias.add_(delta - delta.mean())
            self.tokens_per_expert.zero_()

    def register_expert_bias_update(self, optimizer: torch.optim.Optimizer, dp_group=None):
        """Run :meth:`update_expert_bias` before each ``optimizer.step()`` (torchtitan's optimizer step pre-hook);
        returns the hook's handle (``handle.remove()`` undoes it)."""
        if self.load_balance_coeff is None:
            raise CommfuseValueError(
                f"MoE.register_expert_bias_update: rank {self.rank}: the layer was built with "
                "load_balance_coeff=None: it has no expert bias to update")
        return optimizer.register_step_pre_hook(lambda *_: self.update_expert_bias(dp_group))

    def _refuse_ddp_over_experts(self) -> None:
        """Refuse to run inside DistributedDataParallel over a group that holds two or more of this layer's
        ranks, unless that DDP leaves this layer's parameters alone (its ``parameters_to_ignore``, as
        :func:`commfuse.ep.ddp` sets them): DDP broadcast rank 0's parameters over theirs when it was built and
        averages their gradients."""
        ddp_module = sys.modules.get("torch.nn.parallel.distributed")
        ddp = None if ddp_module is None else ddp_module.DistributedDataParallel._active_ddp_module
        if ddp is None or self.world_size == 1 or ddp in self._ddp_seen:
            return
        import torch.distributed as dist

        theirs = dist.get_process_group_ranks(ddp.process_group)
        mine = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
        shared = sorted(set(theirs) & set(mine))
        # by name: DDP's DTensor path (device_mesh=) swaps the parameters for other tensors in each forward
        ignored = getattr(ddp, "parameters_to_ignore", ())
        path = next((name for name, m in ddp.module.named_modules() if m is self), None)
        mine_named = [f"{path}.{name}" if path else name for name in _PARAMETERS if getattr(self, name) is not None]
        if len(shared) > 1 and (path is None or any(name not in ignored for name in mine_named)):
            raise CommfuseValueError(
                f"MoE: rank {self.rank}: it runs inside DistributedDataParallel over global ranks {theirs}, "
                f"{len(shared)} of which ({shared}) are ranks of its expert-parallel group {mine}: each of them "
                f"holds experts of its own, which DDP overwrote with global rank {theirs[0]}'s when it was built "
                "and would average with the others' gradients. On a dp x ep mesh wrap the model with "
                "commfuse.ep.ddp(model, mesh) (DDP over dp x ep for the other parameters, over dp for this "
                "layer's), or a model of MoE layers alone in DDP over the data-parallel axis only "
                "(device_mesh=mesh['dp']): the layer reduces its gradients over its expert-parallel group itself")
        self._ddp_seen[ddp] = True

    @site_forward
    @atomic  # one op to selective checkpointing: its router, exchanges and experts (commfuse.runtime.checkpointing)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtensor = sys.modules.get("torch.distributed.tensor")
        sharded = x if dtensor is not None and isinstance(x, dtensor.DTensor) else None
        compiling = torch.compiler.is_compiling()
        if compiling and self.world_size > 1:
            not_traced()  # before the backend is looked up, which older Dynamo cannot trace
        if not compiling:
            self._refuse_ddp_over_experts()
        if sharded is not None:  # this rank's tokens (checked below); the gradient comes back placed as x
            x = x.to_local()
        shape = x.shape
        xt = x.reshape(-1, shape[-1])
        router, w13, w2 = local(self.router), local(self.w13), local(self.w2)
        be = None if self.world_size == 1 else backends.resolve(self.backend, self.group, xt.device)
        first = be is not None and self.algorithm == "auto" and (self.algorithm, self.backend, xt.device,
                                                                  xt.dtype) not in self._calls
        # the router, the sort and the exchanges (auto's token count on the first call, then the sizes, the
        # dispatch and the combine): if this rank leaves before making them all, its peers hear of it
        # (under torch.compile the exchanges run at a graph break, eagerly; the count is not traced)
        guard = nullcontext() if compiling else op_calls(be, "MoE.forward", (1 if first else 0) + 3)
        with guard:  # a refusal on this rank reaches its peers
            if sharded is not None:
                self._check_sharded(sharded)
            if shape[-1] != self.hidden_size:
                raise CommfuseValueError(
                    f"MoE: rank {self.rank}: input has {shape[-1]} features in its last dim, the layer's hidden "
                    f"size is {self.hidden_size}")
            # the dtype torch.autocast runs a matmul of the two in, when it casts both (the ops' own rule)
            cast = ops.autocast_dtype(xt) if ops.autocast_dtype(w13) is not None else None
            if cast is None and xt.dtype != w13.dtype:
                raise CommfuseTypeError(
                    f"MoE: rank {self.rank}: the input is {xt.dtype} and the layer's parameters are {w13.dtype}: "
                    "torch's matmul does not mix them; cast the input, or the layer (moe.to(dtype)), or run "
                    "under torch.autocast")
            n = self.world_size
            scale = self._grad_scale
            router = _reduced(router, self.group, n, scale)
            bias = None if self.router_bias is None else _reduced(local(self.router_bias), self.group, n, scale)
            weights, chosen = route(xt, router, self.topk, self.gating, self.normalize, bias=bias,
                                    expert_bias=self.expert_bias, route_scale=self.route_scale,
                                    num_expert_groups=self.num_expert_groups,
                                    num_limited_groups=self.num_limited_groups)
            order, token, counts = sort_by_expert(chosen, self.experts)
            if self.tokens_per_expert is not None and self.training:
                with torch.no_grad():  # on the device: read on the host only by update_expert_bias's all-reduce
                    self.tokens_per_expert.add_(counts)
            xs = xt.index_select(0, token)
            call = self._call(xt)
            send_counts = counts.view(n, self.local_experts)
            shared = None
            if self.shared_w13 is not None:
                shared = (xt, _reduced(local(self.shared_w13), self.group, n, scale),
                          _reduced(local(self.shared_w2), self.group, n, scale))
            if cast is None:
                ys = expert_parallel(xs, w13, w2, call, send_counts, self._meta(), scale, shared)
            else:  # the rows, the experts and both exchanges in autocast's dtype; autocast itself off inside
                if shared is not None:
                    shared = tuple(t.to(cast) for t in shared)
                with torch.autocast(xt.device.type, enabled=False):
                    ys = expert_parallel(xs.to(cast), w13.to(cast), w2.to(cast), call, send_counts, self._meta(),
                                          scale, shared)
        ys, shared_out = ys if shared is not None else (ys, None)
        ys = ys * weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(xt).index_add(0, token, ys)
        if shared_out is not None:
            out = out + shared_out
        out = out.reshape(shape)
        if sharded is None:
            return out
        return dtensor.DTensor.from_local(out, sharded.device_mesh, sharded.placements, run_check=False,
                                          shape=sharded.shape, stride=sharded.stride())

    def _check_sharded(self, x) -> None:
        """A DTensor input must be this layer's group's tokens, one shard per rank: placed ``Shard(d)`` (d not
        the feature dim) on a 1-D mesh over the group's ranks, into a layer whose ranks share one loss. Once
        per mesh and placement."""
        key = (x.device_mesh, tuple(x.placements), x.ndim, self.loss)
        if key in self._inputs_seen:
            return
        from torch.distributed.tensor import Shard

        import torch.distributed as dist

        mesh, placements = x.device_mesh, tuple(x.placements)
        where = (f"MoE: rank {self.rank} (global rank {dist.get_rank()}): the input is a DTensor placed {placements} "
                 f"on {mesh}")
        mine = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
        if mesh.ndim != 1:
            raise CommfuseValueError(
                f"{where}, a {mesh.ndim}-D mesh; the layer takes its group's tokens sharded over a 1-D mesh of "
                f"the group's ranks {mine}, or this rank's tokens as a local tensor (x.to_local())")
        theirs = dist.get_process_group_ranks(mesh.get_group())
        if theirs != mine:
            raise CommfuseValueError(
                f"{where}, over global ranks {theirs}; the layer's expert-parallel group is global ranks {mine}. "
                "Pass this rank's tokens as a local tensor (x.to_local()), and say with loss= whether those "
                "ranks share one loss")
        (placement,) = placements
        if not isinstance(placement, Shard) or placement.dim % x.ndim == x.ndim - 1:
            what = ("replicated: every rank would route every token, and each expert would count each token "
                    f"{self.world_size} times" if placement.is_replicate() else
                    "a partial sum: redistribute it first" if placement.is_partial() else
                    "sharded along its features: the router and the experts need whole tokens")
            raise CommfuseValueError(
                f"{where}, {what}. The layer takes its group's tokens sharded along a dim other than the last "
                "(Shard(1), as torch's SequenceParallel hands on a sequence-sharded activation)")
        if self.loss != "shared":
            raise CommfuseValueError(
                f"{where}: one tensor sharded over the layer's group, whose ranks therefore share one loss, but the "
                f"layer was built with loss={self.loss!r} (one loss per rank: its gradients would be 1/"
                f"{self.world_size} of that loss's). Build it with loss='shared'")
        self._inputs_seen[key] = True

    def _call(self, xt: torch.Tensor):
        """The exchanges' resolved options. ``auto`` decides once per layer, device and dtype, on the blocks of
        balanced routing for the most tokens any rank has on that first call (agreed by one all-reduce), so
        that every rank decides alike however its own token count differs."""
        key = (self.algorithm, self.backend, xt.device, xt.dtype)
        found = self._calls.get(key)
        if found is not None:
            return found[0]
        be = None if self.world_size == 1 else backends.resolve(self.backend, self.group, xt.device)
        rows = xt.shape[0]
        if be is not None and self.algorithm == "auto":
            # every rank's token count, through commfuse (numbered, checked, bounded by its timeout and
            # interruptible like any call), not a raw collective bounded only by the group's own timeout
            mine = torch.tensor([rows], dtype=torch.int64, device=getattr(be, "device", None) or xt.device)
            counts = resolve_call(Collective.ALL_GATHER, "vanilla", group=self.group, backend=be, device=xt.device)
            rows = max(int(t.item()) for t in all_gather_consume_core(counts, mine, collect, 0,
                                                                               label="moe.tokens"))
        slice_bytes = rows * self.topk // self.world_size * self.hidden_size * xt.element_size()
        # the experts take half blocks, so on two ranks auto may cut each block in two (the policy's rule)
        call = resolve_call(Collective.ALL_TO_ALL, self.algorithm, group=self.group, backend=be, device=xt.device,
                            slice_bytes=slice_bytes, halves=True)
        self._calls[key] = (call,)
        return call

    def extra_repr(self) -> str:
        options = "".join(f", {name}={value!r}" for name, value, on in (
            ("route_scale", self.route_scale, self.route_scale != 1.0),
            ("router_bias", True, self.router_bias is not None),
            ("load_balance_coeff", self.load_balance_coeff, self.load_balance_coeff is not None),
            ("num_expert_groups", self.num_expert_groups, self.num_expert_groups is not None),
            ("num_limited_groups", self.num_limited_groups, self.num_limited_groups is not None),
            ("shared_ffn_size", self.shared_ffn_size, self.shared_ffn_size is not None),
            ("loss", self.loss, self.loss != "per_rank")) if on)
        return (f"hidden_size={self.hidden_size}, ffn_size={self.ffn_size}, experts={self.experts} "
                f"({self.local_experts} per rank of {self.world_size}), topk={self.topk}, gating={self.gating}"
                f"{options}, algorithm={self.algorithm!r}")


def _float_bits(x: float) -> int:
    """``x``'s IEEE double bits as a signed int64 (a fingerprint holds ints)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` summed over ``group``: through commfuse (numbered, bounded by its timeout, told to every rank)."""
    return group_sum(t, group, label="moe.tokens_per_expert")


def _describe_sizes(v):
    k = v[0]
    rest = v[1:]
    if len(rest) >= 13:
        experts, hidden, ffn, topk, gating, normalize, shared, groups, limited, bias, balance, scale, loss = rest[:13]
        gate = GATINGS[gating] if 0 <= gating < len(GATINGS) else f"gating#{gating}"
        scale = struct.unpack("<d", struct.pack("<q", scale))[0]
        options = "".join(part for part, on in (
            (f", route_scale {scale:g}", scale != 1.0), (", a router bias", bias), (", an expert bias", balance),
            (f", {limited} of {groups} expert groups", groups), (f", shared experts of ffn {shared}", shared)) if on)
        losses = {0: "one loss per rank", 1: "one loss shared over the group"}
        return (f"an MoE layer of {experts} experts ({k} on each rank), hidden {hidden}, ffn {ffn}, top-{topk} "
                f"{gate} gating{'' if normalize else ', not renormalised'}{options}, "
                f"{losses.get(loss, f'loss#{loss}')} (loss={LOSSES[loss] if 0 <= loss < len(LOSSES) else loss!r})")
    return f"{k} counts per rank"


register_format("moe.sizes", _describe_sizes)
register_format("moe.tokens", lambda v: "the token count auto decides on (one per rank)")
for _label in ("moe.tokens_per_expert.reduce", "moe.tokens_per_expert.gather"):
    register_format(_label, lambda v: "the tokens per expert of the load balancing's update")
