"""Deliberately broken backends: the conformance suite must catch each one, with the test you would expect.

Each is the real gloo backend with one fault: ``wrong_peer`` delivers every
message one rank too far, ``dropped_message`` never sends one message per
step, ``wrong_reduction`` reduces whole reduce-scatters with max instead of sum.
"""

from __future__ import annotations

import torch.distributed as dist

from commfuse.runtime.c10d import C10dBackend, _Handle
from commfuse.schedule import Collective


class WrongPeer(C10dBackend):
    def post(self, sends, recvs):
        moved = [(type(t)(t.slice, (t.peer + 1) % self.world_size, t.shift, t.channel), x) for t, x in sends]
        return super().post(moved, recvs)


class DroppedMessage(C10dBackend):
    def post(self, sends, recvs):
        return super().post(list(sends)[1:], recvs)  # the first send of every step is lost


class WrongReduction(C10dBackend):
    def collective(self, kind, inputs, outputs):
        if kind is Collective.REDUCE_SCATTER:
            work = dist.reduce_scatter(outputs[0], list(inputs), op=dist.ReduceOp.MAX, group=self.group,
                                       async_op=True)
            return _Handle([work], list(outputs), list(inputs) + list(outputs))
        return super().collective(kind, inputs, outputs)


def wrong_peer(group=None, device=None):
    return WrongPeer(group, device, name="toy-wrong-peer")


def dropped_message(group=None, device=None):
    return DroppedMessage(group, device, name="toy-dropped-message")


def wrong_reduction(group=None, device=None):
    return WrongReduction(group, device, name="toy-wrong-reduction")


class FastCapabilities:
    """Short timeouts: a broken backend's tests end in seconds."""

    def __new__(cls):
        from commfuse.testing import Capabilities

        caps = Capabilities()
        caps.timeout_s = 3.0
        return caps
