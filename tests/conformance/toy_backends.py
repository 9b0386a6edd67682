"""Deliberately broken backends: the conformance suite must catch each one, with the test you would expect.

Each is the real gloo backend with one fault: ``wrong_peer`` delivers every
message one rank too far, ``dropped_message`` never sends one message per
step, ``wrong_reduction`` reduces whole reduce-scatters (of tensor lists or
into one tensor) with max instead of sum, ``corrupt_data`` adds 1 to every
floating-point message it receives (not the call check's fingerprints),
``falsely_capturable`` declares ``Capabilities.capturable`` on CPU, where
there is no device graph to capture into, ``drops_empty_blocks`` hands back
only the non-empty blocks of a whole all-to-all (a transport that forgets
that an uneven exchange's empty blocks still hold their places),
``waits_without_the_board`` is a backend written from the Backend protocol
alone: its handle waits in the transport for the timeout, as ``Handle.wait``
asks, so it never reads the group's board, and nothing closes its
connections when its group is declared dead (it has no ``poison``).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from commfuse.plugins import Capabilities
from commfuse.runtime.c10d import C10dBackend, _Handle
from commfuse.runtime.groups import FINGERPRINT_CHANNEL
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

    def collective_into(self, kind, input, output):  # vanilla over even shards runs into one tensor
        if kind is Collective.REDUCE_SCATTER:
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            return _Handle([self.group._reduce_scatter_base(output, input, opts)], [output], (input, output))
        return super().collective_into(kind, input, output)


class _Corrupting:
    def __init__(self, handle, data):
        self.handle, self.data = handle, data

    def wait(self, timeout):
        got = self.handle.wait(timeout)
        for t, data in zip(got, self.data):
            if data and t.is_floating_point():
                t.add_(1)
        return got


class CorruptData(C10dBackend):
    def post(self, sends, recvs):
        return _Corrupting(super().post(sends, recvs), [t.channel != FINGERPRINT_CHANNEL for t, _ in recvs])


class _NonEmptyOnly:
    def __init__(self, handle):
        self.handle = handle

    def wait(self, timeout):
        return [t for t in self.handle.wait(timeout) if t.numel()]


class DropsEmptyBlocks(C10dBackend):
    def collective(self, kind, inputs, outputs):
        handle = super().collective(kind, inputs, outputs)
        return _NonEmptyOnly(handle) if kind is Collective.ALL_TO_ALL else handle


class _TransportWait:
    """A step's works, waited for in the transport: received tensors, or ``TimeoutError`` after ``timeout``."""

    def __init__(self, works, outputs):
        self.works, self.outputs = works, outputs

    def wait(self, timeout):
        try:
            for work in self.works:
                work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise TimeoutError(str(e)) from e
            raise
        return self.outputs


class WaitsWithoutTheBoard(C10dBackend):
    """Moves every message right; only its waits and its end differ from the c10d backend's."""

    def post(self, sends, recvs):
        base = self._tag_base  # the call number's tags, so that calls still never pair across
        works = [self.group.send([x], t.peer, t.channel + base) for t, x in sends]
        works += [self.group.recv([x], t.peer, t.channel + base) for t, x in recvs]
        return _TransportWait(works, [x for _, x in recvs])

    def poison(self):
        pass


class FalselyCapturable(C10dBackend):
    capabilities = Capabilities(bidirectional_links=True, overlap=True, capturable=True)


def waits_without_the_board(group=None, device=None):
    return WaitsWithoutTheBoard(group, device, name="toy-waits-without-the-board")


def falsely_capturable(group=None, device=None):
    return FalselyCapturable(group, device, name="toy-falsely-capturable")


def drops_empty_blocks(group=None, device=None):
    return DropsEmptyBlocks(group, device, name="toy-drops-empty-blocks")


def wrong_peer(group=None, device=None):
    return WrongPeer(group, device, name="toy-wrong-peer")


def dropped_message(group=None, device=None):
    return DroppedMessage(group, device, name="toy-dropped-message")


def wrong_reduction(group=None, device=None):
    return WrongReduction(group, device, name="toy-wrong-reduction")


def corrupt_data(group=None, device=None):
    return CorruptData(group, device, name="toy-corrupt-data")


class FastCapabilities:
    """Short timeouts: a broken backend's tests end in seconds."""

    def __new__(cls):
        from commfuse.testing import Capabilities

        caps = Capabilities()
        caps.timeout_s = 3.0
        return caps


class AllToAllCapabilities:
    """Short timeouts, float32, the ring and vanilla only: the all-to-all schedules of a broken whole
    all-to-all in seconds, the ring's (point-to-point) before any whole one."""

    def __new__(cls):
        caps = FastCapabilities()
        caps.dtypes, caps.algorithms = ("float32",), ("ring", "vanilla")
        return caps
