"""Tensor-parallel styles for ``torch.distributed.tensor.parallel.parallelize_module``, fused by commfuse.

A torchtitan-style plan names torch's ``ColwiseParallel`` / ``RowwiseParallel``
for each ``nn.Linear``; these styles take their place, argument for argument,
and add ``algorithm``::

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
    from commfuse.tp import ColwiseParallel, RowwiseParallel

    parallelize_module(block, mesh["tp"], {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),       # all-gather fused with the GEMM
        "w2": RowwiseParallel(output_layouts=Shard(1)),      # reduce-scatter fused with the GEMM
    })

Parameters are DTensors on the mesh with torch's placements (column-parallel
weight and bias ``Shard(0)``; row-parallel weight ``Shard(1)`` and bias
``Replicate()``), so ``state_dict``, distributed checkpoints,
``clip_grad_norm_``, optimizers, ``full_tensor()`` and ``fully_shard`` see what
they see under torch's styles. What changes is the forward: where torch's
style moves the activation with one blocking collective and then runs the
GEMM, these run commfuse's fused op on the local shards:

- column-parallel with a sequence-sharded input (``Shard(d)``, d not the
  feature dim): :func:`commfuse.all_gather_matmul` along d;
- row-parallel with a sequence-sharded output (``output_layouts=Shard(d)``):
  :func:`commfuse.matmul_reduce_scatter` along d.

Every other layout (a replicated input, a replicated or feature-sharded
output, shards of unequal size) has nothing to fuse: the style then moves the
activation through DTensor exactly as torch's style does, and logs why at
DEBUG on the ``commfuse`` logger. Inputs may be DTensors (``SequenceParallel``
hands its output on as one) or local tensors laid out as ``input_layouts``
says; ``use_local_output`` means what it means in torch.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

import commfuse.ops as ops
from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.nn._common import contiguous_stride, replicated

__all__ = ["ColwiseParallel", "RowwiseParallel"]

_log = logging.getLogger("commfuse")


def _normalized(p: Placement, ndim: int) -> Placement:
    """``p`` with a negative shard dim counted from the front (Shard(-1) of a 3-D tensor is Shard(2))."""
    if isinstance(p, Shard) and p.dim < 0:
        return Shard(p.dim + ndim)
    return p


def _single(layouts, what: str) -> Placement:
    """The one placement of a 1-D mesh's layout argument (a Placement or a 1-tuple of one)."""
    if isinstance(layouts, Placement):
        return layouts
    if isinstance(layouts, (tuple, list)) and len(layouts) == 1 and isinstance(layouts[0], Placement):
        return layouts[0]
    raise CommfuseTypeError(f"{what} must be one Placement (Shard(d), Replicate()) for a 1-D TP mesh, got {layouts!r}")


def _local_input(x, layout: Placement, mesh: DeviceMesh, style: str) -> tuple[torch.Tensor, Placement]:
    """This rank's piece of the module input and its placement: a DTensor's own (its gradient flows back as
    a DTensor), or ``layout`` for a local tensor."""
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            raise CommfuseValueError(
                f"{style}: the input is a DTensor on {x.device_mesh}, but the module was parallelized over {mesh}"
            )
        return x.to_local(), _normalized(x.placements[0], x.ndim)
    if not isinstance(x, torch.Tensor):
        raise CommfuseTypeError(f"{style}: the input must be a tensor or a DTensor, got {type(x).__name__}")
    return x, _normalized(layout, x.ndim)


def _even(local: torch.Tensor, dim: int, n: int, x) -> bool:
    """Whether the shards along ``dim`` are all alike, as the fused ops need: a local input is, by DTensor's
    own rule for ``from_local``; a DTensor's are when its size divides by ``n`` (``torch.chunk`` pieces)."""
    return not isinstance(x, DTensor) or x.shape[dim] % n == 0


def _redistributed(local: torch.Tensor, have: Placement, want: Placement, mesh: DeviceMesh, x) -> torch.Tensor:
    """``local`` (placed ``have``) moved to ``want`` through DTensor, unfused: what torch's styles do. A
    replicated result is an input to a column-parallel GEMM, whose gradient on each rank is only its part of
    the whole: it goes back as a ``Partial``, and DTensor sums it on the way to ``have``."""
    if isinstance(x, DTensor) and x.placements[0] == have:
        source = x
    else:
        source = DTensor.from_local(local, mesh, [have], run_check=False)
    moved = source.redistribute(placements=[want])
    return moved.to_local(grad_placements=[Partial()] if isinstance(want, Replicate) else None)


class _Style(ParallelStyle):
    def __init__(self, *, input_layouts, output_layouts, use_local_output: bool, algorithm: str) -> None:
        super().__init__()
        self.input_layouts = (_single(input_layouts, "input_layouts"),)
        self.output_layouts = (_single(output_layouts, "output_layouts"),)
        self.use_local_output = use_local_output
        if not isinstance(algorithm, str):
            raise CommfuseTypeError(f"algorithm must be a string such as 'auto' or 'ring', got {algorithm!r}")
        self.algorithm = algorithm
        self._said: set[tuple] = set()

    def _check(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        name = type(self).__name__
        if not isinstance(module, nn.Linear):
            raise CommfuseTypeError(f"commfuse.tp.{name} parallelizes nn.Linear modules, got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise CommfuseValueError(
                f"commfuse.tp.{name} needs a 1-D mesh (the TP axis, e.g. mesh['tp']), got a {device_mesh.ndim}-D mesh"
            )
        if isinstance(module.weight, DTensor):
            raise CommfuseValueError(
                f"commfuse.tp.{name}: the module's weight is a DTensor already ({module.weight.placements}); "
                f"apply the TP style before fully_shard, and only once"
            )

    def _once(self, message: str, *args) -> None:
        """``message`` at DEBUG on the ``commfuse`` logger, once per style and message (not on every call)."""
        key = (message, *map(repr, args))
        if key not in self._said:
            self._said.add(key)
            _log.debug(message, *args)

    def _distribute(self, module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement) -> None:
        param = getattr(module, name)
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(param, mesh, [placement], src_data_rank=self.src_data_rank),
            requires_grad=param.requires_grad,
        ))

    def _output(self, y: torch.Tensor, have: Placement, mesh: DeviceMesh, full_shape) -> torch.Tensor:
        """``y`` (this rank's piece, placed ``have``) as the style's output: moved to ``output_layouts`` and
        handed on local or as a DTensor."""
        want = _normalized(self.output_layouts[0], y.ndim)
        if want == have and self.use_local_output:
            return y
        out = DTensor.from_local(y, mesh, [have], run_check=False, shape=torch.Size(full_shape),
                                 stride=contiguous_stride(full_shape))
        if want != have:
            out = out.redistribute(placements=[want])
        return out.to_local() if self.use_local_output else out

    def __repr__(self) -> str:
        return (f"commfuse.tp.{type(self).__name__}(input_layouts={self.input_layouts[0]}, "
                f"output_layouts={self.output_layouts[0]}, use_local_output={self.use_local_output}, "
                f"algorithm={self.algorithm!r})")


class ColwiseParallel(_Style):
    """Column-parallel ``nn.Linear`` (weight and bias ``Shard(0)``), its input's all-gather fused with the GEMM.

    ``input_layouts`` (default ``Replicate()``) says how a local input is laid
    out; with ``Shard(d)`` for a dim d other than the feature dim (the sequence
    dim under sequence parallelism) the forward is ``all_gather_matmul`` along
    d: each arriving shard's GEMM overlaps the next hop. ``output_layouts``
    (default ``Shard(-1)``) and ``use_local_output`` (default True) as in torch.
    ``algorithm``: commfuse's algorithm for the fused op (``"auto"``, ``"ring"``...).
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, algorithm: str = "auto") -> None:
        super().__init__(input_layouts=input_layouts or Replicate(), output_layouts=output_layouts or Shard(-1),
                         use_local_output=use_local_output, algorithm=algorithm)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, device_mesh)
        self._distribute(module, "weight", device_mesh, Shard(0))
        if module.bias is not None:
            self._distribute(module, "bias", device_mesh, Shard(0))
        style = self

        def forward(x):
            return style._forward(module, device_mesh, x)

        module.forward = forward
        return module

    def _forward(self, module: nn.Linear, mesh: DeviceMesh, x) -> torch.Tensor:
        local, have = _local_input(x, self.input_layouts[0], mesh, "commfuse.tp.ColwiseParallel")
        weight = module.weight  # read per call: fully_shard swaps in the unsharded parameter before forward
        w = weight.to_local()
        n = mesh.size()
        feature = local.ndim - 1
        if isinstance(have, Shard) and have.dim != feature and n > 1 and _even(local, have.dim, n, x):
            y = ops.all_gather_matmul(local, w.t(), group=mesh.get_group(), gather_dim=have.dim,
                                      algorithm=self.algorithm)
            lead = list(y.shape[:-1])
        else:
            if not isinstance(have, Replicate):
                self._once("commfuse.tp.ColwiseParallel: input placed %r on %d ranks has nothing to fuse; "
                           "gathering it through DTensor first", have, n)
                local = _redistributed(local, have, Replicate(), mesh, x)
            elif n > 1:
                # each rank's input gradient is its output features' part of the whole: summed over the mesh,
                # as DTensor sums it for torch's style (a Partial gradient, or an all-reduce for a local input)
                local = (x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor)
                         else replicated(local, mesh.get_group()))
            y = torch.matmul(local, w.t())
            lead = list(y.shape[:-1])
        if module.bias is not None:
            y = y + module.bias.to_local()
        return self._output(y, Shard(y.ndim - 1), mesh, lead + [module.out_features])


class RowwiseParallel(_Style):
    """Row-parallel ``nn.Linear`` (weight ``Shard(1)``, bias ``Replicate()``), its output's reduce-scatter fused
    with the GEMM.

    ``input_layouts`` (default ``Shard(-1)``, the features a column-parallel
    layer produced) and ``use_local_output`` (default True) as in torch.
    ``output_layouts`` (default ``Replicate()``): with ``Shard(d)`` for a dim d
    other than the feature dim (the sequence dim under sequence parallelism)
    the forward is ``matmul_reduce_scatter`` along d, each step's partial GEMM
    overlapping the ring; ``Replicate()`` is an all-reduce, through DTensor,
    as in torch. The bias is added once after the reduction, and its gradient
    is summed over the mesh. ``algorithm``: commfuse's algorithm for the fused op.
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, algorithm: str = "auto") -> None:
        super().__init__(input_layouts=input_layouts or Shard(-1), output_layouts=output_layouts or Replicate(),
                         use_local_output=use_local_output, algorithm=algorithm)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check(module, device_mesh)
        self._distribute(module, "weight", device_mesh, Shard(1))
        if module.bias is not None:
            self._distribute(module, "bias", device_mesh, Replicate())
        style = self

        def forward(x):
            return style._forward(module, device_mesh, x)

        module.forward = forward
        return module

    def _forward(self, module: nn.Linear, mesh: DeviceMesh, x) -> torch.Tensor:
        local, have = _local_input(x, self.input_layouts[0], mesh, "commfuse.tp.RowwiseParallel")
        feature = local.ndim - 1
        if have != Shard(feature):
            self._once("commfuse.tp.RowwiseParallel: input placed %r, not on its features; moving it through "
                       "DTensor first", have)
            local = _redistributed(local, have, Shard(feature), mesh, x)
            x = None  # its shape no longer says anything of local's
        w = module.weight.to_local()
        n = mesh.size()
        want = _normalized(self.output_layouts[0], local.ndim)
        bias = module.bias
        if isinstance(want, Shard) and want.dim != feature and n > 1 and local.shape[want.dim] % n == 0:
            z = ops.matmul_reduce_scatter(local, w.t(), group=mesh.get_group(), scatter_dim=want.dim,
                                          algorithm=self.algorithm)
            if bias is not None:
                # every rank adds the bias to its own rows: the gradient of the whole is the sum over the mesh
                z = z + replicated(bias.to_local(), mesh.get_group())
            full = list(z.shape)
            full[want.dim] *= n
            return self._output(z, want, mesh, full)
        if n > 1:
            self._once("commfuse.tp.RowwiseParallel: output placed %r has no reduce-scatter to fuse (a "
                       "replicated or feature-sharded output, or shards of unequal size); reducing through "
                       "DTensor", want)
        z = torch.matmul(local, w.t())
        full = list(z.shape)
        partial = DTensor.from_local(z, mesh, [Partial()], run_check=False, shape=torch.Size(full),
                                     stride=contiguous_stride(full))
        out = partial.redistribute(placements=[want])
        if bias is not None:
            out = out + bias
        return out.to_local() if self.use_local_output else out
