"""The schedule IR: what every rank does at every step, as frozen data.

A :class:`Schedule` is built once for a world size and options. It stores a
*template*: the steps of the rank at ring position 0, with every rank, shard
and peer written as a ring offset from that position. Every algorithm commfuse
knows is the same on every rank up to rotation, so ``steps(rank)`` is the
template rotated to the rank's position: O(steps) work, no matter how large the
world (4096 ranks: one rank's steps in a few milliseconds).

Execution contract of one :class:`Step` (the executor, the simulator, the XLA
lowering and the symbolic validator all follow it):

1. post ``sends``, ``recvs`` and ``collectives`` together. A send's payload is
   read as it stands at the start of the step: for all-gather and all-to-all a
   held slice, for reduce-scatter the running sum as accumulated so far;
2. run ``compute`` on every slice it names: all-gather and all-to-all consume a
   held slice; reduce-scatter produces this rank's partial for that output slice;
   produce-all-to-all produces this rank's block for that destination, which a
   later step sends (its payload is read at the start of that step);
3. wait for everything posted in (1); a received slice is usable from here on;
4. for every slice in ``accumulate``, add the running sum received in this step
   into the partial computed in this step (reduce-scatter only).

Each send is matched by exactly one receive on the peer *in the same step* with
the same slice and channel, so posting a step's transfers together cannot
deadlock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from commfuse.schedule._ring import Ring

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable


class Collective(str, enum.Enum):
    """The collective a schedule implements."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    #: The produce side of all-to-all (MoE's combine): each step computes this rank's block for a
    #: destination while the block computed in the step before flies to its own. Its whole-collective
    #: baselines call ``all_to_all``.
    PRODUCE_ALL_TO_ALL = "produce_all_to_all"

    @property
    def blocks(self) -> bool:
        """Whether slices are all-to-all blocks (``SliceId.source`` set): all-to-all and its produce side."""
        return self in (Collective.ALL_TO_ALL, Collective.PRODUCE_ALL_TO_ALL)

    @property
    def transport(self) -> "Collective":
        """The whole collective a baseline of this schedule calls."""
        return Collective.ALL_TO_ALL if self is Collective.PRODUCE_ALL_TO_ALL else self

    def __str__(self) -> str:
        return self.value


class Algorithm(str, enum.Enum):
    """How the collective is laid out against the computation.

    ``ring``: CommFuse, N-1 point-to-point hops each paired with one shard of
    compute; ``bidirectional``: the same with half of every slice travelling
    each way round; ``sliced``: data slicing, ``chunks`` whole collectives each
    hidden behind a neighbouring chunk's compute (Megatron / MindSpeed CoC);
    ``vanilla``: one collective, then all the compute.
    """

    RING = "ring"
    BIDIRECTIONAL = "bidirectional"
    SLICED = "sliced"
    VANILLA = "vanilla"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, order=True, slots=True)
class SliceId:
    """One piece of data a step talks about.

    ``shard`` is a rank: for all-gather the rank whose input shard this is, for
    reduce-scatter the rank that owns this output shard at the end, for
    all-to-all the rank the block is destined for. ``source`` (all-to-all only)
    is the rank whose input holds the block. A shard is cut into
    ``Schedule.pieces`` equal slices along the collective's dim, in the order
    ``part * halves + half`` (``torch.tensor_split`` semantics when it does not
    divide); ``part`` counts the paper's m parts (or the chunks of ``sliced``),
    ``half`` is 0 for the forward ring and 1 for the backward ring of
    ``bidirectional``.
    """

    shard: int
    part: int = 0
    half: int = 0
    source: int | None = None

    def _map(self, f: Callable[[int], int]) -> "SliceId":
        return SliceId(f(self.shard), self.part, self.half, None if self.source is None else f(self.source))

    def __str__(self) -> str:
        text = f"block {self.source}>{self.shard}" if self.source is not None else f"shard {self.shard}"
        if self.part:
            text += f" part {self.part}"
        if self.half:
            text += " (backward half)"
        return text

    def label(self, parts: int = 1, halves: int = 1) -> str:
        text = f"{self.shard}" if self.source is None else f"{self.source}>{self.shard}"
        if parts > 1:
            text += f".{self.part}"
        if halves > 1:
            text += "ab"[self.half]
        return text


@dataclass(frozen=True, slots=True)
class Transfer:
    """One point-to-point message, seen from one end.

    In ``Step.sends``, ``peer`` is the receiver; in ``Step.recvs`` the sender.
    ``shift`` is the number of ring hops from sender to receiver and is the
    same on every rank for a given step and channel, so the step's messages on
    one channel form one permutation (``Ring.pairs(shift)``): exactly what a
    traced backend lowers to a single ``collective_permute``. ``channel``
    tells apart messages that flow between the same two ranks in one step
    (the two directions of ``bidirectional`` with two ranks); backends use it
    as the message tag.
    """

    slice: SliceId
    peer: int
    shift: int
    channel: int = 0


@dataclass(frozen=True)
class CollectiveCall:
    """A whole collective over the group on chunk ``part`` of every shard.

    Used by the ``vanilla`` (one call, ``part`` 0 of 1) and ``sliced`` baselines.
    """

    collective: Collective
    part: int


@dataclass(frozen=True, slots=True)
class Step:
    """One round of one rank's schedule; see the module docstring for its order."""

    index: int
    sends: tuple[Transfer, ...] = ()
    recvs: tuple[Transfer, ...] = ()
    collectives: tuple[CollectiveCall, ...] = ()
    compute: tuple[SliceId, ...] = ()
    accumulate: tuple[SliceId, ...] = ()

    @property
    def communicates(self) -> bool:
        """Whether anything is posted in this step."""
        return bool(self.sends or self.recvs or self.collectives)

    def _map(self, f: Callable[[int], int], memo: dict[int, SliceId] | None = None) -> "Step":
        """This step with every rank ``x`` replaced by ``f(x)``; see ``_map_steps``."""
        return _map_steps((self,), f, {} if memo is None else memo)[0]


def _map_steps(steps: tuple[Step, ...], f: Callable[[int], int], memo: dict[int, SliceId]) -> tuple[Step, ...]:
    """``steps`` with every rank ``x`` replaced by ``f(x)``: the hot path of ``Schedule.steps``.

    ``memo`` (keyed by ``id`` of the template's slices, which builders intern)
    maps each distinct slice once for a whole schedule, and objects are made
    without the frozen dataclass's per-field checks (the fields are set once,
    here, and never again).
    """
    new = object.__new__
    s_shard, s_part, s_half, s_source = _SETTERS[SliceId]
    t_slice, t_peer, t_shift, t_channel = _SETTERS[Transfer]
    p_index, p_sends, p_recvs, p_coll, p_compute, p_acc = _SETTERS[Step]

    def sl(x: SliceId) -> SliceId:
        out = memo.get(id(x))
        if out is None:
            out = new(SliceId)
            s_shard(out, f(x.shard))
            s_part(out, x.part)
            s_half(out, x.half)
            s_source(out, None if x.source is None else f(x.source))
            memo[id(x)] = out
        return out

    def transfers(ts: tuple[Transfer, ...]) -> tuple[Transfer, ...]:
        out = []
        for t in ts:
            m = new(Transfer)
            t_slice(m, sl(t.slice))
            t_peer(m, f(t.peer))
            t_shift(m, t.shift)
            t_channel(m, t.channel)
            out.append(m)
        return tuple(out)

    result = []
    for step in steps:
        m = new(Step)
        p_index(m, step.index)
        p_sends(m, transfers(step.sends) if step.sends else ())
        p_recvs(m, transfers(step.recvs) if step.recvs else ())
        p_coll(m, step.collectives)
        p_compute(m, tuple(map(sl, step.compute)))
        p_acc(m, tuple(map(sl, step.accumulate)) if step.accumulate else ())
        result.append(m)
    return tuple(result)


_SETTERS = {
    cls: tuple(cls.__dict__[f.name].__set__ for f in fields(cls)) for cls in (SliceId, Transfer, Step)
}


@dataclass(frozen=True)
class Schedule:
    """The whole plan of one collective fused with its computation.

    Build it with :func:`commfuse.schedule.build`; ``steps(rank)`` gives one
    rank's steps in order. Fields: the ``collective``, ``world_size``,
    ``algorithm``, ``parts`` (the paper's m), ``chunks`` (``sliced`` only) and
    the ``ring`` whose order and direction place the ranks.
    """

    collective: Collective
    world_size: int
    algorithm: Algorithm
    parts: int = 1
    chunks: int = 1
    ring: Ring = field(default=None)  # type: ignore[assignment]
    template: tuple[Step, ...] = field(default=(), repr=False, compare=False)

    @property
    def halves(self) -> int:
        """2 for ``bidirectional`` (a half of every slice per direction), else 1."""
        return 2 if self.algorithm is Algorithm.BIDIRECTIONAL else 1

    @property
    def splits(self) -> int:
        """How many parts every shard is cut into (``parts``, or ``chunks`` for ``sliced``)."""
        return self.chunks if self.algorithm is Algorithm.SLICED else self.parts

    @property
    def pieces(self) -> int:
        """How many slices every shard is cut into: ``splits * halves``."""
        return self.splits * self.halves

    def piece(self, s: SliceId) -> int:
        """The index of ``s`` among the ``pieces`` slices of its shard."""
        return s.part * self.halves + s.half

    @property
    def num_steps(self) -> int:
        return len(self.template)

    def steps(self, rank: int) -> tuple[Step, ...]:
        """The steps of ``rank``, in order; O(number of steps)."""
        position = self.ring.position(rank)
        if position == 0 and self.ring.is_identity:
            return self.template
        ring = self.ring
        absolute = [ring.rank_at(position + ring.direction * offset) for offset in range(self.world_size)]
        return _map_steps(self.template, absolute.__getitem__, {})

    def peers(self, rank: int) -> tuple[int, ...]:
        """Every rank that ``rank`` exchanges point-to-point messages with, sorted."""
        return tuple(sorted({t.peer for s in self.steps(rank) for t in s.sends + s.recvs}))

    def slices(self, shard: int, source: int | None = None) -> tuple[SliceId, ...]:
        """All slices of one shard, in layout order (see :class:`SliceId`)."""
        return tuple(
            SliceId(shard, part, half, source) for part in range(self.splits) for half in range(self.halves)
        )

    def describe(self) -> str:
        """``build(...)`` call that reproduces this schedule."""
        text = f'build("{self.collective}", {self.world_size}, algorithm="{self.algorithm}"'
        if self.parts != 1:
            text += f", parts={self.parts}"
        if self.chunks != 1:
            text += f", chunks={self.chunks}"
        return text + ")"
