"""The Backend protocol: what the step loop (``commfuse.runtime.walks``) asks of a transport.

A backend moves tensors; it never decides what to move. The loop gives it
one step's transfers at a time and later asks for what arrived. The protocol
is shaped so that eager transports (gloo, NCCL, HCCL: post now, a handle to
wait on later) and traced ones (XLA: a transfer *is* a ``collective_permute``
that returns a new lazy tensor, with nothing to wait on) fit the same loop
without special cases:

* ``post(sends, recvs)`` starts a step's point-to-point transfers and returns
  a :class:`Handle`. ``recvs`` carries, per transfer, a buffer the backend may
  receive into (eager) or ignore (traced);
* ``Handle.wait(timeout)`` returns the received tensors, in ``recvs`` order.
  An eager backend returns its buffers once the data is there (host-blocking on
  gloo, stream-ordered on NCCL/HCCL); a traced backend returns the tensors its
  permutes produced, immediately;
* ``collective(kind, inputs, outputs)`` does the same for one whole
  collective (the ``vanilla`` and ``sliced`` baselines); ``wait`` returns the
  outputs.

Because every transfer of a step carries its ``shift`` and ``channel`` (see
``commfuse.schedule.Transfer``), a traced backend can turn a step's messages
on one channel into one permutation, ``Ring.pairs(shift)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from commfuse.schedule import Collective, Transfer


@runtime_checkable
class Handle(Protocol):
    def wait(self, timeout: float) -> list["torch.Tensor"]:
        """Block until done (at most ``timeout`` seconds; raise ``TimeoutError`` after) and return what arrived."""


@runtime_checkable
class Backend(Protocol):
    name: str
    capabilities: object  # commfuse.plugins.Capabilities (set by commfuse.backends.get when the object has none)
    rank: int  # this process's rank in the group
    world_size: int
    device: "torch.device"

    def post(
        self,
        sends: Sequence[tuple["Transfer", "torch.Tensor"]],
        recvs: Sequence[tuple["Transfer", "torch.Tensor"]],
    ) -> Handle:
        """Start one step's transfers together; ``Transfer.peer`` is a rank of the group."""

    def collective(
        self, kind: "Collective", inputs: Sequence["torch.Tensor"], outputs: Sequence["torch.Tensor"]
    ) -> Handle:
        """Start one whole collective over the group.

        all_gather: ``inputs = [mine]``, ``outputs`` one per rank;
        reduce_scatter: ``inputs`` one partial per rank, ``outputs = [mine]`` (sum);
        all_to_all: ``inputs`` one block per destination, ``outputs`` one per source. When the blocks may
        differ in size (an uneven all-to-all), ``inputs`` and ``outputs`` are :class:`Uneven` lists on every
        rank of the call, even a rank whose own blocks happen to be alike: a backend that runs uneven
        exchanges another way must decide on that, never on its own blocks' shapes.
        """

    def empty(self, shape: Sequence[int], dtype: "torch.dtype") -> "torch.Tensor":
        """A receive buffer on the backend's device."""


class Uneven(list):
    """The blocks of an uneven whole all-to-all (see :meth:`Backend.collective`): a list, marked."""

    __slots__ = ()


# Optional: ``collective_into(kind, input, output) -> Handle`` runs one whole all-gather or reduce-scatter
# over single tensors laid out rank by rank along dim 0 of the bigger one (torch's
# ``all_gather_into_tensor`` / ``reduce_scatter_tensor``). Programs use it for ``vanilla`` over even shards,
# where it saves the per-rank buffer lists and a concatenation; backends without it get ``collective``.
#
# Optional: ``poison()`` closes this rank's connections of the group (the group was declared dead; see
# ``commfuse.runtime.board``), so that peers waiting on it fail at once instead of waiting out their timeout.
#
# A transport whose ``Handle.wait`` blocks the host should wait through ``commfuse.runtime.waiting.wait_blocking``
# (``C10dBackend``'s handles do): the wait is then interruptible, bounded by commfuse's timeout, and past the
# grace period reads the group's board, which is how a rank hears that a peer of the call failed, called
# something else, or is late. A wait that blocks inside the transport until its own timeout hears nothing:
# the conformance suite's one-rank robustness cases fail it.
#
# Optional: ``native_op(op, **signature) -> (runner or None, reason)`` offers the backend's own fused kernel
# for a whole op named in ``capabilities.native_fused_ops`` ("all_gather_matmul", "matmul_reduce_scatter").
# The ops ask once per call signature, when ``algorithm`` is "native" or "auto"; ``signature`` holds example
# tensors and the op's options (see ``commfuse.ops``); ``runner(*tensors)`` must return what the op returns
# without it (all_gather_matmul: ``(gathered or None, [a @ b for b in bs])``; matmul_reduce_scatter: the
# reduced shard). ``reason`` says why the call does or does not qualify; it reaches ``report``.
#
# Optional: ``run_op(op, **arguments)`` runs a whole op listed in ``capabilities.whole_ops`` inside the backend's
# own graph, where the rank is a value of the graph (one program for every rank: JAX's ``shard_map``) and the
# step loop, which needs it as an int, cannot walk. ``arguments`` are the public op's own, by name, as the caller
# gave them (tensors, callables, dims, ``algorithm``, ``group``); what ``run_op`` returns is the op's result.
