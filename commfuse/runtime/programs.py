"""Programs: the data side of the executor, one class per collective.

A shard is cut into ``schedule.pieces`` slices along one dim with
``torch.tensor_split`` sizes (``layout``); a slice's tensor is always
contiguous, as transports want. Buffers that arrive are recycled through a
small pool once their last use has passed, unless the program keeps them
(``keep=True``: the caller's consumer may hold on to what it was given).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from commfuse.errors import CommfuseValueError
from commfuse.runtime.executor import Program
from commfuse.schedule import Algorithm, Collective, Schedule, SliceId

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_COLLECTIVES = list(Collective)
_MAGIC = 0xC0F5
_ALGORITHMS = list(Algorithm)


def split_sizes(length: int, n: int) -> list[int]:
    """Sizes of ``torch.tensor_split(x, n)`` along a dim of ``length``."""
    base, extra = divmod(length, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def offsets(sizes: Sequence[int]) -> list[int]:
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return out


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 99


def dtype_name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else f"dtype#{code}"


class Layout:
    """Where every slice of every shard lies along one dim of the whole tensor.

    ``shard_sizes[s]`` is the size of rank s's shard along the dim; every
    shard is cut into ``schedule.pieces`` slices with ``tensor_split`` sizes.
    """

    def __init__(self, schedule: Schedule, shard_sizes: Sequence[int]) -> None:
        self.schedule = schedule
        self.shard_sizes = list(shard_sizes)
        self.shard_offsets = offsets(self.shard_sizes)
        self.piece_sizes = [split_sizes(n, schedule.pieces) for n in self.shard_sizes]
        self.piece_offsets = [offsets(p) for p in self.piece_sizes]
        self.total = sum(self.shard_sizes)

    def size(self, shard: int, x: SliceId) -> int:
        return self.piece_sizes[shard][self.schedule.piece(x)]

    def local(self, shard: int, x: SliceId) -> int:
        """Offset of x inside its shard."""
        return self.piece_offsets[shard][self.schedule.piece(x)]

    def start(self, shard: int, x: SliceId) -> int:
        """Offset of x in the whole tensor."""
        return self.shard_offsets[shard] + self.local(shard, x)


class _Pool:
    """Free receive buffers by (shape, dtype); ``get`` reuses one or allocates.

    One pool lives on each backend object, so a training loop that calls the
    same op every iteration reuses its receive buffers instead of allocating
    (a fresh buffer also costs gloo a new registration, ~50 us per message on
    this machine). A buffer is back in the pool only after the wait that
    filled it and the last compute that read it; on NCCL/HCCL a later receive
    into it is ordered after that compute by c10d's stream synchronisation.
    At most ``MAX_FREE`` buffers per shape are kept.
    """

    MAX_FREE = 4

    def __init__(self, backend) -> None:
        self.backend = backend
        self.free: dict[tuple, list[torch.Tensor]] = {}

    @classmethod
    def of(cls, backend) -> "_Pool":
        pool = getattr(backend, "_commfuse_pool", None)
        if pool is None:
            pool = cls(backend)
            try:
                backend._commfuse_pool = pool
            except AttributeError:  # a backend that takes no attributes gets a pool per call
                pass
        return pool

    def get(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        stack = self.free.get((tuple(shape), dtype))
        return stack.pop() if stack else self.backend.empty(shape, dtype)

    def put(self, tensor: torch.Tensor) -> None:
        stack = self.free.setdefault((tuple(tensor.shape), tensor.dtype), [])
        if len(stack) < self.MAX_FREE:
            stack.append(tensor)


def _shape_with(shape: Sequence[int], dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


class _Base(Program):
    def __init__(self, schedule: Schedule, backend, meta, describe: Callable[[list[int]], str]):
        self.schedule = schedule
        self.backend = backend
        self.rank = backend.rank
        self.n = schedule.world_size
        self.pool = _Pool.of(backend)
        self._meta = meta  # a list of ints, or a function returning one (known only after compute)
        self._describe = describe

    def fingerprint(self) -> list[int]:
        s = self.schedule
        meta = self._meta() if callable(self._meta) else self._meta
        return [_MAGIC, _COLLECTIVES.index(s.collective), _ALGORITHMS.index(s.algorithm), s.parts, s.chunks, *meta]

    def describe_fingerprint(self, values: Sequence[int]) -> str:
        values = list(values)
        if len(values) < 5 or values[0] != _MAGIC:
            return f"an unrecognised fingerprint {values}"
        coll = _COLLECTIVES[values[1]].value if 0 <= values[1] < len(_COLLECTIVES) else f"collective#{values[1]}"
        alg = _ALGORITHMS[values[2]].value if 0 <= values[2] < len(_ALGORITHMS) else f"algorithm#{values[2]}"
        text = f"{coll} with algorithm {alg} (parts={values[3]}, chunks={values[4]})"
        return text + ", " + self._describe(values[5:])


class _Consuming:
    """The gather-like programs: slices sent from, and landed in, ``self.held``; ``consume(slices, tensors)``
    computes on what is held.

    In ``comm_only`` measurements the compute is skipped; a consumer that has
    a ``skip(slices, tensors)`` method is told instead, so it can leave
    stand-ins for the results later code needs (``commfuse.ops``'s consumers
    with ``stand_in``).
    """

    def payload(self, x):
        return self.held[x]

    def land(self, x, tensor):
        self.held[x] = tensor

    def compute(self, slices):
        self.consume(slices, [self.held[x] for x in slices])

    def skip(self, slices):
        told = getattr(self.consume, "skip", None)
        if told is not None:
            told(slices, [self.held[x] for x in slices])


class GatherProgram(_Consuming, _Base):
    """All-gather: rank r starts with its shard and consumes every rank's slices.

    ``consume(slices, tensors)`` is called once per step with the step's slices
    (a ring step: one or two; a vanilla/sliced step: a chunk of every shard).
    """

    collective = Collective.ALL_GATHER

    def __init__(self, schedule, backend, shard: torch.Tensor, dim: int, layout: Layout,
                 consume: Callable, *, keep: bool, meta, describe) -> None:
        super().__init__(schedule, backend, meta, describe)
        self.dim, self.layout, self.consume, self.keep = dim, layout, consume, keep
        self.shape, self.dtype = list(shard.shape), shard.dtype
        pieces = torch.tensor_split(shard, offsets(layout.piece_sizes[self.rank])[1:], dim=dim)
        self.held: dict[SliceId, torch.Tensor] = {
            x: p.contiguous() for x, p in zip(schedule.slices(self.rank), pieces)
        }

    def _shape(self, x: SliceId) -> list[int]:
        return _shape_with(self.shape, self.dim, self.layout.size(x.shard, x))

    def buffer(self, x):
        return self.pool.get(self._shape(x), self.dtype)

    def collective_io(self, call):
        part = call.part
        outputs = [self.buffer(SliceId(q, part)) for q in range(self.n)]

        def finish(got):
            for q, tensor in enumerate(got):
                if q != self.rank:
                    self.held[SliceId(q, part)] = tensor
                else:
                    self.pool.put(tensor)

        return [self.held[SliceId(self.rank, part)]], outputs, finish

    def release(self, x):
        if not self.keep and x.shard != self.rank:
            self.pool.put(self.held.pop(x))


class ReduceScatterProgram(_Base):
    """Reduce-scatter: every rank produces a partial of every output slice; rank d keeps slice d summed.

    ``produce(slices) -> list of tensors`` makes this rank's partials (fresh
    tensors it may add into when ``inplace``). ``shape(x)`` gives the shape of
    x's partial; it is asked only after the first ``produce`` call (every
    reduce-scatter schedule computes before it first receives).
    """

    collective = Collective.REDUCE_SCATTER

    def __init__(self, schedule, backend, produce: Callable, shape: Callable[[SliceId], Sequence[int]],
                 dtype: Callable[[], torch.dtype], *, inplace: bool, meta, describe) -> None:
        super().__init__(schedule, backend, meta, describe)
        self.produce, self.shape, self.dtype, self.inplace = produce, shape, dtype, inplace
        self.sums: dict[SliceId, torch.Tensor] = {}
        self.inbox: dict[SliceId, torch.Tensor] = {}

    def payload(self, x):
        return self.sums[x]

    def buffer(self, x):
        return self.pool.get(self.shape(x), self.dtype())

    def land(self, x, tensor):
        self.inbox[x] = tensor

    def compute(self, slices):
        for x, partial in zip(slices, self.produce(slices)):
            expect = list(self.shape(x))
            if list(partial.shape) != expect:
                raise CommfuseValueError(
                    f"rank {self.rank}: the partial for output {x} has shape {list(partial.shape)}, "
                    f"expected {expect}"
                )
            self.sums[x] = partial if partial.is_contiguous() else partial.contiguous()

    def skip(self, slices):
        try:  # shapes known up front (matmul_reduce_scatter): send uninitialised partials
            for x in slices:
                self.sums[x] = torch.empty(tuple(self.shape(x)), dtype=self.dtype(), device=self.backend.device)
        except (KeyError, IndexError):  # known only from a first partial (produce_reduce_scatter): compute it
            self.compute(slices)

    def add(self, x):
        received = self.inbox.pop(x)
        if self.inplace:
            self.sums[x].add_(received)
        else:
            self.sums[x] = self.sums[x] + received
        self.pool.put(received)

    def collective_io(self, call):
        part = call.part
        inputs = [self.sums[SliceId(d, part)] for d in range(self.n)]
        out = self.buffer(SliceId(self.rank, part))

        def finish(got):
            for d in range(self.n):
                self.sums.pop(SliceId(d, part), None)
            self.sums[SliceId(self.rank, part)] = got[0]

        return inputs, [out], finish

    def release(self, x):
        if x.shard != self.rank:
            self.sums.pop(x, None)

    def result(self) -> list[torch.Tensor]:
        return [self.sums[x] for x in self.schedule.slices(self.rank)]


class AllToAllProgram(_Consuming, _Base):
    """All-to-all: ``blocks[d]`` goes to rank d; rank r consumes every block destined for it.

    ``recv_shape(source, x)`` gives the shape of the slice x of the block that
    ``source`` sends here.
    """

    collective = Collective.ALL_TO_ALL

    def __init__(self, schedule, backend, blocks: Sequence[torch.Tensor], dim: int,
                 recv_shape: Callable[[int, SliceId], Sequence[int]], consume: Callable, *, keep: bool,
                 meta, describe) -> None:
        super().__init__(schedule, backend, meta, describe)
        self.dim, self.consume, self.keep, self.recv_shape = dim, consume, keep, recv_shape
        self.dtype = blocks[0].dtype
        self.held: dict[SliceId, torch.Tensor] = {}
        for d, block in enumerate(blocks):
            sizes = split_sizes(block.shape[dim], schedule.pieces)
            for x, p in zip(schedule.slices(d, self.rank), torch.tensor_split(block, offsets(sizes)[1:], dim=dim)):
                self.held[x] = p.contiguous()

    def buffer(self, x):
        return self.pool.get(self.recv_shape(x.source, x), self.dtype)

    def collective_io(self, call):
        part = call.part
        inputs = [self.held[SliceId(d, part, 0, self.rank)] for d in range(self.n)]
        outputs = [self.buffer(SliceId(self.rank, part, 0, q)) for q in range(self.n)]

        def finish(got):
            for q, tensor in enumerate(got):
                if q != self.rank:
                    self.held[SliceId(self.rank, part, 0, q)] = tensor
                else:
                    self.pool.put(tensor)

        return inputs, outputs, finish

    def release(self, x):
        if not self.keep and x.source != self.rank and x.shard == self.rank:
            self.pool.put(self.held.pop(x))
        elif x.source == self.rank and x.shard != self.rank:
            self.held.pop(x, None)  # sent: our copy is no longer needed
