"""The fused ops on JAX arrays, walked on a mesh axis (:mod:`commfuse_jax.lowering`), with their backward.

Each op here takes and returns ``jax.Array`` values inside ``shard_map`` and
means what the commfuse op of the same name means (``commfuse.ops``), with the
rank being the device's index on the axis. The matmul ops carry commfuse's own
backward as a ``jax.custom_vjp``: the input gradient of an all-gather + matmul
is a matmul + reduce-scatter walked on the same axis with the same algorithm,
and the other way round, and each weight gradient is computed per arriving
slice (or from the gathered input the forward kept). The consume and produce
forms and ring attention are differentiated by JAX through the walk: the
transpose of a ``ppermute`` is the ``ppermute`` back.

================================ ==================================================================
op                               shapes (on every device; N the axis size)
================================ ==================================================================
all_gather_matmul                a (..., L, ..., K) sharded at ``gather_dim``; b (K, M) -> (..., N*L, ..., M)
matmul_reduce_scatter            a (..., S, ..., K); b (K, M) -> (..., S/N, ..., M) at ``scatter_dim``
all_gather_consume               consumer(shard of rank s, s) for every s; results in rank order
produce_reduce_scatter           sum over devices of producer(this device's rank)
all_to_all_consume               blocks[d] to rank d; consumer(block from s, s); results in rank order
ring_attention                   q (b, L, Hq, d), k and v (b, L, Hkv, d), sequence sharded -> (b, L, Hq, d)
================================ ==================================================================
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from commfuse.errors import CommfuseValueError
from commfuse.schedule import Collective

from commfuse_jax.lowering import Axis, gather_walk, pieces_of, scatter_walk, schedule_for, swap_walk, unrotate

__all__ = ["all_gather_consume", "all_gather_matmul", "all_to_all_consume", "matmul_reduce_scatter",
           "produce_reduce_scatter", "ring_attention"]


def _varying(x, axis_name):
    """``x`` typed as varying over the axis (``lax.pcast``): a replicated weight enters a custom_vjp as varying,
    so its per-device gradient is summed over the axis by JAX's transpose of the cast (as for any op)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    kind = jax.typeof(x)
    varying = getattr(getattr(kind, "manual_axis_type", None), "varying", None)  # jax 0.10
    if varying is None:
        varying = getattr(kind, "vma", frozenset())  # older spelling
    missing = tuple(n for n in names if n not in varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def _rows(x, start, length: int, dim: int):
    return lax.dynamic_slice_in_dim(x, start, length, axis=dim)


def _put(out, value, start, dim: int):
    return lax.dynamic_update_slice_in_dim(out, value.astype(out.dtype), start, axis=dim)


def _wgrad(x, g):
    """``x^T @ g`` over every dim but the last: a weight gradient (K, M)."""
    lead = tuple(range(x.ndim - 1))
    return jnp.tensordot(x, g, axes=(lead, lead))


def _offsets(schedule, length: int) -> list[int]:
    return [start for start, _ in pieces_of(length, schedule.pieces)]


# -- all_gather_matmul -------------------------------------------------------------------------------------------


def _agmm_forward(axis_name, algorithm, gd, keep, a, bs):
    axis = Axis(axis_name)
    schedule = schedule_for(Collective.ALL_GATHER, algorithm, axis)
    n, length = axis.size, a.shape[gd]
    starts = _offsets(schedule, length)
    gathered_shape = a.shape[:gd] + (n * length,) + a.shape[gd + 1:]
    outs = [jnp.zeros(gathered_shape[:-1] + (b.shape[1],), a.dtype) for b in bs]
    gathered = [jnp.zeros(gathered_shape, a.dtype) if keep else None]

    def consume(x, rank, piece):
        start = rank * length + starts[schedule.piece(x)]
        for i, b in enumerate(bs):
            outs[i] = _put(outs[i], jnp.matmul(piece, b), start, gd)
        if keep:
            gathered[0] = _put(gathered[0], piece, start, gd)

    gather_walk(schedule, axis, a, gd, consume)
    return outs, gathered[0]


def _mmrs_dgrad(axis_name, algorithm, sd, dz_like_a, gs, bs):
    """``RS(sum_i g_i @ b_i^T)`` along ``sd``: the input gradient of an all-gather + matmul."""
    axis = Axis(axis_name)
    schedule = schedule_for(Collective.REDUCE_SCATTER, algorithm, axis)
    length = dz_like_a.shape[sd]
    spans = pieces_of(length, schedule.pieces)

    def produce(x, rank):
        start, size = spans[schedule.piece(x)]
        total = None
        for g, b in zip(gs, bs):
            part = jnp.matmul(_rows(g, rank * length + start, size, sd), b.T)
            total = part if total is None else total + part
        return total

    return scatter_walk(schedule, axis, sd, produce).astype(dz_like_a.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _all_gather_matmul(axis_name, algorithm, gd, keep, a, bs):
    outs, gathered = _agmm_forward(axis_name, algorithm, gd, False, a, bs)
    return outs


def _agmm_fwd(axis_name, algorithm, gd, keep, a, bs):
    outs, gathered = _agmm_forward(axis_name, algorithm, gd, keep, a, bs)
    return outs, (a, bs, gathered)


def _agmm_bwd(axis_name, algorithm, gd, keep, saved, gs):
    a, bs, gathered = saved
    da = _mmrs_dgrad(axis_name, algorithm, gd, a, gs, bs)
    if gathered is not None:
        dbs = [_wgrad(gathered, g).astype(b.dtype) for g, b in zip(gs, bs)]
    else:  # gather a again, each arriving slice's weight gradient computed while the next travels
        axis = Axis(axis_name)
        schedule = schedule_for(Collective.ALL_GATHER, algorithm, axis)
        length = a.shape[gd]
        spans = pieces_of(length, schedule.pieces)
        acc = [jnp.zeros((b.shape[0], b.shape[1]), jnp.float32) for b in bs]

        def consume(x, rank, piece):
            start, size = spans[schedule.piece(x)]
            for i, g in enumerate(gs):
                acc[i] = acc[i] + _wgrad(piece, _rows(g, rank * length + start, size, gd)).astype(jnp.float32)

        gather_walk(schedule, axis, a, gd, consume)
        dbs = [d.astype(b.dtype) for d, b in zip(acc, bs)]
    return da, dbs


_all_gather_matmul.defvjp(_agmm_fwd, _agmm_bwd)


def all_gather_matmul(a, bs, *, axis_name, algorithm: str = "auto", gather_dim: int = 0,
                      return_gathered: bool = False, keep_gathered: bool = True):
    """``[all_gather(a, gather_dim) @ b for b in bs]`` (and the gathered ``a``, carrying no gradient, when
    ``return_gathered``), the gather walked on ``axis_name`` with ``algorithm``."""
    Axis(axis_name)  # an axis that is not bound is named before anything is traced on it
    gd = gather_dim % a.ndim
    if gd == a.ndim - 1:
        raise CommfuseValueError(
            f"jax backend: all_gather_matmul gathers dim {gather_dim}, the contraction (last) dim of a "
            f"{list(a.shape)}; gather a dim other than the last"
        )
    outs = _all_gather_matmul(axis_name, algorithm, gd, bool(keep_gathered), _varying(a, axis_name),
                              [_varying(b, axis_name) for b in bs])
    if not return_gathered:
        return None, outs
    axis = Axis(axis_name)
    gathered = lax.all_gather(lax.stop_gradient(a), axis.name, axis=gd, tiled=True) if axis.size > 1 else a
    return gathered, outs


# -- matmul_reduce_scatter ---------------------------------------------------------------------------------------


def _mmrs_forward(axis_name, algorithm, sd, a, b):
    axis = Axis(axis_name)
    schedule = schedule_for(Collective.REDUCE_SCATTER, algorithm, axis)
    out_dims = a.ndim  # a @ b keeps a's rank
    total = (a.shape[:-1] + (b.shape[1],))[sd]
    length = total // axis.size
    spans = pieces_of(length, schedule.pieces)
    last = sd == out_dims - 1

    def produce(x, rank):
        start, size = spans[schedule.piece(x)]
        if last:
            return jnp.matmul(a, _rows(b, rank * length + start, size, 1))
        return jnp.matmul(_rows(a, rank * length + start, size, sd), b)

    return scatter_walk(schedule, axis, sd, produce)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _matmul_reduce_scatter(axis_name, algorithm, sd, a, b):
    return _mmrs_forward(axis_name, algorithm, sd, a, b)


def _mmrs_fwd(axis_name, algorithm, sd, a, b):
    return _mmrs_forward(axis_name, algorithm, sd, a, b), (a, b)


def _mmrs_bwd(axis_name, algorithm, sd, saved, dz):
    """The gradient of a reduce-scatter of ``a @ b``: ``dz`` gathered in a ring, each arriving slice giving
    its rows of ``da`` and its share of ``db`` while the next one travels."""
    a, b = saved
    if sd == a.ndim - 1:
        raise CommfuseValueError(
            "jax backend: matmul_reduce_scatter has no backward when scatter_dim is the last (output feature) "
            "dim; scatter another dim"
        )
    axis = Axis(axis_name)
    schedule = schedule_for(Collective.ALL_GATHER, algorithm, axis)
    length = dz.shape[sd]
    starts = _offsets(schedule, length)
    da = [jnp.zeros(a.shape, a.dtype)]
    db = [jnp.zeros(b.shape, jnp.float32)]

    def consume(x, rank, piece):
        start = rank * length + starts[schedule.piece(x)]
        da[0] = _put(da[0], jnp.matmul(piece, b.T), start, sd)
        db[0] = db[0] + _wgrad(_rows(a, start, piece.shape[sd], sd), piece).astype(jnp.float32)

    gather_walk(schedule, axis, dz, sd, consume)
    return da[0], db[0].astype(b.dtype)


_matmul_reduce_scatter.defvjp(_mmrs_fwd, _mmrs_bwd)


def matmul_reduce_scatter(a, b, *, axis_name, algorithm: str = "auto", scatter_dim: int = 0,
                          reduce_op: str = "sum"):
    """``reduce_scatter(a @ b, scatter_dim)`` (``reduce_op`` sum or avg), walked on ``axis_name``."""
    if reduce_op not in ("sum", "avg"):
        raise CommfuseValueError(f"reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    out_shape = a.shape[:-1] + (b.shape[1],)
    sd = scatter_dim % len(out_shape)
    n = Axis(axis_name).size
    if out_shape[sd] % n:
        raise CommfuseValueError(
            f"jax backend: matmul_reduce_scatter scatters dim {sd} of size {out_shape[sd]} over {n} devices of "
            f"axis {axis_name!r}; one program on every device moves one shape, so the size must divide by {n}"
        )
    out = _matmul_reduce_scatter(axis_name, algorithm, sd, _varying(a, axis_name), _varying(b, axis_name))
    return out / n if reduce_op == "avg" else out


# -- the consume and produce forms -------------------------------------------------------------------------------


def all_gather_consume(shard, consumer, *, axis_name, algorithm: str = "auto", dim: int = 0) -> list:
    """``[consumer(shard of rank s, s) for s in ranks]``, each shard consumed while the next travels; ``s`` is
    traced. A shard cut into slices (``ring:m``, ``bidirectional``) is consumed once its last slice is here."""
    axis = Axis(axis_name)
    schedule = schedule_for(Collective.ALL_GATHER, algorithm, axis)
    results: dict[int, object] = {}
    gather_walk(schedule, axis, shard, dim, _consumed_whole(schedule, dim, consumer, results, lambda x: x.shard))
    return unrotate([results[o] for o in range(axis.size)], axis)


def _consumed_whole(schedule, dim: int, consumer, results: dict, origin):
    """A walk's ``consume(x, rank, piece)``: the pieces of each chunk kept until its last is here, then the whole
    chunk handed to ``consumer(whole, rank)``, its result put in ``results`` under ``origin(x)`` (the rank the
    chunk came from)."""
    got: dict[int, dict[int, object]] = {}

    def consume(x, rank, piece):
        slices = got.setdefault(origin(x), {})
        slices[schedule.piece(x)] = piece
        if len(slices) == schedule.pieces:
            whole = jnp.concatenate([slices[i] for i in range(schedule.pieces)], axis=dim) \
                if schedule.pieces > 1 else slices[0]
            results[origin(x)] = consumer(whole, rank)

    return consume


def produce_reduce_scatter(producer, *, axis_name, algorithm: str = "auto", dim: int = 0):
    """The sum over devices of ``producer(rank)``: ``producer(d)`` is this device's partial of rank d's output
    shard (``d`` traced), called once per destination in the ring's order, own shard last."""
    axis = Axis(axis_name)
    schedule = schedule_for(Collective.REDUCE_SCATTER, algorithm, axis)
    made: dict[int, list] = {}

    def produce(x, rank):
        pieces = made.get(x.shard)
        if pieces is None:
            partial_ = producer(rank)
            spans = pieces_of(partial_.shape[dim], schedule.pieces)
            pieces = made[x.shard] = [lax.slice_in_dim(partial_, s, s + n, axis=dim) for s, n in spans]
        return pieces[schedule.piece(x)]

    return scatter_walk(schedule, axis, dim, produce)


def all_to_all_consume(chunks, consumer, *, axis_name, algorithm: str = "auto", dim: int = 0) -> list:
    """``chunks[d]`` to rank d, and ``[consumer(chunk from s, s) for s in ranks]``; every chunk has one shape."""
    axis = Axis(axis_name)
    chunks = list(chunks)
    if len(chunks) != axis.size:
        raise CommfuseValueError(
            f"jax backend: all_to_all_consume got {len(chunks)} chunks for the {axis.size} devices of axis "
            f"{axis.name!r}; give one per device"
        )
    shapes = {(tuple(c.shape), c.dtype) for c in chunks}
    if len(shapes) != 1:
        raise CommfuseValueError(
            f"jax backend: all_to_all_consume's chunks differ ({[list(c.shape) for c in chunks]}); one program on "
            "every device moves one shape: pad every chunk to the largest"
        )
    schedule = schedule_for(Collective.ALL_TO_ALL, algorithm, axis)
    results: dict[int, object] = {}
    swap_walk(schedule, axis, chunks, dim, _consumed_whole(schedule, dim, consumer, results, lambda x: x.source))
    return unrotate([results[o] for o in range(axis.size)], axis)


# -- ring attention ----------------------------------------------------------------------------------------------


def _positions(rank, length: int, n: int, layout: str):
    """The sequence positions of rank ``rank``'s ``length`` rows (traced rank), as ``commfuse.context`` lays
    them out: contiguous (block r) or zigzag (chunks r and 2N-1-r of 2N)."""
    i = jnp.arange(length)
    if layout == "contiguous":
        return rank * length + i
    half = length // 2
    return jnp.where(i < half, rank * half + i, (2 * n - 1 - rank) * half + (i - half))


def ring_attention(q, k, v, *, axis_name, causal: bool = True, scale: float | None = None,
                   layout: str = "contiguous", algorithm: str = "auto"):
    """Softmax attention of this device's queries over the whole sequence, K/V walked around the axis and each
    arriving slice merged in float32 by a running max and sum (the log-sum-exp merge)."""
    if layout not in ("contiguous", "zigzag"):
        raise CommfuseValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")
    batch, length, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[1] != length or k.shape[3] != d:
        raise CommfuseValueError(
            f"ring_attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: k and v must be "
            f"(batch, L, Hkv, d) with q's batch {batch}, L {length} and d {d}"
        )
    hkv = k.shape[2]
    if hq % hkv:
        raise CommfuseValueError(f"ring_attention: {hq} query heads do not divide into {hkv} K/V heads")
    if layout == "zigzag" and length % 2:
        raise CommfuseValueError(f"ring_attention: layout 'zigzag' needs an even shard length, got {length}")
    axis = Axis(axis_name)
    schedule = schedule_for(Collective.ALL_GATHER, algorithm, axis)
    n = axis.size
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    groups = hq // hkv
    qf = (q.astype(jnp.float32) * scale).reshape(batch, length, hkv, groups, d)
    qpos = _positions(axis.index, length, n, layout)
    state = {"m": jnp.full((batch, hkv, groups, length), -jnp.inf, jnp.float32),
             "l": jnp.zeros((batch, hkv, groups, length), jnp.float32),
             "o": jnp.zeros((batch, length, hkv, groups, d), jnp.float32)}
    spans = pieces_of(length, schedule.pieces)
    kv = jnp.stack([k, v], axis=0)  # K and V travel together: (2, b, L, Hkv, d), cut along the sequence

    def consume(x, rank, piece):
        kp, vp = piece[0].astype(jnp.float32), piece[1].astype(jnp.float32)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kp)
        if causal:
            start, size = spans[schedule.piece(x)]
            kpos = lax.dynamic_slice_in_dim(_positions(rank, length, n, layout), start, size)
            allowed = qpos[:, None] >= kpos[None, :]
            s = jnp.where(allowed, s, -jnp.inf)
        # the running max is only a shift, which the output does not depend on: it carries no gradient; rows
        # that saw no key yet stay empty
        m_new = lax.stop_gradient(jnp.maximum(state["m"], s.max(axis=-1)))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - safe[..., None])
        correction = jnp.exp(state["m"] - safe)
        state["l"] = state["l"] * correction + p.sum(axis=-1)
        o = state["o"] * jnp.moveaxis(correction, -1, 1)[..., None]
        state["o"] = o + jnp.einsum("bhgqk,bkhd->bqhgd", p, vp)
        state["m"] = m_new

    gather_walk(schedule, axis, kv, 2, consume)
    out = state["o"] / jnp.moveaxis(state["l"], -1, 1)[..., None]
    return out.reshape(batch, length, hq, d).astype(q.dtype)
