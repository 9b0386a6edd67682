"""The traced XLA backend: a ring step's transfers become ``collective_permute`` ops.

Every XLA process traces the same program (up to the rank-dependent slicing),
so what crosses the wire must be stated globally: a ``collective_permute``
names every (source, target) pair of the group, not one peer. The executor
hands the backend one rank's :class:`~commfuse.schedule.Transfer` objects; each
carries its ``shift`` (ring hops from sender to receiver, the same on every
rank for one step and channel) and its ``channel``. So per step and channel
the backend

1. pairs each receive with the send that mirrors it on this rank (the slice
   this rank sends is the received slice moved ``shift`` hops along the ring,
   which is what the sender held; see :func:`permute_plan`),
2. emits ``xm.collective_permute(payload, pairs=Ring.pairs(shift))`` with the
   pairs mapped to global replica ids, and
3. returns the permutes' results from ``wait``: a permute returns a new lazy
   tensor and there is nothing to wait on. The receive buffers the executor
   offers are ignored.

The compute the executor runs between ``post`` and ``wait`` is ordinary lazy
tensor ops; the dot of step k does not depend on the permute of step k, so
XLA's latency-hiding scheduler is free to run them together (the HLO checks in
:mod:`commfuse_xla.verify` prove that dependency structure per world size).

Whole collectives (the ``vanilla`` and ``sliced`` baselines) map to
``xm.all_gather`` / ``xm.reduce_scatter`` / ``xm.all_to_all`` over the same
replica groups. Blocks are flattened and zero-padded to the largest block so
uneven ``tensor_split`` sizes still make one fixed-shape collective.

What is verified where (see README.md): on XLA:CPU world size 1 executes end
to end; for larger worlds the traced graph's HLO is parsed and checked
without executing it (XLA:CPU cannot run cross-device collectives). On TPU
and XLA:GPU the lowering is UNVERIFIED by execution here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commfuse.errors import BackendUnavailableError, CommfuseTypeError, CommfuseValueError
from commfuse.schedule import Collective, LoweringError, Ring, Transfer, hop_slice, permute_plan
from commfuse_xla.capabilities import CAPABILITIES


# -- pure planning (no torch_xla): testable anywhere --------------------------
# The permutation of each step (hop_slice, permute_plan, LoweringError) is shared with the JAX lowering and
# lives in commfuse.schedule; it is imported above.


def global_pairs(ring: Ring, groups: Sequence[Sequence[int]], shift: int) -> list[list[int]]:
    """``ring.pairs(shift)`` of every replica group, in global replica ids (what XLA wants)."""
    return [[group[s], group[t]] for group in groups for s, t in ring.pairs(shift)]


def normalize_groups(group, world_size: int | None) -> list[list[int]]:
    """Replica groups from what a caller passes as ``group``.

    ``None``: one group of all ``world_size`` replicas; a list of ints: one
    group; a list of lists: every group of a partition (each process then
    rings within its own); a ``torch.distributed`` process group: its ranks.
    """
    if group is None:
        if world_size is None:
            raise CommfuseValueError("xla backend: give group or world_size")
        return [list(range(world_size))]
    try:
        import torch.distributed as dist

        if dist.is_available() and isinstance(group, dist.ProcessGroup):
            return [list(dist.get_process_group_ranks(group))]
    except (ImportError, RuntimeError):  # pragma: no cover - torch without distributed
        pass
    if isinstance(group, (list, tuple)) and group and all(isinstance(g, (list, tuple)) for g in group):
        groups = [[int(r) for r in g] for g in group]
    elif isinstance(group, (list, tuple)) and group and all(isinstance(r, int) and not isinstance(r, bool) for r in group):
        groups = [[int(r) for r in group]]
    else:
        raise CommfuseTypeError(
            f"xla backend: group must be None, a list of replica ids, a list of such lists, or a process group; "
            f"got {type(group).__name__} {group!r}"
        )
    sizes = {len(g) for g in groups}
    if len(sizes) != 1 or 0 in sizes:
        raise CommfuseValueError(f"xla backend: replica groups must be non-empty and of one size, got {groups}")
    flat = [r for g in groups for r in g]
    if len(set(flat)) != len(flat) or min(flat) < 0:
        raise CommfuseValueError(f"xla backend: replica groups must not share or repeat replicas, got {groups}")
    return groups


# -- the backend ---------------------------------------------------------------


class _Ready:
    """A traced step: what arrived is already known as lazy tensors; nothing to wait on."""

    __slots__ = ("outputs",)

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        self.outputs = outputs

    def wait(self, timeout: float) -> list[torch.Tensor]:
        return self.outputs


def _xm():
    try:
        import torch_xla.core.xla_model as xm
    except ImportError as e:
        raise BackendUnavailableError(
            f"the xla backend needs torch_xla ({e}); install torch-xla for this torch in its own environment "
            "(see backends/xla/README.md, or bash ci/setup_xla.sh)"
        ) from e
    return xm


class XlaBackend:
    """commfuse's Backend protocol over torch_xla collectives (traced).

    ``rank`` and ``world_size`` are this process's position in its replica
    group and the group's size; by default they come from the XLA runtime
    (``xr.global_ordinal()``, ``xr.world_size()``). Passing them explicitly
    traces the program of any rank of any world size on a single device,
    which is how the HLO checks look at world sizes XLA:CPU cannot run.
    ``groups`` (a partition of the replicas into equal rings) defaults to one
    group of everything; then ``rank`` is the replica id.
    """

    name = "xla"
    # Carried by objects made directly too, so the executor can tell a traced backend without the registry.
    capabilities = CAPABILITIES

    def __init__(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        groups=None,
        replica: int | None = None,
        device=None,
        pin_layout: bool = True,
    ) -> None:
        xm = _xm()
        import torch_xla.runtime as xr

        if groups is None:
            n = xr.world_size() if world_size is None else world_size
            self.groups = normalize_groups(None, n)
            replica = (xr.global_ordinal() if rank is None else rank) if replica is None else replica
        else:
            if rank is not None or world_size is not None:
                raise CommfuseValueError("xla backend: with groups, give replica= (the global id), not rank/world_size")
            self.groups = normalize_groups(groups, None)
            replica = xr.global_ordinal() if replica is None else replica
        mine = [g for g in self.groups if replica in g]
        if len(mine) != 1:
            raise CommfuseValueError(f"xla backend: replica {replica} is in none of the groups {self.groups}")
        self.group = mine[0]
        self.replica = replica
        self.rank = self.group.index(replica)
        self.world_size = len(self.group)
        self.ring = Ring(self.world_size)
        if device is None:
            import torch_xla

            device = torch_xla.device() if hasattr(torch_xla, "device") else xm.xla_device()
        self.device = torch.device(device)
        self.pin_layout = pin_layout
        self._pairs: dict[int, list[list[int]]] = {}

    @classmethod
    def from_group(cls, group=None, device=None) -> "XlaBackend":
        """What the plugin factory makes: the runtime's ranks, optionally split by ``group``."""
        if group is None:
            return cls(device=device)
        import torch_xla.runtime as xr

        return cls(groups=normalize_groups(group, xr.world_size()), device=device)

    def __repr__(self) -> str:
        return f"XlaBackend(rank={self.rank}, world_size={self.world_size}, groups={self.groups}, device={self.device})"

    def pairs(self, shift: int) -> list[list[int]]:
        """The global source-target pairs of one permute ``shift`` hops along the ring."""
        found = self._pairs.get(shift)
        if found is None:
            found = self._pairs[shift] = global_pairs(self.ring, self.groups, shift)
        return found

    # -- Backend protocol --

    def post(self, sends: Sequence[tuple[Transfer, torch.Tensor]], recvs: Sequence[tuple[Transfer, torch.Tensor]]):
        xm = _xm()
        plan = permute_plan(self.ring, self.rank, [t for t, _ in sends], [t for t, _ in recvs])
        outputs = []
        for (t, buffer), (index, shift, channel) in zip(recvs, plan):
            payload = sends[index][1]
            if list(payload.shape) != list(buffer.shape) or payload.dtype != buffer.dtype:
                raise LoweringError(
                    f"rank {self.rank}: channel {channel} sends {sends[index][0].slice} as "
                    f"{payload.dtype}{list(payload.shape)} but receives {t.slice} as {buffer.dtype}{list(buffer.shape)}; "
                    "a collective-permute moves one shape on every replica: make the sharded dim divide by the "
                    f"world size {self.world_size}"
                )
            outputs.append(xm.collective_permute(payload, pairs=self.pairs(shift)))
        return _Ready(outputs)

    def collective(self, kind: Collective, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]):
        xm = _xm()
        n = self.world_size
        kind = Collective(kind)
        width = max([x.numel() for x in inputs] + [o.numel() for o in outputs] + [1])

        def flat(x: torch.Tensor) -> torch.Tensor:
            x = x.reshape(-1)
            return x if x.numel() == width else torch.nn.functional.pad(x, (0, width - x.numel()))

        def unflat(row: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            return row[: like.numel()].reshape(like.shape)

        if kind is Collective.ALL_GATHER:
            # pin_layout=False: the pinned variant is an all-reduce over padding placed by the runtime's ordinal.
            got = xm.all_gather(flat(inputs[0]).unsqueeze(0), dim=0, groups=self.groups, pin_layout=False)
            return _Ready([unflat(got[q], outputs[q]) for q in range(n)])
        stacked = torch.stack([flat(x) for x in inputs])
        if kind is Collective.REDUCE_SCATTER:
            got = xm.reduce_scatter(xm.REDUCE_SUM, stacked, 1.0, 0, n, groups=self.groups, pin_layout=self.pin_layout)
            return _Ready([unflat(got[0], outputs[0])])
        got = xm.all_to_all(stacked, 0, 0, n, groups=self.groups, pin_layout=self.pin_layout)
        return _Ready([unflat(got[q], outputs[q]) for q in range(n)])

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        # Never filled: a traced post returns the permutes' own results. Lazy, so it costs nothing.
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)
