"""A step's transfers as permutations of the ranks: what a traced backend lowers each channel to.

A traced backend (the XLA and JAX lowerings) emits one ``collective_permute``
per receive of a step, naming every (source, target) pair of the ring at once,
because every rank runs the same program. :func:`permute_plan` pairs each of
one rank's receives with the send that feeds the same permutation on this
rank; by the rotation symmetry of every commfuse schedule, the rank that sends
slice ``x`` to us sends it in the same position as we send ``x`` moved
``shift`` hops along the ring (:func:`hop_slice`). Pure Python: the lowerings
and their checks import it from here.
"""

from __future__ import annotations

from collections.abc import Sequence

from commfuse.errors import CommfuseValueError
from commfuse.schedule._ir import SliceId, Transfer
from commfuse.schedule._ring import Ring

__all__ = ["LoweringError", "hop_slice", "permute_plan"]


class LoweringError(CommfuseValueError):
    """A step cannot be lowered to permutations (the message names rank, channel, shift and slice)."""


def hop_slice(ring: Ring, x: SliceId, hops: int) -> SliceId:
    """``x`` with every rank in it moved ``hops`` steps along ``ring``."""
    return SliceId(
        ring.hop(x.shard, hops), x.part, x.half, None if x.source is None else ring.hop(x.source, hops)
    )


def permute_plan(
    ring: Ring, rank: int, sends: Sequence[Transfer], recvs: Sequence[Transfer]
) -> list[tuple[int, int, int]]:
    """For each receive, in order: ``(index of the send that feeds its permute, shift, channel)``.

    On every rank the i-th permute of a step must carry matching data: rank r
    receives slice ``x`` from ``ring.prev(r, shift)``, which sent ``x`` in its
    own i-th permute; by the rotation symmetry of every commfuse schedule rank
    r sends ``hop_slice(x, shift)`` in the same position. Raises
    :class:`LoweringError` when a transfer has no partner (the step is not a
    permutation per channel) or its peer is not where the ring puts it.
    """
    unused = set(range(len(sends)))
    for t in sends:
        expect = ring.next(rank, t.shift)
        if t.peer != expect:
            raise LoweringError(
                f"rank {rank}: a send of {t.slice} on channel {t.channel} goes to rank {t.peer}, but "
                f"{t.shift} hop(s) along the ring {list(ring.order)} (direction {ring.direction:+d}) is rank {expect}; "
                "a traced backend lowers a channel's messages to one permutation of that ring"
            )
    plan = []
    for t in recvs:
        expect = ring.prev(rank, t.shift)
        if t.peer != expect:
            raise LoweringError(
                f"rank {rank}: a receive of {t.slice} on channel {t.channel} comes from rank {t.peer}, but "
                f"{t.shift} hop(s) back along the ring {list(ring.order)} is rank {expect}"
            )
        mirror = hop_slice(ring, t.slice, t.shift)
        match = next(
            (i for i in sorted(unused)
             if sends[i].slice == mirror and sends[i].shift == t.shift and sends[i].channel == t.channel),
            None,
        )
        if match is None:
            raise LoweringError(
                f"rank {rank}: receiving {t.slice} from rank {t.peer} on channel {t.channel} (shift {t.shift}) "
                f"needs this rank to send {mirror} on the same channel in the same step, and it does not; "
                "a traced backend needs every rank to send and receive once per permute"
            )
        unused.discard(match)
        plan.append((match, t.shift, t.channel))
    if unused:
        t = sends[min(unused)]
        raise LoweringError(
            f"rank {rank}: the send of {t.slice} to rank {t.peer} on channel {t.channel} (shift {t.shift}) "
            "has no receive on this rank in the same step; a collective-permute sends and receives on every rank"
        )
    return plan
