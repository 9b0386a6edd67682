"""The fused ops as ``torch.library`` custom ops: ``torch.ops.commfuse.*``, for ``torch.compile`` and graphs.

``torch.compile`` cannot trace the ring (it is Python that talks to a process
group, step by step), and should not: it sees one op, with a fake kernel for
shapes and autograd registered, exactly as it sees
``torch.ops.symm_mem.fused_all_gather_matmul``. The group travels by name
(``ProcessGroup.group_name``; ``""``: no process group, world size 1), the
algorithm as its string.

================================== ============================================================
op                                 what it computes
================================== ============================================================
all_gather_matmul                  ``(gathered or empty, [AG(a) @ b_i])`` (one gather, many GEMMs)
matmul_reduce_scatter              ``RS(a @ b)`` along ``scatter_dim``, ``reduce_op`` sum or avg
attention_reduce_scatter           query-split attention: ``RS_d(attend(q_d, k, v) @ wo^T)`` over
                                   the query slices d, each with its rows of a mask (a dense
                                   ``attn_mask`` or ``document_ids``; ``commfuse.nn.ParallelAttention``)
sharded_linear                     ``x @ AG(W_r)^T + AG(b_r)``: FSDP's gathered weight, fused
                                   (``commfuse.nn.ShardedLinear``)
``*_backward``                     their gradients, each itself a ring
================================== ============================================================

Every op runs the same planned ring as the eager API (``commfuse.ops``,
``commfuse.autograd``); the Python functions (``cf.all_gather_matmul`` and
the ``commfuse.nn`` layers) call these ops when they are being compiled and
keep their direct path in eager mode, where the dispatcher would add host
time per call for nothing. What differs under compile:

- ``all_gather_matmul`` keeps the gathered input for the weight gradient
  whenever one is wanted (``keep_gathered=False`` is eager only);
- the attention's backward recomputes each query slice's attention as its
  output gradient arrives (eager keeps the forward's graphs; a custom op
  cannot hold Python graphs from one op to the next);
- ``backend``, ``timeout``, ``check`` and ``report`` cannot be given: the
  backend is the group's, and timeout and check come from
  ``COMMFUSE_TIMEOUT_S`` and ``COMMFUSE_CHECK``.

The consume/produce forms (``all_gather_consume``, ``produce_reduce_scatter``,
``all_to_all_consume``) take Python callables and are not ops: under
``torch.compile`` they break the graph (``fullgraph=True`` refuses them).
"""

from __future__ import annotations

import torch

from commfuse.errors import CommfuseValueError
from commfuse.fused import attention as fused_attention
from commfuse.fused import sharded_linear as sharded_linear_impl
from commfuse.fused.all_gather_matmul import all_gather_matmul_backward, plan_all_gather_matmul
from commfuse.fused.once import plan_once
from commfuse.fused.matmul_reduce_scatter import matmul_reduce_scatter_backward, plan_matmul_reduce_scatter
from commfuse.planning import table
from commfuse.planning.calls import C10D_WORLD
from commfuse.planning.derive import layer_config

__all__ = [
    "CHECKPOINT_RECOMPUTE", "CHECKPOINT_SAVE", "all_gather_matmul", "attention_reduce_scatter", "group_name",
    "matmul_reduce_scatter", "replicated", "sharded_linear",
]

# -- groups by name ----------------------------------------------------------


def group_name(group) -> str:
    """The name a custom op takes for ``group`` (None: the default group; ``""`` when there is none)."""
    if group is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return ""
        from torch.distributed import distributed_c10d as c10d

        group = c10d._get_default_group()
    name = getattr(group, "group_name", None)
    if not isinstance(name, str):
        raise CommfuseValueError(
            f"under torch.compile the group must be a torch.distributed ProcessGroup (it travels by name), "
            f"got {type(group).__name__}"
        )
    return name


def _group(name: str):
    if not name:
        return None
    from torch.distributed import distributed_c10d as c10d

    return c10d._resolve_process_group(name)


def _world(name: str) -> tuple[int, int]:
    """(rank, world size) of the group called ``name``."""
    group = _group(name)
    return (0, 1) if group is None else (group.rank(), group.size())


def _refuse(op: str, **options) -> None:
    for what, value in options.items():
        if value is not None:
            raise CommfuseValueError(
                f"{op} under torch.compile: {what}={value!r} cannot be given (the compiled op takes the group by "
                "name and its backend; timeout and check come from COMMFUSE_TIMEOUT_S and COMMFUSE_CHECK, and a "
                f"report dict cannot be filled from a graph): leave {what} unset, or call the op outside "
                "torch.compile"
            )


def _empty(like: torch.Tensor) -> torch.Tensor:
    """What an op returns for an output that was not asked for (an op's outputs cannot be None)."""
    return like.new_empty(0)


def _grad_like(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A gradient as the op returns it: laid out as ``torch.empty_like(like)`` (what the fake kernels say), or
    empty when not wanted."""
    if g is None:
        return _empty(like)
    if g.stride() != torch.empty_like(like, device="meta").stride():
        g = torch.empty_like(like).copy_(g)
    return g


def _fake_grad(like: torch.Tensor, wanted: bool) -> torch.Tensor:
    return torch.empty_like(like) if wanted else _empty(like)


def _fresh(t: torch.Tensor, inputs) -> torch.Tensor:
    """``t`` contiguous (as the fake kernels say), copied if it is one of ``inputs`` (a custom op's outputs must
    not alias its inputs)."""
    if any(t is x for x in inputs):
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


# -- plans, remembered per signature -----------------------------------------
# in the planning table, beside the eager ops' entries (``commfuse.fused.all_gather_matmul``,
# ``commfuse.fused.matmul_reduce_scatter``), under keys that say "op" after the op's name and so never meet an
# eager call's key


def _agmm_run(a, bs, name, gd, algorithm, gathered_size, return_gathered):
    key = ("all_gather_matmul", "op", a.shape, a.dtype, a.device, tuple((b.shape, b.dtype, b.device) for b in bs),
           name, gd, algorithm, gathered_size, return_gathered, C10D_WORLD._default_pg)
    run = table.get(key)
    if run is None:
        group = _group(name)
        run = plan_once(key, "all_gather_matmul", group, None, plan_all_gather_matmul,
                        a, list(bs), group=group, gather_dim=gd, algorithm=algorithm, return_gathered=return_gathered,
                        gathered_size=gathered_size, keep_gathered=True)
    return run


def _mmrs_run(a, b, name, sd, algorithm, reduce_op):
    key = ("matmul_reduce_scatter", "op", a.shape, a.dtype, a.device, b.shape, b.dtype, b.device, name, sd,
           algorithm, reduce_op, C10D_WORLD._default_pg)
    run = table.get(key)
    if run is None:
        group = _group(name)
        run = plan_once(key, "matmul_reduce_scatter", group, None, plan_matmul_reduce_scatter,
                        a, b, group=group, scatter_dim=sd, reduce_op=reduce_op, algorithm=algorithm)
    return run


def _gathered_shape(a, gd: int, n: int, gathered_size):
    full = list(a.shape)
    full[gd] = gathered_size if gathered_size is not None else a.shape[gd] * n
    return full


# -- all_gather_matmul -------------------------------------------------------


@torch.library.custom_op("commfuse::all_gather_matmul", mutates_args=())
def _all_gather_matmul(a: torch.Tensor, bs: list[torch.Tensor], gather_dim: int, group_name: str, algorithm: str,
                       gathered_size: int | None, return_gathered: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    run = _agmm_run(a, bs, group_name, gather_dim, algorithm, gathered_size, return_gathered)
    with torch.no_grad():
        got = run(a, list(bs))
    gathered, outs = got if return_gathered else (None, got)
    outs = [_fresh(o, (a, *bs)) for o in outs]
    return (_fresh(gathered, (a,)) if gathered is not None else _empty(a)), outs


@_all_gather_matmul.register_fake
def _(a, bs, gather_dim, group_name, algorithm, gathered_size, return_gathered):
    _, n = _world(group_name)
    gd = gather_dim % a.ndim
    full = _gathered_shape(a, gd, n, gathered_size)
    lead = list(a.shape[:-1]) if gd == a.ndim - 1 else full[:-1]
    outs = [a.new_empty([*lead, b.shape[1]]) for b in bs]
    return (a.new_empty(full) if return_gathered else _empty(a)), outs


@torch.library.custom_op("commfuse::all_gather_matmul_backward", mutates_args=())
def _all_gather_matmul_backward(a: torch.Tensor, gathered: torch.Tensor, bs: list[torch.Tensor],
                                douts: list[torch.Tensor | None], gather_dim: int, group_name: str, algorithm: str,
                                gathered_size: int | None, need_a: bool,
                                need_b: list[bool]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    run = _agmm_run(a, bs, group_name, gather_dim, algorithm, gathered_size, True)
    if run.call is None:  # world size 1: the gathered input is the input
        da, dbs = _local_agmm_backward(gathered, bs, douts, need_a, need_b)
    else:
        da, dbs = all_gather_matmul_backward(run.call, gathered, bs, douts, run.gd, run.sizes, True, need_a, need_b,
                                             defer=False)
    return _grad_like(da, a), [_grad_like(d, b) for d, b in zip(dbs, bs)]


def _local_agmm_backward(x, bs, douts, need_a, need_b):
    da = None
    if need_a:
        for b, d in zip(bs, douts):
            if d is not None:
                t = d @ b.t()
                da = t if da is None else da.add_(t)
        if da is None:
            da = torch.zeros_like(x)
    dbs = [(x.reshape(-1, x.shape[-1]).t() @ d.reshape(-1, d.shape[-1])) if need and d is not None
           else (torch.zeros_like(b) if need else None) for b, d, need in zip(bs, douts, need_b)]
    return da, dbs


@_all_gather_matmul_backward.register_fake
def _(a, gathered, bs, douts, gather_dim, group_name, algorithm, gathered_size, need_a, need_b):
    return _fake_grad(a, need_a), [_fake_grad(b, need) for b, need in zip(bs, need_b)]


def _agmm_setup(ctx, inputs, output):
    a, bs, gather_dim, group_name, algorithm, gathered_size, return_gathered = inputs
    if not return_gathered:
        raise CommfuseValueError("internal: the compiled all_gather_matmul keeps its gathered input when a "
                                 "gradient is wanted")
    ctx.save_for_backward(a, output[0], *bs)
    ctx.options = (gather_dim, group_name, algorithm, gathered_size)


def _agmm_backward(ctx, _dgathered, douts):
    # detached, as the blocks' backwards (commfuse.fused) take them: torch.matmul folds a 3-D input by whether
    # the weight wants a gradient, and the saved tensors of a recomputed region do not
    a, gathered, *bs = (t.detach() for t in ctx.saved_tensors)
    gather_dim, group_name, algorithm, gathered_size = ctx.options
    need_a, need_b = ctx.needs_input_grad[0], list(ctx.needs_input_grad[1])  # a list input: one flag per tensor
    da, dbs = torch.ops.commfuse.all_gather_matmul_backward(a, gathered, bs, list(douts), gather_dim, group_name,
                                                            algorithm, gathered_size, need_a, need_b)
    return (da if need_a else None), [d if need else None for d, need in zip(dbs, need_b)], None, None, None, \
        None, None


_all_gather_matmul.register_autograd(_agmm_backward, setup_context=_agmm_setup)


def all_gather_matmul(a_shard, b, *, group=None, gather_dim: int = 0, algorithm: str = "auto",
                      return_gathered: bool = False, gathered_size: int | None = None, keep_gathered: bool = True,
                      timeout=None, check=None, backend=None, report=None):
    """:func:`commfuse.all_gather_matmul` through ``torch.ops.commfuse.all_gather_matmul`` (what it calls while
    being compiled)."""
    _refuse("all_gather_matmul", timeout=timeout, check=check, backend=backend, report=report)
    single = isinstance(b, torch.Tensor)
    bs = [b] if single else list(b)
    grad = torch.is_grad_enabled() and (a_shard.requires_grad or any(x.requires_grad for x in bs))
    if grad and gather_dim % a_shard.ndim == a_shard.ndim - 1:
        raise CommfuseValueError(
            "all_gather_matmul has no backward when gather_dim is the contraction (last) dim; gather another dim "
            "or run it under torch.no_grad()"
        )
    gathered, outs = torch.ops.commfuse.all_gather_matmul(a_shard, bs, gather_dim, group_name(group), algorithm,
                                                          gathered_size, return_gathered or grad)
    results = outs[0] if single else list(outs)
    return (gathered.detach(), results) if return_gathered else results


# -- matmul_reduce_scatter ---------------------------------------------------


@torch.library.custom_op("commfuse::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, scatter_dim: int, group_name: str, algorithm: str,
                           reduce_op: str) -> torch.Tensor:
    run = _mmrs_run(a, b, group_name, scatter_dim, algorithm, reduce_op)
    with torch.no_grad():
        return _fresh(run(a, b), (a, b))


@_matmul_reduce_scatter.register_fake
def _(a, b, scatter_dim, group_name, algorithm, reduce_op):
    rank, n = _world(group_name)
    shape = [*a.shape[:-1], b.shape[1]]
    sd = scatter_dim % len(shape)
    shape[sd] = (shape[sd] + n - 1 - rank) // n  # tensor_split's piece for this rank (works on SymInts)
    return a.new_empty(shape)


@torch.library.custom_op("commfuse::matmul_reduce_scatter_backward", mutates_args=())
def _matmul_reduce_scatter_backward(a: torch.Tensor, b: torch.Tensor, dz: torch.Tensor, scatter_dim: int,
                                    group_name: str, algorithm: str, reduce_op: str, need_a: bool,
                                    need_b: bool) -> tuple[torch.Tensor, torch.Tensor]:
    run = _mmrs_run(a, b, group_name, scatter_dim, algorithm, reduce_op)
    if run.call is None:
        da = dz @ b.t() if need_a else None
        db = a.reshape(-1, a.shape[-1]).t() @ dz.reshape(-1, dz.shape[-1]) if need_b else None
    else:
        sd = scatter_dim % (a.ndim)
        da, db = matmul_reduce_scatter_backward(run.call, a, b, dz, sd, reduce_op == "avg", need_a, need_b,
                                               defer=False)
    return _grad_like(da, a), _grad_like(db, b)


@_matmul_reduce_scatter_backward.register_fake
def _(a, b, dz, scatter_dim, group_name, algorithm, reduce_op, need_a, need_b):
    return _fake_grad(a, need_a), _fake_grad(b, need_b)


def _mmrs_setup(ctx, inputs, output):
    a, b, scatter_dim, group_name, algorithm, reduce_op = inputs
    ctx.save_for_backward(a, b)
    ctx.options = (scatter_dim, group_name, algorithm, reduce_op)


def _mmrs_backward(ctx, dz):
    a, b = (t.detach() for t in ctx.saved_tensors)  # as the blocks' backwards take them
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    da, db = torch.ops.commfuse.matmul_reduce_scatter_backward(a, b, dz, *ctx.options, need_a, need_b)
    return (da if need_a else None), (db if need_b else None), None, None, None, None


_matmul_reduce_scatter.register_autograd(_mmrs_backward, setup_context=_mmrs_setup)


def matmul_reduce_scatter(a, b, *, group=None, scatter_dim: int = 0, reduce_op: str = "sum",
                          algorithm: str = "auto", timeout=None, check=None, backend=None, report=None):
    """:func:`commfuse.matmul_reduce_scatter` through ``torch.ops.commfuse.matmul_reduce_scatter``."""
    _refuse("matmul_reduce_scatter", timeout=timeout, check=check, backend=backend, report=report)
    if (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
            and scatter_dim % a.ndim == a.ndim - 1):
        raise CommfuseValueError(
            "matmul_reduce_scatter has no backward when scatter_dim is the last (output feature) dim; scatter "
            "another dim or run it under torch.no_grad()"
        )
    return torch.ops.commfuse.matmul_reduce_scatter(a, b, scatter_dim, group_name(group), algorithm, reduce_op)


# -- attention_reduce_scatter (commfuse.nn.ParallelAttention, commfuse.tp.AttentionParallel) -----------------


def _attention_call(q, wo, name, algorithm, n):
    """The reduce-scatter call of the query-split attention: ``auto`` decided on one partial's bytes
    (``fused.attention.partial_bytes``, which every rank knows, as ``ParallelAttention`` decides in eager
    mode)."""
    return fused_attention.reduce_scatter_call(algorithm, batch=q.shape[0], rows=q.shape[1] // n,
                                               hidden=wo.shape[0], dtype=q.dtype, group=_group(name),
                                               device=q.device)


def _attention_config(q, k, causal, attn_mask, document_ids, scale, softcap=None, window=None) -> tuple:
    """What joins the ring's fingerprint: the mask (its kind), the heads, the scores' scale, cap and window,
    which the partials' shape does not show."""
    kind = "dense" if attn_mask is not None else "documents" if document_ids is not None else "none"
    return layer_config("attention_reduce_scatter", causal=bool(causal), heads=q.shape[2], kv_heads=k.shape[2],
                        head_dim=q.shape[3], mask=kind, scale=0.0 if scale is None else float(scale),
                        softcap=0.0 if softcap is None else float(softcap), window=0 if window is None else int(window))


def _check_attention(q, k, v, wo, n: int, attn_mask=None, document_ids=None) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise CommfuseValueError(f"attention_reduce_scatter takes q, k, v as (batch, seq, heads, head_dim), got "
                                 f"shapes {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if q.shape[1] % n:
        raise CommfuseValueError(f"attention_reduce_scatter: the sequence length {q.shape[1]} does not divide by the "
                                 f"group size {n}")
    if wo.ndim != 2 or wo.shape[1] != q.shape[2] * q.shape[3]:
        raise CommfuseValueError(f"attention_reduce_scatter: wo must be (hidden, heads * head_dim) = (.., "
                                 f"{q.shape[2] * q.shape[3]}), got {list(wo.shape)}")
    if attn_mask is not None and document_ids is not None:
        raise CommfuseValueError("attention_reduce_scatter: give attn_mask or document_ids, not both")
    b, s = q.shape[0], q.shape[1]
    if attn_mask is not None and (attn_mask.ndim != 4 or attn_mask.shape[0] not in (1, b)
                                  or attn_mask.shape[1] not in (1, q.shape[2]) or attn_mask.shape[2] not in (1, s)
                                  or attn_mask.shape[3] not in (1, s)):
        raise CommfuseValueError(f"attention_reduce_scatter: attn_mask must be 4-D and broadcast to (batch {b}, "
                                 f"this rank's heads {q.shape[2]}, {s}, {s}), got {list(attn_mask.shape)}")
    if document_ids is not None and (document_ids.ndim != 2 or document_ids.shape[0] not in (1, b)
                                     or document_ids.shape[1] != s):
        raise CommfuseValueError(f"attention_reduce_scatter: document_ids must be ({b} or 1, {s}), got "
                                 f"{list(document_ids.shape)}")


@torch.library.custom_op("commfuse::attention_reduce_scatter", mutates_args=())
def _attention_reduce_scatter(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wo: torch.Tensor, causal: bool,
                              group_name: str, algorithm: str, attn_mask: torch.Tensor | None = None,
                              document_ids: torch.Tensor | None = None, scale: float | None = None,
                              softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    _, n = _world(group_name)
    _check_attention(q, k, v, wo, n, attn_mask, document_ids)
    call = _attention_call(q, wo, group_name, algorithm, n)
    with torch.no_grad():
        return fused_attention.attention_reduce_scatter(
            call, q, k, v, wo, causal=causal, mask=fused_attention.mask_of(attn_mask, document_ids),
            config=_attention_config(q, k, causal, attn_mask, document_ids, scale, softcap, window), scale=scale,
            softcap=softcap, window=window).contiguous()


@_attention_reduce_scatter.register_fake
def _(q, k, v, wo, causal, group_name, algorithm, attn_mask=None, document_ids=None, scale=None, softcap=None,
      window=None):
    _, n = _world(group_name)
    return q.new_empty(q.shape[0], q.shape[1] // n, wo.shape[0])


@torch.library.custom_op("commfuse::attention_reduce_scatter_backward", mutates_args=())
def _attention_reduce_scatter_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wo: torch.Tensor,
                                       dout: torch.Tensor, causal: bool, group_name: str, algorithm: str,
                                       attn_mask: torch.Tensor | None = None,
                                       document_ids: torch.Tensor | None = None,
                                       scale: float | None = None, softcap: float | None = None,
                                       window: int | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                          torch.Tensor, torch.Tensor]:
    # each query slice's attention again, as its output gradient arrives (a custom op cannot keep the
    # forward's graphs)
    _, n = _world(group_name)
    grads = fused_attention.attention_reduce_scatter_backward(
        _attention_call(q, wo, group_name, algorithm, n), q, k, v, wo, dout, causal=causal,
        mask=fused_attention.mask_of(attn_mask, document_ids),
        config=_attention_config(q, k, causal, attn_mask, document_ids, scale, softcap, window), scale=scale,
        softcap=softcap, window=window)
    return tuple(_grad_like(g, t) for g, t in zip(grads, (q, k, v, wo)))


@_attention_reduce_scatter_backward.register_fake
def _(q, k, v, wo, dout, causal, group_name, algorithm, attn_mask=None, document_ids=None, scale=None, softcap=None,
      window=None):
    return tuple(torch.empty_like(t) for t in (q, k, v, wo))


def _attention_setup(ctx, inputs, output):
    q, k, v, wo, causal, group_name, algorithm, attn_mask, document_ids, scale, softcap, window = inputs
    ctx.save_for_backward(q, k, v, wo, attn_mask, document_ids)
    ctx.options = (causal, group_name, algorithm)
    ctx.scores = (scale, softcap, window)


def _attention_backward(ctx, dout):
    q, k, v, wo, attn_mask, document_ids = ctx.saved_tensors
    grads = torch.ops.commfuse.attention_reduce_scatter_backward(q, k, v, wo, dout, *ctx.options, attn_mask,
                                                                 document_ids, *ctx.scores)
    # the masks, the scale, the cap and the window are constants: no gradient (commfuse.fused.attention.
    # resolve_mask refuses a mask that wants one)
    return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:4])), None, None, None, None, None,
            None, None, None)


_attention_reduce_scatter.register_autograd(_attention_backward, setup_context=_attention_setup)


def attention_reduce_scatter(q, k, v, wo, *, causal: bool, group=None, algorithm: str = "auto",
                             mask=None, scale: float | None = None, softcap: float | None = None,
                             window: int | None = None) -> torch.Tensor:
    """Query-split attention fused with the out-projection's reduce-scatter, as one op: q (b, s, Hq, d), k and
    v (b, s, Hkv, d) for this rank's heads, ``wo`` (hidden, Hq * d) this rank's columns of the out-projection;
    returns (b, s / N, hidden), this rank's rows of the summed output. ``mask``: a resolved
    ``commfuse.fused.attention.AttentionMask`` or None; it travels as a dense ``attn_mask`` (a BlockMask
    evaluated for the whole sequence: an op takes no callables) or as ``document_ids``. ``scale``: the scores'
    factor (None: ``1 / sqrt(head_dim)``); ``softcap`` and ``window`` as ``commfuse.fused.attention.attend``
    takes them."""
    attn_mask = document_ids = None
    if mask is not None:
        mask = mask.whole(q.shape[1])
        if mask.kind == "documents":
            document_ids = mask.tensor
        else:
            attn_mask = mask.tensor
    return torch.ops.commfuse.attention_reduce_scatter(q, k, v, wo, causal, group_name(group), algorithm, attn_mask,
                                                       document_ids, scale, softcap, window)


# -- sharded_linear (commfuse.nn.ShardedLinear) --------------------------------------------------------------


def _sharded_call(x, weight, name, algorithm):
    return sharded_linear_impl.all_gather_call(algorithm, weight, x.dtype, group=_group(name), device=x.device)


@torch.library.custom_op("commfuse::sharded_linear", mutates_args=())
def _sharded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str,
                    algorithm: str, reduce: str, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    # reduce ("avg" or "sum") and reduce_dtype are the backward's: the weight gradient's reduction
    call = _sharded_call(x, weight, group_name, algorithm)
    with torch.no_grad():
        if call is None:
            y = torch.nn.functional.linear(x, weight.to(x.dtype), bias.to(x.dtype) if bias is not None else None)
        else:
            y = sharded_linear_impl.sharded_linear_forward(call, x, weight, bias)
        return y.contiguous()


@_sharded_linear.register_fake
def _(x, weight, bias, group_name, algorithm, reduce, reduce_dtype):
    _, n = _world(group_name)
    return x.new_empty(*x.shape[:-1], weight.shape[0] * n)


@torch.library.custom_op("commfuse::sharded_linear_backward", mutates_args=())
def _sharded_linear_backward(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, group_name: str,
                             algorithm: str, reduce: str, reduce_dtype: torch.dtype | None, need_x: bool,
                             need_w: bool, need_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = _sharded_call(x, weight, group_name, algorithm)
    if call is None:
        w = weight.to(x.dtype)
        dx = dy @ w if need_x else None
        dw = (dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype) if need_w else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0).to(weight.dtype) if need_b else None
    else:
        dx, dw, db = sharded_linear_impl.sharded_linear_backward(call, x, weight, dy, need_x, need_w, need_b, reduce,
                                                                 reduce_dtype)
    return _grad_like(dx, x), _grad_like(dw, weight), (db.contiguous() if db is not None else _empty(weight))


@_sharded_linear_backward.register_fake
def _(x, weight, dy, group_name, algorithm, reduce, reduce_dtype, need_x, need_w, need_b):
    return _fake_grad(x, need_x), _fake_grad(weight, need_w), weight.new_empty(weight.shape[0] if need_b else 0)


def _sharded_setup(ctx, inputs, output):
    x, weight, bias, group_name, algorithm, reduce, reduce_dtype = inputs
    ctx.save_for_backward(x, weight)
    ctx.options = (group_name, algorithm, reduce, reduce_dtype)
    ctx.has_bias = bias is not None


def _sharded_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = ctx.has_bias and ctx.needs_input_grad[2]
    dx, dw, db = torch.ops.commfuse.sharded_linear_backward(x, weight, dy, *ctx.options, need_x, need_w, need_b)
    return (dx if need_x else None), (dw if need_w else None), (db if need_b else None), None, None, None, None


_sharded_linear.register_autograd(_sharded_backward, setup_context=_sharded_setup)


def sharded_linear(x, weight, bias, *, group=None, algorithm: str = "auto", reduce: str = "avg",
                   reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W^T + b`` from this rank's row shards ``weight`` (out/N, in) and ``bias`` (out/N), as one op: the
    weights' all-gather ring fused with the forward and dgrad GEMMs, the gradients' reduce-scatter (averaged
    for ``reduce="avg"``, summed in ``reduce_dtype``) fused with the weight-gradient GEMMs."""
    return torch.ops.commfuse.sharded_linear(x, weight, bias, group_name(group), algorithm, reduce, reduce_dtype)


# -- replicated (a replicated parameter's gradient, summed over the group) ----------------------------------


@torch.library.custom_op("commfuse::replicated", mutates_args=())
def _replicated(t: torch.Tensor, group_name: str) -> torch.Tensor:
    # an op's output must not alias its input; the tensors this serves are biases
    return t.clone(memory_format=torch.contiguous_format)


@_replicated.register_fake
def _(t, group_name):
    return t.new_empty(t.shape)


def _replicated_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


def _replicated_backward(ctx, g):
    return torch.ops.commfuse.replicated_grad(g.contiguous(), ctx.group_name), None


@torch.library.custom_op("commfuse::replicated_grad", mutates_args=())
def _replicated_grad(g: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``g`` over the group through commfuse (numbered with the group's other calls, bounded by
    its timeout, told to every rank), as the eager ``ReplicatedGrad`` sums it; not torch's functional
    all-reduce, which only the process group's own timeout bounds."""
    from commfuse.planning.all_reduce import group_sum

    with torch.no_grad():
        return group_sum(g, _group(group_name), label="replicated_grad")


@_replicated_grad.register_fake
def _(g, group_name):
    return g.new_empty(g.shape)


_replicated.register_autograd(_replicated_backward, setup_context=_replicated_setup)


def replicated(t: torch.Tensor, group) -> torch.Tensor:
    """``commfuse.nn._common.replicated`` as an op: identity forward, the gradient summed over ``group``."""
    return torch.ops.commfuse.replicated(t, group_name(group))


# -- activation checkpointing ----------------------------------------------------------------------------------
# What a selective checkpointing policy (torch.utils.checkpoint.create_selective_checkpoint_contexts, torchtitan's
# per-op save list) should do with each forward op. The policy sees these ops when the region is compiled, and in
# eager too for the calls that can run as the op (commfuse.ops' all_gather_matmul and matmul_reduce_scatter
# without timeout, check, backend or report; the tp styles, ParallelAttention and ShardedLinear): every other
# commfuse call is one op the policy does not see, run whole again in the recompute (commfuse.runtime.checkpointing).

#: Save these: each output is this rank's shard of a reduce-scatter (1/N of the sequence), and a recompute would
#: run the GEMMs (every query slice's attention) and the whole ring again; torchtitan saves
#: ``_c10d_functional.reduce_scatter_tensor`` for the same reason. Their backwards do not need them recomputed.
CHECKPOINT_SAVE = (
    torch.ops.commfuse.matmul_reduce_scatter.default,
    torch.ops.commfuse.attention_reduce_scatter.default,
)

#: Recompute these unless memory allows: ``all_gather_matmul``'s outputs span the whole sequence (and, with a
#: gradient, it keeps the gathered input as well), the largest activations of a tensor-parallel block, made
#: again by one ring; ``sharded_linear`` gathers the weights again, as its backward does anyway; ``replicated``
#: is a copy. Saving ``all_gather_matmul`` trades that memory for its ring, as torchtitan's policy saves every
#: second matmul.
CHECKPOINT_RECOMPUTE = (
    torch.ops.commfuse.all_gather_matmul.default,
    torch.ops.commfuse.sharded_linear.default,
    torch.ops.commfuse.replicated.default,
)


# -- autocast ------------------------------------------------------------------------------------------------
# Under torch.autocast a custom op is not cast by itself (its autocast key falls through): these rules cast its
# floating-point inputs (but float64) to the autocast dtype, as the eager ops cast theirs
# (``commfuse.ops.autocast_dtype``), then run it with autocast off. torch.library.register_autocast takes one
# fixed dtype per device type; these read the dtype the autocast region asks for (bfloat16 or float16) at each
# call. CPU is tested; CUDA, XPU and PrivateUse1 (Ascend's NPU) are registered the same way, unverified.

_AUTOCAST_KEYS = ("AutocastCPU", "AutocastCUDA", "AutocastXPU", "AutocastPrivateUse1")
_autocast_lib = torch.library.Library("commfuse", "IMPL")  # kept: the registrations live as long as it does


def _cast(t, device_type: str, dtype: torch.dtype):
    if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.dtype != dtype
            and t.device.type == device_type):
        return t.to(dtype)
    return t


def _autocast_rule(name: str, cast: tuple[int, ...]) -> None:
    """Cast the arguments at positions ``cast`` (a tensor or a list of tensors each) of ``commfuse::name``."""
    op = getattr(torch.ops.commfuse, name).default

    def kernel(_keyset, *args):
        device_type = args[0].device.type
        dtype = torch.get_autocast_dtype(device_type)
        args = list(args)
        for i in cast:
            if i >= len(args):
                continue
            got = args[i]
            args[i] = [_cast(t, device_type, dtype) for t in got] if isinstance(got, (list, tuple)) else \
                _cast(got, device_type, dtype)
        with torch.autocast(device_type, enabled=False):
            return op(*args)

    for key in _AUTOCAST_KEYS:
        _autocast_lib.impl(name, kernel, key, with_keyset=True)


_autocast_rule("all_gather_matmul", (0, 1))  # a, bs
_autocast_rule("matmul_reduce_scatter", (0, 1))  # a, b
_autocast_rule("attention_reduce_scatter", (0, 1, 2, 3, 7))  # q, k, v, wo, an additive attn_mask (a bool one stays)
# x only: the op gathers its weight shards cast to x's dtype and reduces their gradients in reduce_dtype (else the
# parameters' dtype), as FSDP2 does under autocast
_autocast_rule("sharded_linear", (0,))
