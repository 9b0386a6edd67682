"""The sharded linear (ZeRO-3 / FSDP) with the weight's all-gather and the gradients' reduce-scatter fused
into the GEMMs: the one implementation, under ``commfuse.nn.ShardedLinear`` (eager, :class:`_ShardedLinear`)
and ``torch.ops.commfuse.sharded_linear`` (``commfuse.library``: :func:`sharded_linear_forward` and
:func:`sharded_linear_backward` in its kernels).

``y = x @ W^T + b`` with W (out, in) and b row-sharded over the group: rank r holds rows
``tensor_split(out, N)[r]``, all of one size (out divides by N).
"""

from __future__ import annotations

import torch

from commfuse.planning.consumers import collect
from commfuse.planning.gather import all_gather_consume_core
from commfuse.planning.scatter import produce_reduce_scatter_core
from commfuse.planning.calls import resolve_call
from commfuse.runtime.checkpointing import atomic
from commfuse.runtime.programs import rounded, sum_zeros
from commfuse.schedule import Collective

__all__ = [
    "all_gather_call", "sharded_linear_backward", "sharded_linear_dgrad", "sharded_linear_fn", "sharded_linear_forward",
]


@atomic
def all_gather_call(algorithm: str, weight: torch.Tensor, dtype: torch.dtype, *, group=None, backend=None,
                    device=None):
    """The weight ring's call (None at world size 1): ``auto`` decided on one weight shard's bytes in the
    compute ``dtype`` (what the ring carries), the same on every rank."""
    return resolve_call(Collective.ALL_GATHER, algorithm, group=group, backend=backend, device=device,
                        slice_bytes=weight.shape[0] * weight.shape[1] * dtype.itemsize)


class _ShardedLinear(torch.autograd.Function):
    """``y = x @ W^T + b`` with W (and b) row-sharded over the group.

    ======== =============================================== ===============================
    pass     computes                                        communication
    ======== =============================================== ===============================
    forward  y[..., cols_s] = x @ W_s^T per shard s          all-gather ring of W_r
    dgrad    dx = sum_s dy[..., cols_s] @ W_s                all-gather ring of W_r
    wgrad    dW_d = sum_ranks dy[..., cols_d]^T @ x          reduce-scatter ring (Flash-RS)
    bias     b gathered / db reduce-scattered                two tiny rings
    ======== =============================================== ===============================

    Shapes: x (..., in), W_r (out/N, in), b_r (out/N), y (..., out). The
    three big rings move tensors of one shape, so they share one pool of
    receive buffers.
    """

    @staticmethod
    def forward(ctx, call, layer, x: torch.Tensor, weight: torch.Tensor, bias):
        y = sharded_linear_forward(call, x, weight, bias)
        ctx.call, ctx.layer, ctx.has_bias = call, layer, bias is not None
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        call, layer = ctx.call, ctx.layer
        n = call.world_size
        need_x, need_w, need_b = ctx.needs_input_grad[2], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        dx = sharded_linear_dgrad(call, x, weight, dy) if need_x else None
        wgrad, bgrad = _grad_parts(x, weight, dy, need_w, ctx.has_bias and need_b, layer.reduce_dtype)
        if not layer.requires_gradient_sync:
            # accumulate this rank's whole gradient without reducing it; the next synced backward reduces the sum
            layer._hold("weight", [wgrad(d) for d in range(n)] if wgrad else None)
            layer._hold("bias", [bgrad(d) for d in range(n)] if bgrad else None)
            return None, None, dx, None, None
        if wgrad is not None:
            wgrad = layer._with_held("weight", wgrad)
        if bgrad is not None:
            bgrad = layer._with_held("bias", bgrad)
        dw, db = _reduce_grads(call, weight, wgrad, bgrad, layer.reduce)
        layer._held.clear()
        return None, None, dx, dw, db


def sharded_linear_forward(call, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """``x @ W^T + b`` from this rank's row shard of W (and b): the weight's all-gather ring, one output block
    per arriving shard (see :class:`_ShardedLinear`)."""
    rows = weight.shape[0]
    y = x.new_empty(*x.shape[:-1], rows * call.world_size)
    compute = x.dtype  # the layer's param_dtype when it has one (the module cast x)

    def consume(w_s: torch.Tensor, s: int) -> None:
        y.narrow(-1, s * rows, rows).copy_(x @ w_s.t())

    # a mixed-precision layer gathers its shards already cast: half the bytes on the ring
    all_gather_consume_core(call, weight.detach().to(compute), consume, 0, keep=False,
                                      label="sharded_linear.forward")
    if bias is not None:
        y += torch.cat(all_gather_consume_core(call, bias.detach().to(compute), collect, 0,
                                                         label="sharded_linear.bias"))
    return y


def sharded_linear_dgrad(call, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """``dx = sum_s dy[..., cols_s] @ W_s``: the weight's all-gather ring again, the sum over shards in float32
    for half inputs (``programs.sum_dtype``), rounded once."""
    rows = weight.shape[0]
    dx = sum_zeros(x)

    def consume(w_s: torch.Tensor, s: int) -> None:
        dx.add_(dy.narrow(-1, s * rows, rows) @ w_s)

    all_gather_consume_core(call, weight.detach().to(x.dtype), consume, 0, keep=False,
                                      label="sharded_linear.dgrad")
    return rounded(dx, x.dtype)


def _grad_parts(x, weight, dy, need_w: bool, need_b: bool, reduce_dtype):
    """The producers of this rank's partial of rank d's weight (and bias) gradient block, in the dtype the
    gradients travel and sum in (None for what is not wanted)."""
    rows = weight.shape[0]
    dy2 = dy.reshape(-1, dy.shape[-1])
    reduce = reduce_dtype or weight.dtype
    x2 = x.reshape(-1, x.shape[-1])
    wgrad = (lambda d: (dy2[:, d * rows : (d + 1) * rows].t() @ x2).to(reduce)) if need_w else None
    bgrad = (lambda d: dy2[:, d * rows : (d + 1) * rows].sum(0).to(reduce)) if need_b else None
    return wgrad, bgrad


def _reduce_grads(call, weight, wgrad, bgrad, reduce: str):
    """The weight (and bias) gradient shards: reduce-scatter rings (Flash-RS) over ``wgrad``/``bgrad``'s
    partials, averaged for ``reduce="avg"``, in the parameters' own dtype."""
    n = call.world_size
    dw = db = None
    if wgrad is not None:
        dw = produce_reduce_scatter_core(call, wgrad, 0, label="sharded_linear.wgrad", inplace=True)
    if bgrad is not None:
        db = produce_reduce_scatter_core(call, bgrad, 0, label="sharded_linear.bgrad", inplace=True)
    if reduce == "avg":
        dw = dw / n if dw is not None else None
        db = db / n if db is not None else None
    # the parameters' own dtype (a mixed-precision layer keeps full-precision shards)
    return (dw.to(weight.dtype) if dw is not None else None, db.to(weight.dtype) if db is not None else None)


def sharded_linear_backward(call, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, need_x: bool,
                            need_w: bool, need_b: bool, reduce: str, reduce_dtype):
    """``(dx, dW shard, db shard)`` of a synchronised backward (None for what is not wanted)."""
    dx = sharded_linear_dgrad(call, x, weight, dy) if need_x else None
    wgrad, bgrad = _grad_parts(x, weight, dy, need_w, need_b, reduce_dtype)
    dw, db = _reduce_grads(call, weight, wgrad, bgrad, reduce)
    return dx, dw, db


@atomic
def sharded_linear_fn(call, layer, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """Differentiable ``x @ W^T + b`` from this rank's shards ``weight`` (out/N, in) and ``bias`` (out/N) on a
    resolved ``call`` (:func:`all_gather_call`); ``layer`` holds the gradient options and what gradient
    accumulation without sync keeps: ``reduce``, ``reduce_dtype``, ``requires_gradient_sync``, ``_hold``,
    ``_with_held`` and ``_held`` (``commfuse.nn.ShardedLinear``)."""
    return _ShardedLinear.apply(call, layer, x, weight, bias)
