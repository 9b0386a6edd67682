"""Shared pieces of the layers: groups and meshes, shard sizes, gathering weights back."""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch import nn

from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.runtime import sites
from commfuse.planning.agreement import agree
from commfuse.planning.calls import resolve_call
from commfuse.planning.all_reduce import group_sum
from commfuse.planning.consumers import collect
from commfuse.planning.derive import layer_config
from commfuse.planning.gather import all_gather_consume_core
from commfuse.runtime.fingerprints import dtype_name, register_format
from commfuse.runtime.fingerprints import config_words  # noqa: F401 - the layers name their string options with it
from commfuse.schedule import Collective, offsets, site_algorithm, split_sizes


def resolve_group(group):
    """A process group from ``None`` (the default group), a group, or a 1-D ``DeviceMesh`` (``mesh["tp"]``)."""
    if group is None:
        return None
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without device_mesh
        DeviceMesh = ()  # noqa: N806
    if DeviceMesh and isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise CommfuseValueError(
                f"a {group.ndim}-D DeviceMesh was given as group; pass the 1-D sub-mesh of the axis this layer "
                f"shards over, e.g. mesh[{group.mesh_dim_names[0] if group.mesh_dim_names else '<axis name>'!r}]"
            )
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    raise CommfuseTypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}")


def algorithm_option(*collectives, native: bool = False) -> property:
    """A layer's ``algorithm`` attribute: checked for the ``collectives`` its ops run it on whenever it is set
    (when the layer is built, and after), so a misspelling is named there and not at the first forward."""

    def get(self):
        return self._algorithm

    def put(self, value) -> None:
        self._algorithm = site_algorithm(type(self).__name__, value, *collectives, native=native)

    return property(get, put, doc="the algorithm of the layer's fused ops (``commfuse.schedule.parse_algorithm``)")


def site_forward(forward):
    """A layer's ``forward``, run as the layer's site (``commfuse.runtime.sites``): what its ops take is
    written down on it for ``COMMFUSE_LOG`` and ``commfuse.explain``. Traced as it is under torch.compile."""

    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return forward(self, *args, **kwargs)
        with sites.at_site(sites.layer_site(self)):
            return forward(self, *args, **kwargs)

    setattr(run, sites.LAYER_FORWARD, True)  # the layer is a site: commfuse.explain and the names find it unrun
    return run


def config(layer: str, *more: tuple[str, object], **options) -> tuple:
    """A layer's options for its ops' fingerprints (``planning.derive.layer_config``): ``more``, ``(name, value)``
    pairs from the module that holds the layer (a ``ParallelMLP``'s activation), then the layer's own."""
    return layer_config(layer, **dict(more), **options)


def world(group) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without torch.distributed."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard_range(size: int, rank: int, n: int) -> tuple[int, int]:
    """(start, length) of rank's ``torch.tensor_split`` piece of ``size``."""
    sizes = split_sizes(size, n)
    return offsets(sizes)[rank], sizes[rank]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a parameter: a DTensor's local tensor (a view that shares its storage), else ``t``."""
    # isinstance, not getattr(t, "to_local"): torch.compile resolves the former on a DTensor, not the latter
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def contiguous_stride(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (what ``DTensor.from_local`` wants with a ``shape``)."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


def mesh_of(group, device) -> "object | None":
    """A 1-D DeviceMesh over ``group`` (None: the default group) for DTensor parameters, or None when there is
    no distributed world (one process: plain tensors are every parameter's whole)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.device_mesh import DeviceMesh

    device_type = torch.device(device).type if device is not None else "cpu"
    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device_type)


def is_mesh(group) -> bool:
    """Whether ``group`` is a DeviceMesh (a layer's group may be one: it is then its parameters' mesh)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without device_mesh
        return False
    return isinstance(group, DeviceMesh)


def layer_mesh(group, resolved, world_size: int, device):
    """The mesh of a layer's DTensor parameters: ``group`` itself when it is a 1-D DeviceMesh, else one over
    the ``resolved`` process group; None at world size 1 (plain tensors are then the whole)."""
    if world_size == 1:
        return None
    return group if is_mesh(group) else mesh_of(resolved, device)


def as_param(t: torch.Tensor, mesh, placement, full_shape) -> nn.Parameter:
    """``t`` (this rank's piece) as a parameter: a DTensor placed ``placement`` on ``mesh`` with the whole
    layer's ``full_shape``, so that ``clip_grad_norm_``, ``state_dict``, checkpoints and optimizers see the
    whole; ``t`` itself when ``mesh`` is None."""
    return nn.Parameter(as_dtensor(t, mesh, placement, full_shape))


def as_dtensor(t: torch.Tensor, mesh, placement, full_shape) -> torch.Tensor:
    """``t`` (this rank's piece) as a DTensor placed ``placement`` on ``mesh`` (``t`` when ``mesh`` is None)."""
    if mesh is None:
        return t
    from torch.distributed.tensor import DTensor

    full = torch.Size(full_shape)
    return DTensor.from_local(t, mesh, [placement], run_check=False, shape=full, stride=contiguous_stride(full))


def even(what: str, size: int, n: int, name: str) -> None:
    """Refuse a dim that does not split evenly over the ranks: a DTensor's pieces are ``torch.chunk``'s."""
    if n > 1 and size % n:
        raise CommfuseValueError(
            f"{name}: {what} = {size} does not divide by the group size {n}: its parameters are DTensors, whose "
            f"shards must all be alike here; pick sizes divisible by {n}, or use commfuse.tp's styles on an "
            "nn.Linear (DTensor's own uneven layout)"
        )


def gather_dim(t: torch.Tensor, dim: int, full: int, group, *, what: str = "a sharded parameter") -> torch.Tensor:
    """The whole tensor from every rank's ``tensor_split`` piece along ``dim`` (exact copy, uneven allowed).

    Through commfuse, so numbered with the group's other calls and bounded by commfuse's timeout. In plain
    code::

        agree(this rank's piece is tensor_split(full, n)[rank] along dim; the whole shape, dim, dtype)
        padded = this rank's piece, zero-padded along dim to the biggest piece
        parts = all_gather(padded.flatten())    # every rank's padded piece alike: one signature
        return cat(part.view(padded.shape).narrow(dim, 0, sizes[q]) for q, part in enumerate(parts))

    A rank whose piece is not its ``tensor_split`` share raises its own ``CommfuseValueError`` and every
    other rank a ``PeerFailedError`` naming it; ranks that gather other wholes (shape, dim or dtype) raise
    ``MismatchError`` naming them; nothing is gathered then and the group stays usable. ``what`` names the
    tensor in those errors."""
    rank, n = world(group)
    t = local(t)
    if n == 1:
        return t.detach().clone()
    sizes = split_sizes(full, n)
    d = dim % t.ndim if -t.ndim <= dim < t.ndim else dim

    def piece() -> torch.Tensor:
        if not 0 <= d < t.ndim:
            raise CommfuseValueError(f"rank {rank}: gathering {what}: dim {dim} is out of range for its "
                                     f"{t.ndim}-D piece {list(t.shape)}")
        if t.shape[d] != sizes[rank]:
            raise CommfuseValueError(
                f"rank {rank}: gathering {what}: its piece {list(t.shape)} has {t.shape[d]} along dim {d}, but "
                f"tensor_split of {full} over {n} ranks gives rank {rank} {sizes[rank]} ({sizes})")
        return t

    def whole(_) -> list[tuple[str, object]]:
        shape = list(t.shape)
        shape[d] = full
        return [("the whole shape", str(shape)), ("dim", d), ("dtype", str(t.dtype).removeprefix("torch."))]

    agree(dist.group.WORLD if group is None else group, f"gathering {what}", piece, whole, label="nn.gather_dim.agree", device=t.device,
          so="no rank gathers it (nothing was sent; the group is usable)")
    shape = list(t.shape)
    shape[d] = max(sizes)
    padded = t.new_zeros(shape)
    padded.narrow(d, 0, t.shape[d]).copy_(t.detach())
    call = resolve_call(Collective.ALL_GATHER, "vanilla", group=group, device=t.device)
    with torch.no_grad():
        parts = all_gather_consume_core(call, padded.reshape(-1), collect, 0, label="nn.gather_dim")
    return torch.cat([p.view(shape).narrow(d, 0, s) for p, s in zip(parts, sizes)], dim=d)


class ReplicatedGrad(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group.

    For parameters replicated over a group whose ranks each see a different
    part of the data (the bias of a row-parallel layer under sequence
    parallelism): every rank must step with the gradient of the whole.
    """

    @staticmethod
    def forward(ctx, t: torch.Tensor, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        # through commfuse (numbered, bounded by its timeout, told to every rank), not a raw all_reduce
        return group_sum(g, ctx.group, label="replicated_grad"), None



class ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale`` (``commfuse.nn.MoE``'s replicated
    parameters: their gradient averaged over its group, after :func:`replicated` summed it)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


def replicated(t: torch.Tensor, group) -> torch.Tensor:
    _, n = world(group)
    if n == 1 or not torch.is_grad_enabled() or not t.requires_grad:
        return t
    if torch.compiler.is_compiling():
        from commfuse import library

        return library.replicated(t, group)
    return ReplicatedGrad.apply(t, group)


def replicated_linear(lin, x: torch.Tensor, *groups) -> torch.Tensor:
    """``lin(x)`` with ``lin``'s weight and bias :func:`replicated` over each of ``groups`` (their gradients
    summed over them: the projections of the sequence-parallel attentions, Ulysses and ring, whose ranks see
    other tokens; a 2-D mesh gives one group per axis, and the sums over both are the sum over the mesh)."""
    w, b = lin.weight, lin.bias
    for group in groups:
        w = replicated(w, group)
        b = replicated(b, group) if b is not None else None
    return F.linear(x, w, b)


def load_row_shard(layer, linear) -> None:
    """Copy this rank's rows ``tensor_split(out_features, N)[r]`` of ``linear`` into ``layer``."""
    start, rows = shard_range(linear.out_features, layer.rank, layer.world_size)
    with torch.no_grad():
        local(layer.weight).copy_(linear.weight[start : start + rows])
        if layer.bias is not None:
            local(layer.bias).copy_(linear.bias[start : start + rows])


def linear_from_row_shards(layer):
    """The whole ``nn.Linear`` of a layer whose weight and bias rows are sharded over ``layer.group``."""
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                       device=local(layer.weight).device, dtype=layer.weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(gather_dim(layer.weight, 0, layer.out_features, layer.group))
        if layer.bias is not None:
            linear.bias.copy_(gather_dim(layer.bias, 0, layer.out_features, layer.group))
    return linear


register_format("nn.gather_dim.agree", lambda v: "commfuse.nn's agreement of the ranks on a parameter they gather whole")
register_format("nn.gather_dim", lambda v: f"a parameter's pieces gathered whole (each rank's padded to {v[3]} "
                                           f"{dtype_name(v[0])} elements)")
