"""Programs: the data side of the walks (``runtime.walks``), one class per collective, and the receive
buffers' pool (:class:`BufferPool`).

Each comes in two halves. A *layout* (``GatherLayout``, ``ScatterLayout``,
``AllToAllLayout``) is what one call signature fixes: per slot of the
:class:`~commfuse.runtime.compiled.Compiled` steps, its shard, its offset and
size along the dim, its shape. It is built once and kept in the plan. A
*program* is one call's tensors, held in plain lists indexed by slot.

A shard is cut into ``schedule.pieces`` slices along one dim with
``torch.tensor_split`` sizes; a slice's tensor is always contiguous, as
transports want. Buffers that arrive are recycled through a small pool once
their last use has passed, unless the program keeps them (``keep=True``: the
caller's consumer may hold on to what it was given).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from commfuse.errors import CommfuseValueError, CommunicationError
from commfuse.runtime.protocol import Uneven
from commfuse.runtime.compiled import Compiled, Program
from commfuse.runtime.fingerprints import (  # noqa: F401 - the fingerprint's words live there; kept here for their callers
    CONFIG_MARK,
    config_values,
    config_words,
    describe_config,
    dtype_code,
    dtype_name,
    register_described,
    shape_text,
)
from commfuse.runtime.groups import capture_probe
from commfuse.schedule import Collective, SliceId, offsets, split_sizes

__all__ = [
    "AllToAllLayout", "AllToAllProgram", "BufferPool", "GatherLayout", "ProduceAllToAllProgram", "GatherProgram", "ScatterLayout", "ReduceScatterProgram",
    "CONFIG_MARK", "config_values", "config_words", "describe_config", "dtype_code", "dtype_name", "held_slots",
    "key_bytes", "offsets", "register_described", "rounded", "split_sizes", "sum_dtype", "sum_zeros",
]

def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partials of ``dtype`` are summed in across ranks: float32 for float16 and bfloat16 (as torch's
    matmul accumulates them), else ``dtype`` itself.

    A reduce-scatter's running sums are also what travels, so half partials go on the wire as float32: twice
    the bytes, but a sum whose ring order passes through a value half cannot hold (float16: 40000 + 30000;
    bfloat16: 256 + 1) comes out as the float32 sum of the partials, rounded once. Rounding the running sum
    to half on each hop, as a reduce-scatter in the partials' dtype does (gloo's and NCCL's), loses both."""
    return torch.float32 if dtype is torch.float16 or dtype is torch.bfloat16 else dtype


def sum_zeros(like: torch.Tensor) -> torch.Tensor:
    """Zeros shaped as ``like``, in :func:`sum_dtype` of its dtype: where pieces of ``like``'s dtype are summed
    (float32 for half), to be rounded back once by :func:`rounded`."""
    return torch.zeros_like(like, dtype=sum_dtype(like.dtype))


def rounded(total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A sum kept in :func:`sum_dtype` (:func:`sum_zeros`), rounded once to ``dtype``: itself where they match."""
    return total if total.dtype is dtype else total.to(dtype)


class BufferPool:
    """Free receive buffers by (shape, dtype); ``get`` reuses one or allocates.

    One pool lives on each backend object, so a training loop that calls the
    same op every iteration reuses its receive buffers instead of allocating
    (a fresh buffer also costs gloo a new registration, ~50 us per message on
    a CPU). A buffer is back in the pool only after the wait that filled it and
    the last compute that read it; on NCCL/HCCL a later receive into it is
    ordered after that compute by c10d's stream synchronisation. At most
    ``MAX_FREE`` buffers per shape are kept.

    The pool keeps buffers only for the shapes that plans in the planning
    table hold (:meth:`claim`, :meth:`unclaim`; ``commfuse.planning.table``):
    a buffer of any other shape is allocated when asked for and let go when
    given back. So what the pool holds is bounded by the table's bound: each
    claimed shape reserves ``MAX_FREE`` buffers' bytes there, held or not, and
    the last plan to let a shape go drops its free buffers with it. An
    evicted plan that a call in flight (or an autograd graph) still runs keeps
    working: its buffers come from the allocator and go back to it.

    A call captured in a device graph (the current stream capturing, as
    ``groups.capture_probe`` sees it) never touches the free lists: each
    ``get`` makes a fresh buffer, from the graph's private memory pool
    (torch.cuda.graph docs, "Graph memory management"), and ``put`` lets it go
    back there, which lives as long as the graph. So no buffer an eager call
    takes is ever one that a graph writes on replay (an eager result kept in
    it would be overwritten), and no buffer a graph captured goes back to the
    allocator for other tensors while the graph lives.
    """

    MAX_FREE = 4

    def __init__(self, backend) -> None:
        self.backend = backend
        #: free buffers by key, for the claimed keys only; any other key reads as an empty list that is not
        #: kept (``walks.execute_one_by_one`` takes and gives back buffers through these lists without a call).
        #: Keys are added and removed, never their lists emptied in place: a call in flight on another thread
        #: keeps the list it took
        self.free: dict[tuple, list[torch.Tensor]] = _FreeLists()
        #: how many plans in the planning table hold each key (the table changes it, under its lock)
        self.claims: dict[tuple, int] = {}
        #: the bytes the claimed keys reserve: ``MAX_FREE`` buffers each
        self.reserved = 0
        #: whether a call is being captured (None on CPU: never), asked per get and put
        self.probe = capture_probe(getattr(backend, "device", None))
        self.into = hasattr(backend, "collective_into")  # the backend runs whole collectives into one tensor

    @classmethod
    def of(cls, backend) -> "BufferPool":
        pool = getattr(backend, "_commfuse_pool", None)
        if pool is None:
            pool = cls(backend)
            try:
                backend._commfuse_pool = pool
            except AttributeError:  # a backend that takes no attributes gets a pool per call
                pass
        return pool

    def get(self, key: tuple) -> torch.Tensor:
        """A buffer for ``key`` = (shape tuple, dtype)."""
        probe = self.probe
        if probe is not None and probe():
            return self.backend.empty(key[0], key[1])
        stack = self.free.get(key)
        return stack.pop() if stack else self.backend.empty(key[0], key[1])

    def put(self, tensor: torch.Tensor, key: tuple | None = None) -> None:
        """Give ``tensor`` back; ``key`` is its (shape tuple, dtype) when the caller knows it."""
        probe = self.probe
        if probe is not None and probe():  # made during the capture: it goes back to the graph's pool
            return
        if key is None:
            key = (tuple(tensor.shape), tensor.dtype)
        stack = self.free[key]
        if len(stack) < self.MAX_FREE:
            stack.append(tensor)

    def cost(self, keys) -> int:
        """The bytes ``keys`` reserve when claimed: ``MAX_FREE`` buffers of each."""
        return self.MAX_FREE * sum(key_bytes(key) for key in keys)

    def claim(self, keys) -> int:
        """One more plan holds each of ``keys``: the pool keeps their buffers. Returns the bytes newly reserved
        (``MAX_FREE`` buffers of each key no plan held before)."""
        added = 0
        claims = self.claims
        for key in keys:
            count = claims.get(key, 0)
            claims[key] = count + 1
            if count == 0:
                self.free[key] = []
                added += self.MAX_FREE * key_bytes(key)
        self.reserved += added
        return added

    def unclaim(self, keys) -> int:
        """A plan that held ``keys`` is gone: the keys no other plan holds drop their free buffers. Returns the
        bytes no longer reserved."""
        freed = 0
        claims = self.claims
        for key in keys:
            count = claims.get(key, 0) - 1
            if count > 0:
                claims[key] = count
                continue
            claims.pop(key, None)
            self.free.pop(key, None)
            freed += self.MAX_FREE * key_bytes(key)
        self.reserved -= freed
        return freed

    def drop(self) -> None:
        """Let every free buffer go and forget every claim (``commfuse.backends.release``)."""
        self.free = _FreeLists()
        self.claims = {}
        self.reserved = 0

    def held(self) -> int:
        """The bytes of the free buffers held now (at most :attr:`reserved`)."""
        return sum(len(stack) * key_bytes(key) for key, stack in list(self.free.items()))


class _FreeLists(dict):
    """Free lists by key: a key that is not claimed reads as an empty list that is not kept, so a buffer given
    back under it is let go."""

    def __missing__(self, key: tuple) -> list:
        return []


def key_bytes(key: tuple) -> int:
    """The bytes of one buffer of pool key ``key`` = (shape tuple, dtype)."""
    shape, dtype = key
    numel = 1
    for d in shape:
        numel *= d
    return numel * dtype.itemsize


def _shape_with(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = size
    return tuple(out)


class _SlotLayout:
    """Per slot: shard, piece, size, offset in the whole tensor along ``dim`` (``start``) and within its
    owner's shard or block (``offset``); this rank's own slots."""

    def __init__(self, compiled: Compiled, shard_sizes: Sequence[int], dim: int, shape: Sequence[int],
                 dtype: torch.dtype, *, by_source: bool = False) -> None:
        schedule = compiled.schedule
        self.compiled = compiled
        self.dim = dim
        self.dtype = dtype
        self.rank = compiled.rank
        self.n = schedule.world_size
        pieces = schedule.pieces
        self.shard_sizes = list(shard_sizes)
        shard_offsets = offsets(self.shard_sizes)
        n_slots = len(compiled.slices)
        self.shard = [0] * n_slots
        self.piece = [0] * n_slots
        self.size = [0] * n_slots
        self.start = [0] * n_slots
        self.offset = [0] * n_slots
        self.key: list[tuple] = [()] * n_slots  # (shape, dtype): the pool's key and the buffer's shape
        for s, x in enumerate(compiled.slices):
            owner = x.source if by_source else x.shard
            sizes = split_sizes(self.shard_sizes[owner], pieces)
            p = schedule.piece(x)
            self.shard[s], self.piece[s], self.size[s] = x.shard, p, sizes[p]
            self.offset[s] = offsets(sizes)[p]
            self.start[s] = shard_offsets[owner] + self.offset[s]
            self.key[s] = (_shape_with(shape, dim, sizes[p]), dtype)
        self.total = sum(self.shard_sizes)
        self.walk: tuple | None = None  # the plan's ring_walk, made on its first call without a program
        self.private: frozenset[int] | None = None  # the slots a user's consumer gets a copy of, once asked
        # One whole collective over equal shards (vanilla) can run into/from one tensor, rank by rank along
        # dim 0 (``collective_into``), when the backend has it: no per-rank buffer lists, no concatenation.
        self.into = schedule.algorithm.value == "vanilla" and len(set(self.shard_sizes)) == 1 and not by_source
        shard_shape = _shape_with(shape, dim, self.shard_sizes[0])
        # the whole of a collective_into: every rank's shard stacked along dim 0, as torch's *_into_tensor want
        self.whole_key = ((self.n * shard_shape[0], *shard_shape[1:]), dtype) if shard_shape else ((), dtype)
        self.stacked = (self.n, *shard_shape)
        # the slots of every rank's shard in chunk ``part`` (whole collectives), by part
        slot = compiled.slot
        if by_source:
            self.part_slots = {}
        else:
            # this rank's own slots (its input shard for all-gather, its output shard for reduce-scatter)
            self.own = compiled.slots_of(self.rank)
            self.own_set = frozenset(self.own)
            self.part_slots = {part: [slot[SliceId(q, part)] for q in range(self.n)]
                               for part in range(schedule.splits) if SliceId(0, part) in slot}

    def pool_keys(self) -> frozenset:
        """Every pool key a call on this layout may take buffers of: its slots', the whole tensor of a
        ``collective_into``, and the largest shard of each part (a whole collective over uneven shards pads
        every shard to it). What its plan claims in the pool (``BufferPool.claim``)."""
        keys = set(self.key)
        if self.into:
            keys.add(self.whole_key)
        for slots in self.part_slots.values():
            biggest = max(self.size[s] for s in slots)
            keys.add(_shape_key(self.key[slots[self.rank]], self.dim, biggest))
        return frozenset(keys)


class GatherLayout(_SlotLayout):
    """All-gather of shards of ``shard_sizes`` along ``dim`` (rank r's shard has ``shape`` but for that dim)."""

    def __init__(self, compiled: Compiled, shard_sizes: Sequence[int], dim: int, shape: Sequence[int],
                 dtype: torch.dtype) -> None:
        super().__init__(compiled, shard_sizes, dim, shape, dtype)
        sizes = [self.size[s] for s in self.own]
        self.cuts = offsets(sizes)[1:]  # where tensor_split cuts this rank's shard


def held_slots(layout, shard: torch.Tensor) -> list:
    """A gather's tensors by slot at the start of a call: this rank's shard (cut into its slices), nothing
    else yet."""
    held: list = [None] * len(layout.size)
    own = layout.own
    if len(own) == 1:
        held[own[0]] = shard if shard.is_contiguous() else shard.contiguous()
    else:
        for s, p in zip(own, torch.tensor_split(shard, layout.cuts, dim=layout.dim)):
            held[s] = p.contiguous()
    return held


class _Base(Program):
    """What the programs share: their layout, buffer pool and fingerprint integers."""

    def meta(self):
        return self._meta

    def buffer(self, s):
        return self.pool.get(self.layout.key[s])


class _Consuming:
    """The gather-like programs: slices sent from, and landed in, ``self.held``; ``consume(slots, tensors)``
    computes on what is held.

    In ``comm_only`` measurements the compute is skipped; a consumer that has
    a ``skip(slots, tensors)`` method is told instead, so it can leave
    stand-ins for the results later code needs.
    """

    def payload(self, s):
        return self.held[s]

    def land(self, s, tensor):
        self.held[s] = tensor

    def compute(self, slots):
        held = self.held
        self.consume(slots, [held[s] for s in slots])

    def skip(self, slots):
        told = getattr(self.consume, "skip", None)
        if told is not None:
            told(slots, [self.held[s] for s in slots])


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` with zeros appended along ``dim`` up to ``size`` (itself when it already has it)."""
    if t.shape[dim] == size:
        return t
    out = t.new_zeros(_shape_with(t.shape, dim, size))
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


class GatherProgram(_Consuming, _Base):
    """All-gather: rank r starts with its shard and consumes every rank's slices.

    ``consume(slots, tensors)`` is called once per step with the step's slots
    (a ring step: one or two; a vanilla/sliced step: a chunk of every shard).
    Whole collectives over shards of different sizes (``vanilla``/``sliced``
    with uneven ``tensor_split`` shards) pad every shard to the largest and
    narrow what arrives.
    """

    collective = Collective.ALL_GATHER

    def __init__(self, layout: GatherLayout, pool: BufferPool, shard: torch.Tensor, consume: Callable, *,
                 keep: bool, meta: list[int], whole_ok: bool = False) -> None:
        self.layout, self.pool, self.consume, self.keep, self._meta = layout, pool, consume, keep, meta
        self.whole_ok = whole_ok  # consume(slots, tensor) means "every shard, in this one tensor"
        self.held = held_slots(layout, shard)
        self.narrowed = False  # a whole collective over uneven shards left views in ``held``
        self.whole = None  # the gathered tensor, (n, *shard) rank by rank, after a collective_into
        self.into = layout.into and pool.into

    def compute(self, slots):
        if self.whole_ok and self.whole is not None and len(slots) == self.layout.n:
            self.consume(slots, self.whole)  # every shard at once, as one tensor (see gather_spans)
            return
        held = self.held
        self.consume(slots, [held[s] for s in slots])

    def collective_io(self, call):
        layout, part = self.layout, call.part
        if self.into:
            whole = self.pool.get(layout.whole_key)
            mine = self.held[layout.own[0]]

            def finish_into(got):
                self.whole = got[0]
                self.narrowed = True  # held has views of the whole (if any): it goes back to the pool as one
                if not self.whole_ok:  # a consumer of per-rank tensors: views of the whole, rank by rank
                    per_rank = got[0].view(layout.stacked)
                    for q, s in enumerate(layout.part_slots[part]):
                        self.held[s] = per_rank[q]

            return mine, whole, finish_into
        slots = layout.part_slots[part]
        sizes = [layout.size[s] for s in slots]
        biggest = max(sizes)
        mine = slots[layout.rank]
        outputs = [self.pool.get(_shape_key(layout.key[mine], layout.dim, biggest)) for _ in slots]

        def finish(got):
            for q, (s, tensor) in enumerate(zip(slots, got)):
                if q == layout.rank:
                    self.pool.put(tensor)
                elif sizes[q] == biggest:
                    self.held[s] = tensor
                else:
                    self.held[s] = tensor.narrow(layout.dim, 0, sizes[q])
                    self.narrowed = True

        return [_pad(self.held[mine], layout.dim, biggest)], outputs, finish

    def release(self, s):
        if not self.keep and s not in self.layout.own_set:
            t = self.held[s]
            self.held[s] = None
            if self.whole is not None:
                whole, self.whole = self.whole, None
                self.pool.put(whole, self.layout.whole_key)
            elif t is not None and not self.narrowed:
                self.pool.put(t, self.layout.key[s])


def _shape_key(key: tuple, dim: int, size: int) -> tuple:
    return (_shape_with(key[0], dim, size), key[1])


class ScatterLayout(_SlotLayout):
    """Reduce-scatter of partials of ``shape`` and ``dtype`` (the whole tensor's shape along ``dim`` is
    ``sum(shard_sizes)``). The running sums, and so the buffers and what travels, are in
    ``sum_dtype(dtype)``; ``widen`` is that dtype where it is not ``dtype`` (half partials: each is cast up as
    it is made, the result cast back once), else None."""

    def __init__(self, compiled: Compiled, shard_sizes: Sequence[int], dim: int, shape: Sequence[int],
                 dtype: torch.dtype) -> None:
        wide = sum_dtype(dtype)
        super().__init__(compiled, shard_sizes, dim, shape, wide)
        self.made = dtype
        self.widen = wide if wide is not dtype else None
        # per step's compute: the (start, size) of each slot, in slot order
        self.spans = {st.compute: [(self.start[s], self.size[s]) for s in st.compute]
                      for st in compiled.steps if st.compute}


class ReduceScatterProgram(_Base):
    """Reduce-scatter: every rank produces a partial of every output slice; rank d keeps slice d summed.

    ``produce(slots) -> list of tensors`` makes this rank's partials for the
    step's slots (fresh tensors it may add into when ``inplace``). With
    ``check_shapes`` every partial's shape is compared with the layout's
    (producers written by users). ``produce_whole()``, when given, makes
    every rank's partial at once as one tensor, rank by rank along dim 0: the
    input of a ``vanilla`` reduce-scatter run with ``collective_into``.
    Where the layout widens (half partials), each partial is cast to its
    ``widen`` dtype as it is made, sums and transfers stay in it, and
    :meth:`result` is cast back to the partials' dtype, once.
    """

    collective = Collective.REDUCE_SCATTER

    def __init__(self, layout: ScatterLayout, pool: BufferPool, produce: Callable, *, inplace: bool,
                 meta: list[int], check_shapes: bool = False, produce_whole: Callable | None = None) -> None:
        self.layout, self.pool, self.produce, self.inplace, self._meta = layout, pool, produce, inplace, meta
        self.check_shapes = check_shapes
        self.sums: list = [None] * len(layout.size)
        self.inbox: list = [None] * len(layout.size)
        self.produce_whole = produce_whole if layout.into and pool.into else None
        self.whole = None
        if layout.widen is not None:
            self._widen()

    def _widen(self) -> None:
        """Half partials: each cast to the layout's ``widen`` dtype as it is made, the result cast back."""
        layout = self.layout
        wide, produce, produce_whole = layout.widen, self.produce, self.produce_whole
        self.produce = lambda slots: [p.to(wide) for p in produce(slots)]
        if produce_whole is not None:
            self.produce_whole = lambda: produce_whole().to(wide)
        self.result = lambda: [self.sums[s].to(layout.made) for s in layout.own]

    def payload(self, s):
        return self.sums[s]

    def land(self, s, tensor):
        self.inbox[s] = tensor

    def compute(self, slots):
        layout = self.layout
        if self.produce_whole is not None and len(slots) == layout.n:
            self.whole = self.produce_whole()
            return
        partials = self.produce(slots)
        sums = self.sums
        for s, partial in zip(slots, partials):
            if self.check_shapes and tuple(partial.shape) != layout.key[s][0]:
                raise CommfuseValueError(
                    f"rank {layout.rank}: the partial for output shard {layout.shard[s]} slice {layout.piece[s]} "
                    f"has shape {list(partial.shape)}, expected {list(layout.key[s][0])}"
                )
            sums[s] = partial if partial.is_contiguous() else partial.contiguous()

    def skip(self, slots):  # comm_only: send uninitialised partials of the right shape
        layout = self.layout
        for s in slots:
            shape, dtype = layout.key[s]
            self.sums[s] = torch.empty(shape, dtype=dtype, device=self.pool.backend.device)

    def add(self, s):
        received = self.inbox[s]
        self.inbox[s] = None
        if self.inplace:
            self.sums[s].add_(received)
        else:
            self.sums[s] = self.sums[s] + received
        self.pool.put(received, self.layout.key[s])

    def collective_io(self, call):
        layout, part = self.layout, call.part
        slots = layout.part_slots[part]
        if layout.into and self.pool.into:
            mine = slots[layout.rank]
            if self.whole is not None:
                stacked, self.whole = self.whole.view(layout.whole_key[0]), None
            else:
                stacked = _stacked([self.sums[s] for s in slots]).view(layout.whole_key[0])
            out = self.pool.get(layout.key[mine])

            def finish_into(got):
                for s in slots:
                    self.sums[s] = None
                self.sums[mine] = got[0]

            return stacked, out, finish_into
        sizes = [layout.size[s] for s in slots]
        biggest = max(sizes)
        mine = slots[layout.rank]
        inputs = [_pad(self.sums[s], layout.dim, biggest) for s in slots]
        out = self.pool.get(_shape_key(layout.key[mine], layout.dim, biggest))

        def finish(got):
            for s in slots:
                self.sums[s] = None
            t = got[0]
            self.sums[mine] = t if sizes[layout.rank] == biggest else t.narrow(layout.dim, 0, sizes[layout.rank])

        return inputs, [out], finish

    def release(self, s):
        if s not in self.layout.own_set:
            self.sums[s] = None

    def result(self) -> list[torch.Tensor]:
        return [self.sums[s] for s in self.layout.own]


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(parts)``, without the copy when they already lie end to end in one contiguous tensor
    (the partials of a vanilla matmul + reduce-scatter are views of one product)."""
    base = parts[0]._base
    if base is not None and base.is_contiguous() and all(p._base is base and p.is_contiguous() for p in parts):
        step = parts[0].numel()
        start = parts[0].data_ptr()
        size = parts[0].element_size()
        if base.data_ptr() == start and base.numel() == step * len(parts) and all(
                p.data_ptr() == start + i * step * size for i, p in enumerate(parts)):
            return base.view(len(parts), *parts[0].shape)
    return torch.stack(parts)


class AllToAllLayout(_SlotLayout):
    """All-to-all of blocks cut along ``dim``; the other dims of ``shape`` are every block's.

    Even (``send_sizes`` None): every block has ``shape``. Uneven: this rank's
    block for rank d has ``send_sizes[d]`` rows along ``dim`` and the block
    from rank q ``recv_sizes[q]`` (MoE's dispatch and combine, whose sizes
    follow the routing). An uneven layout is made per call, its buffers are
    fresh rather than pooled (the sizes change every call), and its empty
    slices are not sent (:attr:`sparse`).
    """

    def __init__(self, compiled: Compiled, dim: int, shape: Sequence[int], dtype: torch.dtype,
                 send_sizes: Sequence[int] | None = None, recv_sizes: Sequence[int] | None = None) -> None:
        n = compiled.schedule.world_size
        super().__init__(compiled, [shape[dim]] * n, dim, shape, dtype, by_source=True)
        rank = compiled.rank
        schedule = compiled.schedule
        pieces = schedule.pieces
        #: uneven blocks: empty slices are skipped, buffers are not pooled
        self.sparse = send_sizes is not None
        if self.sparse:
            if recv_sizes is None or len(send_sizes) != n or len(recv_sizes) != n:
                raise CommfuseValueError(f"rank {rank}: an uneven all-to-all needs {n} send and {n} receive sizes")
            if send_sizes[rank] != recv_sizes[rank]:
                raise CommfuseValueError(
                    f"rank {rank}: its block for itself has {send_sizes[rank]} rows sent but {recv_sizes[rank]} "
                    "received"
                )
            for s, x in enumerate(compiled.slices):
                rows = send_sizes[x.shard] if x.source == rank else recv_sizes[x.source]
                size = split_sizes(rows, pieces)[schedule.piece(x)]
                self.size[s] = size
                self.key[s] = (_shape_with(shape, dim, size), dtype)
            self.send_sizes, self.recv_sizes = list(send_sizes), list(recv_sizes)
        else:
            self.send_sizes = self.recv_sizes = [shape[dim]] * n
        #: where each slice starts within its block, along ``dim`` (again: an uneven block's sizes are its own)
        for slots in (compiled.slots_of(d, q) for d in range(n) for q in range(n) if rank in (d, q)):
            at = 0
            for s in slots:
                self.offset[s] = at
                at += self.size[s]
        self.outgoing = [compiled.slots_of(d, rank) for d in range(n)]  # my block for d, slice by slice
        self.incoming = [compiled.slots_of(rank, q) for q in range(n)]  # the block from q, slice by slice
        #: where tensor_split cuts this rank's block for each destination into its slices
        self.cuts = [offsets(split_sizes(rows, pieces))[1:] for rows in self.send_sizes]
        self.source = [x.source for x in compiled.slices]
        slot = compiled.slot
        # whole collectives, by part: (my block for every d, every q's block for me)
        self.part_slots = {part: ([slot[SliceId(d, part, 0, rank)] for d in range(n)],
                                  [slot[SliceId(rank, part, 0, q)] for q in range(n)])
                           for part in range(schedule.splits) if SliceId(0, part, 0, rank) in slot}

    def pool_keys(self) -> frozenset:
        """An uneven layout's buffers are fresh, never pooled; an even one's are its slots'."""
        return frozenset() if self.sparse else frozenset(self.key)

    def fresh(self, s: int, device) -> torch.Tensor:
        shape, dtype = self.key[s]
        return torch.empty(shape, dtype=dtype, device=device)


class _Blocks:
    """What both all-to-all programs share: buffers (fresh for uneven layouts), whole collectives."""

    sparse = False

    def buffer(self, s):
        if self.sparse:
            return self.layout.fresh(s, self.pool.backend.device)
        return self.pool.get(self.layout.key[s])

    def collective_io(self, call):
        layout, rank = self.layout, self.layout.rank
        outgoing, incoming = layout.part_slots[call.part]
        inputs = [self.held[s] for s in outgoing]
        outputs = [self.buffer(s) for s in incoming]
        if self.sparse:  # every rank of an uneven call marks its blocks, whatever their sizes here
            inputs, outputs = Uneven(inputs), Uneven(outputs)

        def finish(got):
            if len(got) != len(incoming):
                raise CommunicationError(
                    f"rank {rank}: the backend's whole all_to_all gave {len(got)} blocks for {len(incoming)} "
                    f"sources ({type(self.pool.backend).__name__})")
            for q, (s, tensor) in enumerate(zip(incoming, got)):
                if q != rank:
                    self.held[s] = tensor
                elif self.keeps_own:  # the own block is held already
                    if not self.sparse:
                        self.pool.put(tensor)
                else:
                    self.held[s] = tensor

        return inputs, outputs, finish


class AllToAllProgram(_Blocks, _Consuming, _Base):
    """All-to-all: ``blocks[d]`` goes to rank d; rank r consumes every block destined for it."""

    collective = Collective.ALL_TO_ALL
    keeps_own = True

    def __init__(self, layout: AllToAllLayout, pool: BufferPool, blocks: Sequence[torch.Tensor], consume: Callable, *,
                 keep: bool, meta: list[int]) -> None:
        self.layout, self.pool, self.consume, self.keep, self._meta = layout, pool, consume, keep, meta
        self.sparse = layout.sparse
        held: list = [None] * len(layout.size)
        for d, block in enumerate(blocks):
            slots = layout.outgoing[d]
            if len(slots) == 1:
                held[slots[0]] = block if block.is_contiguous() else block.contiguous()
            else:
                for s, p in zip(slots, torch.tensor_split(block, layout.cuts[d], dim=layout.dim)):
                    held[s] = p.contiguous()
        self.held = held

    def release(self, s):
        layout = self.layout
        mine = layout.shard[s] == layout.rank
        if layout.source[s] == layout.rank:
            if not mine:
                self.held[s] = None  # sent: our copy is no longer needed
        elif mine and not self.keep:
            t = self.held[s]
            self.held[s] = None
            if t is not None and not self.sparse:
                self.pool.put(t)


class ProduceAllToAllProgram(_Blocks, _Base):
    """The produce side of all-to-all: ``produce(d)`` makes this rank's block for rank d in the step the
    schedule says, a later step sends it; rank r ends with every rank's block for it (:meth:`result`).

    ``produce`` is called once per destination (a block cut into slices is
    made whole on its first slice's step and cut). Blocks are checked against
    the layout's shapes: a producer's wrong size is named, never sent.
    """

    collective = Collective.PRODUCE_ALL_TO_ALL
    keeps_own = False

    def __init__(self, layout: AllToAllLayout, pool: BufferPool, produce: Callable[[int], torch.Tensor], *,
                 meta: list[int], made: dict[int, torch.Tensor] | None = None, by_slice: bool = False) -> None:
        self.layout, self.pool, self.produce, self._meta = layout, pool, produce, meta
        #: ``produce(d, start, rows)`` makes each slice of the block for d in its own step (else the whole block
        #: is made on its first slice's step)
        self.by_slice = by_slice
        self.sparse = layout.sparse
        self.held: list = [None] * len(layout.size)
        self.made: dict[int, torch.Tensor] = dict(made or {})  # blocks made before the call (its layout's source)
        self.cut: dict[int, list[torch.Tensor]] = {}

    def _block(self, d: int) -> list[torch.Tensor]:
        got = self.cut.get(d)
        if got is None:
            layout = self.layout
            t = self.made.pop(d) if d in self.made else self.produce(d)
            if not isinstance(t, torch.Tensor):
                raise CommfuseValueError(
                    f"rank {layout.rank}: producer({d}) must return a torch.Tensor, got {type(t).__name__}")
            slots = layout.outgoing[d]
            want = [layout.key[s] for s in slots]
            whole = list(want[0][0])
            whole[layout.dim] = layout.send_sizes[d]
            if list(t.shape) != whole or t.dtype != want[0][1]:
                raise CommfuseValueError(
                    f"rank {layout.rank}: producer({d}) returned {str(t.dtype).replace('torch.', '')}"
                    f"{list(t.shape)}, expected {str(want[0][1]).replace('torch.', '')}{whole} (dim {layout.dim} "
                    "is the rows this rank sends that rank)"
                )
            got = [t] if len(slots) == 1 else list(torch.tensor_split(t, layout.cuts[d], dim=layout.dim))
            self.cut[d] = got
        return got

    def payload(self, s):
        return self.held[s]

    def land(self, s, tensor):
        self.held[s] = tensor

    def compute(self, slots):
        layout, held = self.layout, self.held
        for s in slots:
            if self.by_slice:
                t = self.produce(layout.shard[s], layout.offset[s], layout.size[s])
                if tuple(t.shape) != layout.key[s][0] or t.dtype != layout.key[s][1]:
                    raise CommfuseValueError(
                        f"rank {layout.rank}: the producer's slice of rows {layout.offset[s]}.."
                        f"{layout.offset[s] + layout.size[s]} for rank {layout.shard[s]} is {t.dtype}"
                        f"{list(t.shape)}, expected {layout.key[s][1]}{list(layout.key[s][0])}")
            else:
                t = self._block(layout.shard[s])[layout.piece[s]]
            held[s] = t if t.is_contiguous() else t.contiguous()

    def skip(self, slots):  # comm_only: send uninitialised blocks of the right shape
        for s in slots:
            self.held[s] = self.layout.fresh(s, self.pool.backend.device)

    def release(self, s):
        layout = self.layout
        if layout.source[s] == layout.rank and layout.shard[s] != layout.rank:
            self.held[s] = None  # sent

    def result(self) -> list[torch.Tensor]:
        """The block from every rank, by source (slices joined along the dim)."""
        layout, held = self.layout, self.held
        out = []
        for slots in layout.incoming:
            out.append(held[slots[0]] if len(slots) == 1 else torch.cat([held[s] for s in slots], dim=layout.dim))
        return out
