"""A model with MoE layers on a dp x ep mesh: data parallelism around expert parallelism, and its gradient norm.

:class:`commfuse.nn.MoE` holds its experts on the ranks of an expert-parallel
axis (``group=mesh["ep"]``) and reduces its gradients over that axis itself.
A model that has dense layers beside it (embeddings, attention, norms, a
head) on a dp x ep mesh, every rank with tokens and a loss of its own, needs
two reductions more, so that each gradient is that of the mean of all dp x ep
ranks' losses:

* a dense parameter is the same on every rank of the mesh: its gradient is
  averaged over all dp x ep ranks;
* an MoE layer's experts differ along ep and repeat along dp: their
  gradients are averaged over dp only (the layer has divided by the ep size
  already); its router and shared experts, averaged over ep by the layer,
  are averaged over dp too.

:func:`fully_shard` (FSDP2) and :func:`ddp` (DistributedDataParallel) make
both. Plainly, for the mean of the ranks' losses ``L = sum_r L_r / (dp * ep)``::

    dense.grad  = sum over all dp x ep ranks of dL_r/d(dense) / (dp * ep)   # the wrapper over dp x ep
    expert.grad = sum over dp of (sum over ep of dL_r/d(expert) / ep) / dp  # the layer over ep, the wrapper over dp
    router.grad = the same as an expert's                                   # the layer over ep, the wrapper over dp

Such a model's parameters are plain tensors and DTensors on several meshes
(the dense ones on dp x ep under FSDP2, plain under DDP; the MoE's on ep, or
dp x ep under FSDP2), which torch's ``clip_grad_norm_`` cannot stack into
one norm. :func:`clip_grad_norm_` takes the norm per mesh and combines them:
the norm of the whole model's gradient, as one process holding every
parameter computes it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.nn import MoE, ShardedLinear
from commfuse.planning.agreement import agree
from commfuse.nn._common import local
from commfuse.planning.all_reduce import group_sum
from commfuse.runtime.fingerprints import register_format

__all__ = ["clip_grad_norm_", "ddp", "fully_shard", "total_norm"]


def fully_shard(module: nn.Module, mesh, *, dp_axis: str = "dp", ep_axis: str = "ep", **kwargs) -> nn.Module:
    """torch's FSDP2 ``fully_shard`` for a module with MoE layers on a dp x ep ``mesh``: every
    :class:`~commfuse.nn.MoE` inside ``module`` that is not sharded yet goes over ``mesh[dp_axis]``, then
    ``module``'s other parameters over all dp x ep ranks (a flattened mesh, ``mesh[(dp, ep)]._flatten()``),
    each with FSDP2's default divide factor (the mesh's size: the mean). ``kwargs`` (``mp_policy``,
    ``reshard_after_forward``, ...) go to both.

    Use it as torch's: on each block you want as its own unit of FSDP2, then on the root::

        for block in model.layers:
            commfuse.ep.fully_shard(block, mesh)
        commfuse.ep.fully_shard(model, mesh)

    ``module`` an MoE layer itself: it alone, over dp. Every MoE layer must be built with
    ``group=mesh[ep_axis]`` and ``loss="per_rank"`` (each rank has its own loss); every rank must hold the same
    layers, which one exchange over the mesh checks (a rank that differs is named on every rank). Call it
    before making the optimizer, as torch's."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    dp_mesh, flat = _axes(mesh, dp_axis, ep_axis, "commfuse.ep.fully_shard")
    layers = _layers(module, mesh, dp_axis, ep_axis, flat, "commfuse.ep.fully_shard")
    for _, layer in layers:
        if not isinstance(layer, FSDPModule):
            torch_fully_shard(layer, mesh=dp_mesh, **kwargs)
    if isinstance(module, MoE):
        return module
    return torch_fully_shard(module, mesh=flat, **kwargs)


def ddp(module: nn.Module, mesh, *, dp_axis: str = "dp", ep_axis: str = "ep", **kwargs):
    """``module`` in torch's DistributedDataParallel over all dp x ep ranks of ``mesh`` for every parameter
    but its :class:`~commfuse.nn.MoE` layers' (and their buffers), which DDP is told to leave alone; each MoE
    parameter's gradient is averaged over ``mesh[dp_axis]`` once it is accumulated in the backward (one
    all-reduce each, through commfuse: numbered, bounded by its timeout, told to every rank). Returns the DDP
    module. ``kwargs`` go to DDP (not ``process_group`` or ``device_mesh``: the mesh decides).

    ``ddp_model.no_sync()`` holds the MoE's reductions back as DDP's: a forward made inside it (DDP decides at
    the forward) leaves the layer's gradients of that backward unreduced over dp; the next synchronised
    backward reduces what has accumulated. DDP broadcasts the other parameters and buffers from the first
    rank when it is built; seed every rank alike all the same, for the MoE's router. The layers' conditions are
    :func:`fully_shard`'s."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    for taken in ("process_group", "device_mesh"):
        if taken in kwargs:
            raise CommfuseValueError(
                f"commfuse.ep.ddp: {taken}= is not taken: DDP runs over the dp x ep ranks of the mesh given, and "
                "the MoE layers' gradients over its dp axis")
    dp_mesh, flat = _axes(mesh, dp_axis, ep_axis, "commfuse.ep.ddp")
    layers = _layers(module, mesh, dp_axis, ep_axis, flat, "commfuse.ep.ddp")
    names = [f"{path}.{name}" if path else name for path, layer in layers
             for name, _ in (*layer.named_parameters(), *layer.named_buffers())]
    ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    DDP._set_params_and_buffers_to_ignore_for_model(module, ignored + names)
    wrapped = DDP(module, process_group=flat.get_group(), **kwargs)
    dp_group = dp_mesh.get_group()
    if dist.get_world_size(dp_group) > 1:
        _DataParallelGrads(wrapped, [p for _, layer in layers for p in layer.parameters()], dp_group)
    return wrapped


class _DataParallelGrads:
    """Averages each of ``params``' gradients over ``group`` once it is accumulated, when the DDP module
    ``wrapped`` synchronises the backward of its last forward (its ``require_backward_grad_sync``)."""

    __slots__ = ("group", "n", "sync")

    def __init__(self, wrapped: nn.Module, params: list[nn.Parameter], group) -> None:
        self.group, self.n, self.sync = group, dist.get_world_size(group), True
        wrapped.register_forward_pre_hook(self._at_forward)
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._reduce)

    def _at_forward(self, wrapped: nn.Module, _args) -> None:
        self.sync = bool(getattr(wrapped, "require_backward_grad_sync", True))

    def _reduce(self, p: torch.Tensor) -> None:
        if not self.sync:
            return
        grad = local(p.grad)
        grad.copy_(group_sum(grad, self.group, label="ep.grad").div_(self.n))


def _axes(mesh, dp_axis: str, ep_axis: str, where: str):
    """``(mesh[dp_axis], the dp x ep ranks flattened)``, or an error naming what the mesh lacks."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise CommfuseTypeError(f"{where}: mesh must be a DeviceMesh with axes {dp_axis!r} and {ep_axis!r}, got "
                                f"{type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    missing = [axis for axis in (dp_axis, ep_axis) if axis not in names]
    if missing:
        raise CommfuseValueError(
            f"{where}: rank {dist.get_rank()}: the mesh's axes are {names}, without {missing}: pass a mesh with a "
            f"data-parallel and an expert-parallel axis (init_device_mesh(..., mesh_dim_names=({dp_axis!r}, "
            f"{ep_axis!r}))), or name them with dp_axis= and ep_axis=")
    # DeviceMesh._flatten: torch's way to a mesh over several axes' ranks (torchtitan's too); the same name
    # gives back the mesh made the first time
    return mesh[dp_axis], mesh[(dp_axis, ep_axis)]._flatten(f"{dp_axis}_{ep_axis}")


def _layers(module: nn.Module, mesh, dp_axis: str, ep_axis: str, flat, where: str) -> list[tuple[str, MoE]]:
    """``module``'s MoE layers ``(path, layer)``, each checked against the mesh, and the same on every rank:
    each rank's verdict (its layers, or its refusal) and what it holds are agreed over the dp x ep ranks in one
    exchange before anything is sharded (``commfuse.planning.agreement``), so a rank that refuses alone, or holds other
    layers, is named on every rank."""

    def decide() -> list[tuple[str, MoE]]:
        ep_ranks = dist.get_process_group_ranks(mesh[ep_axis].get_group())
        rank = dist.get_rank()
        layers = []
        for path, m in module.named_modules():
            name = path or type(m).__name__
            if isinstance(m, ShardedLinear):
                raise CommfuseValueError(
                    f"{where}: rank {rank}: {name} is a commfuse ShardedLinear, which shards its weight over its "
                    "own data-parallel group; on a dp x ep mesh the dense parameters are sharded over dp x ep: use "
                    "an nn.Linear there")
            if not isinstance(m, MoE):
                continue
            mine = dist.get_process_group_ranks(m.group if m.group is not None else dist.group.WORLD)
            if mine != ep_ranks:
                raise CommfuseValueError(
                    f"{where}: rank {rank}: the MoE layer {name} runs over global ranks {mine}; the mesh's "
                    f"{ep_axis!r} axis here is global ranks {ep_ranks}: build it with group=mesh[{ep_axis!r}]")
            if m.loss != "per_rank":
                raise CommfuseValueError(
                    f"{where}: rank {rank}: the MoE layer {name} was built with loss={m.loss!r}; on a dp x ep mesh "
                    "every rank has tokens and a loss of its own, which the dense parameters' average over dp x ep "
                    "assumes: build it with loss='per_rank'")
            layers.append((path, m))
        return layers

    def described(layers) -> list:
        facts = [("mesh (dp, ep)", f"({mesh[dp_axis].size()}, {mesh[ep_axis].size()})"), ("MoE layers", len(layers))]
        for path, m in layers:
            facts.append((f"MoE layer {path or type(m).__name__!r} (experts, hidden, ffn, top-k, parameters)",
                          f"({m.experts}, {m.hidden_size}, {m.ffn_size}, {m.topk}, "
                          f"{sum(p.numel() for p in m.parameters())})"))
        return facts

    return agree(flat.get_group(), f"{where} (the MoE layers on the dp x ep mesh)", decide, described,
                 label="ep.layers", device=flat.device_type)


register_format("ep.layers", lambda v: "commfuse.ep's agreement of the ranks on the mesh and the MoE layers")


# -- the gradient norm ---------------------------------------------------------------------------------------------


def total_norm(tensors, norm_type: float = 2.0, *, error_if_nonfinite: bool = False,
               foreach: bool | None = None) -> torch.Tensor:
    """The ``norm_type`` norm of ``tensors`` together (an iterable, or one tensor), each a plain tensor or a
    DTensor on any mesh: the norm of the whole of each DTensor (taken per mesh with torch's
    ``get_total_norm``, then made whole), and of each plain tensor as this rank holds it (a parameter DDP
    keeps the same on every rank). The same plain tensor (float32 or the tensors' dtype, as torch's) on every
    rank that holds the same tensors."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    norm_type = float(norm_type)
    if not tensors:
        return torch.tensor(0.0)
    dtensor = _dtensor_type()
    by_mesh: dict = {}
    for t in tensors:
        by_mesh.setdefault(t.device_mesh if dtensor is not None and isinstance(t, dtensor) else None, []).append(t)
    norms = []
    for mesh, group in by_mesh.items():
        norm = torch.nn.utils.get_total_norm(group, norm_type, False, foreach)
        norms.append(norm.full_tensor() if mesh is not None else norm)
    device = local(tensors[0]).device
    norms = [n.to(device) for n in norms]
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise CommfuseValueError(
            f"rank {dist.get_rank() if dist.is_initialized() else 0}: the total norm of order {norm_type} of the "
            f"gradients is {total.item()}: clipping them would make them nan; pass error_if_nonfinite=False to "
            "clip regardless")
    return total


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` for parameters on several meshes, or DTensors beside plain tensors: the
    gradients' :func:`total_norm` (that of the whole model's gradient), then every gradient times
    ``max_norm / (norm + 1e-6)`` where that is below 1, in place on its local tensor. Returns the norm, a plain
    tensor, the same on every rank."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = total_norm(grads, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    if not grads:
        return norm
    coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    by_place: dict = {}
    for g in grads:
        g = local(g)
        by_place.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in by_place.items():
        if foreach is False:
            for g in group:
                g.mul_(coef.to(device))
        else:
            torch._foreach_mul_(group, coef.to(device))
    return norm


def _dtensor_type():
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor
