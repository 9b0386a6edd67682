"""commfuse's schedules run on the devices of a JAX mesh axis: every hop a ``ppermute``, every rank one program.

Under ``shard_map`` every device runs the same program, so the rank is not a
Python int but a value of the graph, ``lax.axis_index``. Every commfuse
schedule is the same on every rank up to rotation (``Schedule.template``: the
steps of the rank at ring position 0, each shard written as a ring offset), so
one walk of the template serves all ranks: the slice at offset ``o`` is, on
the device at index r, the shard of rank ``(r + o) mod N``
(:meth:`Axis.rank_at`). What is moved and when comes from the template and is
the same on every device; which rows a slice is, is computed from the index.

The walk follows the step contract of ``commfuse.schedule`` (post, compute,
wait, add), written as data flow:

* a step's receives become one ``lax.ppermute`` each, fed by the send that
  :func:`commfuse.schedule.permute_plan` pairs with it, with the pairs
  ``Ring(N).pairs(shift)``; a payload is what the slice held at the start of
  the step;
* the compute of a step reads only what was held before it (received in an
  earlier step), so XLA may run it while the step's permutes are in flight;
* ``vanilla`` and ``sliced`` become whole collectives (``lax.all_gather``,
  ``lax.psum_scatter``, ``lax.all_to_all``), whose blocks come in rank order
  and are picked for each template offset by the index.

In plain code, for the all-gather ring (the walk adds the parts, the halves and
the whole collectives)::

    held = shard
    for k in range(N):
        nxt = lax.ppermute(held, axis, Ring(N).pairs(1)) if k < N - 1 else None
        consume((r - k) % N, held)
        held = nxt

Nothing here imports torch: the ops (:mod:`commfuse_jax.ops`) put torchax
around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.schedule import Collective, Ring, Schedule, SliceId, build, parse_algorithm, permute_plan

__all__ = ["Axis", "gather_walk", "pieces_of", "scatter_walk", "schedule_for", "swap_walk", "unrotate"]


def _axis_names_in_scope() -> tuple:
    """The mesh axis names bound here (inside ``shard_map``), for error messages; () when JAX cannot say."""
    try:
        from jax._src import core

        return tuple(core.unsafe_get_axis_names())
    except Exception:  # noqa: BLE001 - an internal API: an error message must not fail because it moved
        return ()


class Axis:
    """The ranks of one op: a mesh axis (or a tuple of axes) of the ``shard_map`` being traced.

    ``size`` is a Python int (the world size); ``index`` the device's position
    on the axis, a traced int32 (the rank). Made inside the trace; an axis that
    is not bound there is refused by name, with the axes that are.
    """

    __slots__ = ("name", "size", "index", "ring")

    def __init__(self, name) -> None:
        if isinstance(name, list):
            name = tuple(name)
        if not (isinstance(name, str) or (isinstance(name, tuple) and name and all(isinstance(n, str) for n in name))):
            raise CommfuseTypeError(
                f"jax backend: the group must be a mesh axis name (a string) or a tuple of them, got "
                f"{type(name).__name__} {name!r}"
            )
        try:
            size = lax.axis_size(name)
        except NameError:
            bound = _axis_names_in_scope()
            raise CommfuseValueError(
                f"jax backend: mesh axis {name!r} is not bound here; the axes of the enclosing shard_map are "
                f"{list(bound) if bound else 'none (is the op called inside jax.shard_map?)'}: pass one of them as "
                "group"
            ) from None
        self.name, self.size = name, int(size)
        self.index = lax.axis_index(name)
        self.ring = Ring(self.size)

    @classmethod
    def in_scope(cls) -> "Axis":
        """The one mesh axis bound here, when the op names none; refused by name when there are several."""
        bound = _axis_names_in_scope()
        if len(bound) != 1:
            raise CommfuseValueError(
                "jax backend: no group was given and "
                + (f"the enclosing shard_map binds the axes {list(bound)}: pass the one this op runs over as group "
                   "(e.g. group='tp')" if bound else
                   "no mesh axis is bound here: call the op inside jax.shard_map, or pass the axis as group")
            )
        return cls(bound[0])

    def rank_at(self, offset: int):
        """The rank at ring offset ``offset`` from this device, ``(index + offset) mod N`` (traced): whose shard
        a template slice of that offset is here."""
        if offset == 0:
            return self.index
        return (self.index + offset) % self.size

    def permute(self, x, shift: int):
        """``x`` moved ``shift`` hops along the ring on every device: one collective-permute."""
        return lax.ppermute(x, self.name, perm=self.ring.pairs(shift))

    def __repr__(self) -> str:
        return f"Axis({self.name!r}, size={self.size})"


def schedule_for(collective: Collective, algorithm: str, axis: Axis) -> Schedule:
    """The schedule ``algorithm`` names for ``collective`` on ``axis``; ``auto`` takes the ring (XLA schedules
    the permutes against the dots), or ``vanilla`` on one device."""
    spec = parse_algorithm(algorithm, collective)
    if spec.name == "native":
        raise CommfuseValueError(
            "jax backend: algorithm 'native' asks for a vendor's fused kernel, which this backend does not have "
            "(XLA fuses what it fuses from the lowered graph); use ring, bidirectional, sliced, vanilla or auto"
        )
    if spec.name == "serial":
        raise CommfuseValueError(
            "jax backend: algorithm 'serial' is an eager measurement baseline (each hop waited for before its "
            "compute); a traced graph is ordered by XLA's scheduler, not by waits: use ring or vanilla"
        )
    name = spec.schedule_algorithm
    if name == "auto":
        name = "vanilla" if axis.size == 1 else "ring"
    return build(collective, axis.size, algorithm=name, parts=spec.parts, chunks=spec.chunks)


def pieces_of(size: int, count: int) -> list[tuple[int, int]]:
    """``(start, length)`` of ``count`` pieces of ``size`` rows, as ``torch.tensor_split`` cuts them."""
    base, extra = divmod(size, count)
    spans, start = [], 0
    for i in range(count):
        length = base + (1 if i < extra else 0)
        spans.append((start, length))
        start += length
    return spans


def _cut(x, spans, dim: int) -> list:
    return [lax.slice_in_dim(x, start, start + length, axis=dim) for start, length in spans]


def _pairs(schedule: Schedule, step) -> list[tuple[SliceId, SliceId, int]]:
    """``(received slice, slice sent to feed it, shift)`` for each receive of a template step."""
    plan = permute_plan(schedule.ring, 0, step.sends, step.recvs)
    return [(t.slice, step.sends[index].slice, shift) for t, (index, shift, _) in zip(step.recvs, plan)]


def _whole(schedule: Schedule, step) -> list[int]:
    return [call.part for call in step.collectives]


def gather_walk(schedule: Schedule, axis: Axis, shard, dim: int,
                consume: Callable[[SliceId, object, object], None]) -> None:
    """Walk an all-gather schedule over this device's ``shard``: ``consume(x, rank, piece)`` for every slice
    ``x`` of every rank's shard, in the schedule's order, ``rank`` (traced) being whose shard it is."""
    if schedule.collective is not Collective.ALL_GATHER:
        raise CommfuseValueError(f"gather_walk needs an all_gather schedule, got {schedule.collective}")
    spans = pieces_of(shard.shape[dim], schedule.pieces)
    own = _cut(shard, spans, dim)
    held = {x: own[schedule.piece(x)] for x in schedule.slices(0)}
    n = axis.size
    for step in schedule.template:
        landed = {got: axis.permute(held[sent], shift) for got, sent, shift in _pairs(schedule, step)}
        for part in _whole(schedule, step):
            x = SliceId(0, part)
            stacked = lax.all_gather(held[x], axis.name, axis=0, tiled=False)  # rank order
            for offset in range(1, n):
                landed[SliceId(offset, part)] = lax.dynamic_index_in_dim(
                    stacked, axis.rank_at(offset), axis=0, keepdims=False)
        for x in step.compute:
            consume(x, axis.rank_at(x.shard), held[x])
        held.update(landed)


def scatter_walk(schedule: Schedule, axis: Axis, dim: int, produce: Callable[[SliceId, object], object]):
    """Walk a reduce-scatter schedule: ``produce(x, rank)`` is this device's partial of slice ``x`` of
    ``rank``'s output shard (``rank`` traced); returns this device's shard of the sum over the axis, its
    slices joined along ``dim``."""
    if schedule.collective is not Collective.REDUCE_SCATTER:
        raise CommfuseValueError(f"scatter_walk needs a reduce_scatter schedule, got {schedule.collective}")
    n = axis.size
    held: dict[SliceId, object] = {}
    for step in schedule.template:
        sums = {got: axis.permute(held[sent], shift) for got, sent, shift in _pairs(schedule, step)}
        whole = {}
        for part in _whole(schedule, step):
            blocks = jnp.stack([held[SliceId(offset, part)] for offset in range(n)])  # offsets from this device
            in_rank_order = jnp.roll(blocks, axis.index, axis=0)  # row q: the partial for rank q
            whole[SliceId(0, part)] = lax.psum_scatter(in_rank_order, axis.name, scatter_dimension=0, tiled=False)
        for x in step.compute:
            held[x] = produce(x, axis.rank_at(x.shard))
        for x, value in sums.items():
            held[x] = held[x] + value if x in step.accumulate else value
        held.update(whole)
    return jnp.concatenate([held[x] for x in schedule.slices(0)], axis=dim) if schedule.pieces > 1 else \
        held[SliceId(0)]


def swap_walk(schedule: Schedule, axis: Axis, blocks: Sequence, dim: int,
              consume: Callable[[SliceId, object, object], None]) -> None:
    """Walk an all-to-all schedule: ``blocks[d]`` goes to rank d; ``consume(x, rank, piece)`` for every slice
    of every block that arrives, ``rank`` (traced) being the sender. Every block has one shape."""
    if schedule.collective is not Collective.ALL_TO_ALL:
        raise CommfuseValueError(f"swap_walk needs an all_to_all schedule, got {schedule.collective}")
    n = axis.size
    stacked = jnp.stack(list(blocks))  # row d: the block for rank d
    spans = pieces_of(stacked.shape[dim + 1], schedule.pieces)
    mine = {}
    for offset in range(n):  # the block for the rank `offset` hops on, cut into its slices
        block = stacked[0] if n == 1 else lax.dynamic_index_in_dim(stacked, axis.rank_at(offset), 0, keepdims=False)
        for x, piece in zip(schedule.slices(offset, 0), _cut(block, spans, dim)):
            mine[x] = piece
    held = dict(mine)
    for step in schedule.template:
        landed = {got: axis.permute(held[sent], shift) for got, sent, shift in _pairs(schedule, step)}
        for part in _whole(schedule, step):
            out = jnp.stack([held[SliceId(offset, part, 0, 0)] for offset in range(n)])
            out = lax.all_to_all(jnp.roll(out, axis.index, axis=0), axis.name, 0, 0, tiled=False)  # row q: from q
            for offset in range(1, n):
                landed[SliceId(0, part, 0, offset)] = lax.dynamic_index_in_dim(
                    out, axis.rank_at(offset), axis=0, keepdims=False)
        for x in step.compute:
            consume(x, axis.rank_at(x.source), held[x])
        held.update(landed)


def unrotate(values: list, axis: Axis) -> list:
    """``values[o]`` (what was computed for the rank ``o`` hops back) put in rank order: entry q of the result is
    rank q's. Every value must be an array (or a tree of arrays) of one structure and shape."""
    leaves = [jax.tree_util.tree_flatten(v) for v in values]
    structure = leaves[0][1]
    for o, (_, s) in enumerate(leaves):
        if s != structure:
            raise CommfuseValueError(
                f"jax backend: the consumer returned {s} for the shard {o} hops away but {structure} for this "
                "device's own; under one program for every device its results must have one structure"
            )
    columns = []
    for i in range(len(leaves[0][0])):
        column = [leaf[0][i] for leaf in leaves]
        if not all(isinstance(c, jax.Array) for c in column) or len({(c.shape, c.dtype) for c in column}) != 1:
            raise CommfuseValueError(
                "jax backend: a consumer's results are returned in rank order, which on a traced rank needs "
                f"tensors of one shape and dtype; got {[(getattr(c, 'shape', type(c).__name__)) for c in column]}"
            )
        columns.append(jnp.roll(jnp.stack(column), axis.index, axis=0))  # row q: rank q's
    return [jax.tree_util.tree_unflatten(structure, [c[q] for c in columns]) for q in range(len(values))]
