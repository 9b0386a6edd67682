"""A per-call digest that travels beside a call's own transfers, so that the ranks learn whether they passed the
same per-call inputs (ring attention's document lengths, a layer's mask) without an exchange of their own.

Each rank holds a digest of its inputs and a flag, 0 at the start. In plain code::

    flag = 0
    for step in call.steps:                         # every step point-to-point (a ring, ring:m, bidirectional)
        to each peer the step sends to:     also send    [digest, flag]
        from each peer it receives from:    also receive [their_digest, their_flag]
        after the step's wait:              flag |= their_flag or their_digest != digest
    return "differ" if flag else "agree"            # the same answer on every rank

Why every rank ends with the same answer: in an all-gather every rank's shard reaches every other rank along a
chain of transfers, each posted after the one before it was received (in a reduce-scatter every rank's
partial reaches every result the same way, summed on the way), and the pair ``[digest, flag]`` rides on each. If rank ``o`` and rank ``r`` passed different inputs, some link of the chain from ``o`` to ``r``
joins two ranks that differ, its receiver sets its flag there, and the flag rides the rest of the chain to
``r``. Every rank differs from some rank when any two differ, so every rank learns it. A call that posted a
whole collective (``vanilla``, ``sliced``), or no transfer at all, gives no answer: the caller compares in an
exchange of its own (``commfuse.planning.agreement.agree_shared``).

The pair is 16 bytes a message, on its own tag (:data:`commfuse.runtime.groups.RIDER_CHANNEL` on the call's
tag base), posted with the step's messages and waited with them: no extra round trip. Only a host-waited
transport carries it (gloo on the CPU), where what arrives is read on the host at no cost; on a device the
flag would have to be read back after the call, a wait of the host on the device that a stream-ordered
backend exists to avoid, so the caller compares in its own exchange there (unmeasured: no device was lent).
A drained call (``commfuse.runtime.drain``) gives every message its other end, the pairs included: they are
in the call's accounts like any message.
"""

from __future__ import annotations

import torch

from commfuse.runtime.groups import RIDER_CHANNEL
from commfuse.schedule import SliceId, Transfer

__all__ = ["Rider"]

_TRANSFERS: dict[int, Transfer] = {}


def _transfer(peer: int) -> Transfer:
    """The pair's message to or from ``peer`` (one a step each way, whatever the step's own messages)."""
    t = _TRANSFERS.get(peer)
    if t is None:
        t = _TRANSFERS[peer] = Transfer(SliceId(peer), peer, 0, RIDER_CHANNEL)
    return t


class Rider:
    """One call's digest and flag (see the module). ``wholes`` counts the whole collectives the call posted,
    ``rides`` the steps the pair rode."""

    __slots__ = ("digest", "flag", "rides", "wholes")

    def __init__(self, digest: int) -> None:
        if not 0 <= digest < 1 << 63:
            raise ValueError(f"a rider's digest is below 2**63 and not negative, got {digest}")
        self.digest, self.flag, self.rides, self.wholes = digest, 0, 0, 0

    def extend(self, sends, recvs) -> tuple[list, list, list[torch.Tensor]]:
        """A step's ``sends`` and ``recvs`` with the pair added, one message per peer each way, and the receive
        buffers of the pairs that arrive (for :meth:`absorb`)."""
        self.rides += 1
        mine = torch.tensor((self.digest, self.flag), dtype=torch.int64)
        sends = list(sends) + [(_transfer(p), mine) for p in dict.fromkeys(t.peer for t, _ in sends)]
        theirs = [(_transfer(p), torch.empty(2, dtype=torch.int64)) for p in dict.fromkeys(t.peer for t, _ in recvs)]
        return sends, list(recvs) + theirs, [x for _, x in theirs]

    def absorb(self, arrived: list[torch.Tensor]) -> None:
        """What a step's pairs said, once its wait returned."""
        for x in arrived:
            digest, flag = x.tolist()
            if flag or digest != self.digest:
                self.flag = 1

    def verdict(self) -> bool | None:
        """True: every rank passed the same inputs; False: some differ (every rank says so); None: the call
        gave no answer (a whole collective, or no step that rode)."""
        if self.wholes or not self.rides:
            return None
        return not self.flag
