"""The ring: which rank sits at which position, and who is next.

Every peer computation in commfuse goes through a :class:`Ring`; nothing else
does ``(rank + 1) % world_size`` arithmetic (JAX's collective-matmul docs bind
their ``perm`` once in the same spirit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from commfuse.errors import ScheduleError


@dataclass(frozen=True)
class Ring:
    """A cyclic order of ``world_size`` ranks and a direction of travel.

    ``order[i]`` is the rank at ring position ``i`` (default: rank ``i``);
    ``direction`` is ``+1`` (data travels to increasing positions) or ``-1``.
    ``next(rank)`` is where ``rank`` sends in a unidirectional ring and
    ``prev(rank)`` where it receives from.
    """

    world_size: int
    order: tuple[int, ...] = ()
    direction: int = 1
    _position: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.world_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ScheduleError(f"world_size must be an integer >= 1, got {n!r}")
        order = tuple(self.order) if self.order else tuple(range(n))
        if sorted(order) != list(range(n)):
            raise ScheduleError(
                f"ring order must be a permutation of ranks 0..{n - 1}, got {list(order)}"
            )
        if self.direction not in (1, -1):
            raise ScheduleError(f"ring direction must be +1 or -1, got {self.direction!r}")
        position = [0] * n
        for pos, rank in enumerate(order):
            position[rank] = pos
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "_position", tuple(position))

    @property
    def is_identity(self) -> bool:
        """Rank order, travelling to rank + 1: ring offsets are ranks."""
        return self.direction == 1 and self.order == tuple(range(self.world_size))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ScheduleError(f"rank {rank} is outside the ring of world size {self.world_size}")

    def position(self, rank: int) -> int:
        """The ring position of ``rank``."""
        self._check_rank(rank)
        return self._position[rank]

    def rank_at(self, position: int) -> int:
        """The rank at ``position`` (taken modulo the world size)."""
        return self.order[position % self.world_size]

    def hop(self, rank: int, hops: int) -> int:
        """The rank ``hops`` steps from ``rank`` along the direction (negative: against it)."""
        return self.rank_at(self.position(rank) + self.direction * hops)

    def next(self, rank: int, hops: int = 1) -> int:
        """Where ``rank`` sends to: ``hops`` steps along the direction."""
        return self.hop(rank, hops)

    def prev(self, rank: int, hops: int = 1) -> int:
        """Where ``rank`` receives from: ``hops`` steps against the direction."""
        return self.hop(rank, -hops)

    def reversed(self) -> "Ring":
        """The same order travelled the other way."""
        return Ring(self.world_size, self.order, -self.direction)

    def pairs(self, shift: int = 1) -> tuple[tuple[int, int], ...]:
        """``(source, target)`` for every rank when each sends ``shift`` hops on.

        This is the whole permutation of one ring step, as XLA's
        ``collective_permute`` wants it.
        """
        return tuple((rank, self.hop(rank, shift)) for rank in self.order)
