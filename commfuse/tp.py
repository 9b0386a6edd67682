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

Two block styles fuse a whole sub-block each (apply them to the block, not its
linears, which they name by their paths in it, dotted where they sit deeper):
:class:`SwiGLUParallel`, a SwiGLU feed-forward whose two up projections share
one gather, and :class:`AttentionParallel`, self-attention whose Q/K/V
projections (three, or one fused ``wqkv``) share one gather, with a hook for
rotary embeddings, and whose out-projection reduce-scatter is fed by
per-query-slice attention. :class:`RingAttentionParallel` is the same block
under context parallelism, applied on the CP axis: the weights replicated,
the sequence sharded, K/V passed around the ring (``commfuse.ring_attention``).
A block style replaces the block's forward, so it takes over only what it
verified when it is applied: every part of the block is one it computes
(projections, per-head norms, an activation it knows), and where the block's
own forward can run on a small input it is compared with the style's
computation; anything else is refused by name, pointing at the per-linear
styles, which keep the block's own forward. HuggingFace transformers attention
and MLP modules take the block styles with no arguments: each class's
docstring says what it reads from them.

Every other layout (a replicated input, a replicated or feature-sharded
output, shards of unequal size) has nothing to fuse: the style then moves the
activation through DTensor exactly as torch's style does, and logs why at
DEBUG on the ``commfuse`` logger. Inputs may be DTensors (``SequenceParallel``
hands its output on as one) or local tensors laid out as ``input_layouts``
says.

``use_local_output`` means what it means in torch, and its default is that of
torch's style of the same kind (torch 2.13's
``torch.distributed.tensor.parallel.style``): True for
:class:`ColwiseParallel` and :class:`RowwiseParallel`, as torch's styles of
those names; True for the block styles too, whose output is their
row-parallel projection's (``w2``, ``wo``), as it is under torch's
``RowwiseParallel`` in torch's plan for the same block (torch's
``PrepareModuleOutput`` defaults to True as well; only ``SequenceParallel``
and ``PrepareModuleInput``, which hand an activation on to the next style,
default to False). So a block's output adds to a residual stream of local
tensors, as in torch's plan. Where the residual stream is a DTensor (``x +
attention(norm(x))`` with ``x`` a DTensor), give ``use_local_output=False``,
as torch's ``RowwiseParallel`` needs there too: a local output added to a
DTensor is torch's ``aten.add.Tensor got mixed torch.Tensor and DTensor``.

What a style's fused ops compute with but cannot see in the shapes (whether
each linear has a bias; the attention's mask, head size and rope hook) joins
their fingerprint, so a rank whose module or style differs is named on every
rank (``MismatchError``) instead of computing something else.
"""

from __future__ import annotations

import inspect
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

import commfuse.ops as ops
from commfuse.context import check_layout, positions
from commfuse.errors import CommfuseError, CommfuseTypeError, CommfuseValueError
from commfuse.fused import attention as fused_attention
from commfuse.nn._agree import agree, structure
from commfuse.nn._blocks import (
    ACTIVATIONS,
    activation_name,
    differs,
    is_transformers,
    per_head,
    transformers_rope,
    unclaimed,
    where,
)
from commfuse.nn._common import as_dtensor, config, replicated, replicated_linear
from commfuse.runtime import sites
from commfuse.runtime.checkpointing import as_custom_op
from commfuse.planning.agreement import agree_around, agree_shared
from commfuse.runtime.groups import check_mode, state_of_group
from commfuse.runtime.admission import counted_calls, leave_calls
from commfuse.schedule import Collective, site_algorithm

#: a number per module a style was applied to, for the key under which ``counted_calls`` learns how many calls
#: its forward makes: never an ``id()``, which a later module's forward may reuse once the first is freed (a
#: rank whose new forward reused one would announce the old forward's count when it refuses, and its peers,
#: whose did not, would not: the ranks' call numbers would part)
_FORWARDS = itertools.count()

__all__ = ["AttentionParallel", "ColwiseParallel", "RingAttentionParallel", "RowwiseParallel", "SwiGLUParallel"]


def _normalized(p: Placement, ndim: int) -> Placement:
    """``p`` with a negative shard dim counted from the front (Shard(-1) of a 3-D tensor is Shard(2))."""
    if isinstance(p, Shard) and p.dim < 0:
        return Shard(p.dim + ndim)
    return p


def _one_placement(layouts, what: str) -> Placement:
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


def _even(dim: int, n: int, x) -> bool:
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
    #: the collectives the style's fused ops run ``algorithm`` on, and whether they are all fused GEMMs (which
    #: have ``native``): ``algorithm`` is checked for them when the style is built
    _collectives: tuple = (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)
    _native = True

    def __init__(self, *, input_layouts, output_layouts, use_local_output: bool, algorithm: str) -> None:
        super().__init__()
        self.input_layouts = (_one_placement(input_layouts, "input_layouts"),)
        self.output_layouts = (_one_placement(output_layouts, "output_layouts"),)
        self.use_local_output = use_local_output
        if not isinstance(algorithm, str):
            raise CommfuseTypeError(f"commfuse.tp.{type(self).__name__}: algorithm must be a string such as "
                                    f"'auto' or 'ring', got {algorithm!r}")
        self.algorithm = site_algorithm(f"commfuse.tp.{type(self).__name__}", algorithm, *self._collectives,
                                        native=self._native)

    def _agreed(self, module: nn.Module, mesh: DeviceMesh, decide=None):
        """What ``decide()`` reads of ``module`` (the block's parts; None without it), once every rank of the
        mesh agrees (``commfuse.planning.agreement``): each rank's verdict (applied, or its refusal) and what it decided
        (the style's arguments, :meth:`_decisions` of what it read, the module's structure) are exchanged once,
        before anything is distributed, so that a rank that refuses, or reads its module otherwise, is named on
        every rank instead of leaving its peers in ``distribute_tensor``'s scatter."""
        self._check_mesh(mesh)  # the same mesh on every rank (made together); its one axis is the group
        who = f"commfuse.tp.{type(self).__name__} on {where(module)}"

        def described(decided) -> list:
            return [("module", who), *self._arguments_given(), *self._decisions(decided), *structure(module)]

        return agree(mesh.get_group() if mesh.size() > 1 else None, who, decide or (lambda: None), described,
                     label="tp.apply", device=mesh.device_type)

    def _arguments_given(self) -> list[tuple[str, object]]:
        """The style's arguments, as :meth:`_agreed` compares them over the ranks."""
        return [("style", f"commfuse.tp.{type(self).__name__}"), ("input_layouts", repr(self.input_layouts[0])),
                ("output_layouts", repr(self.output_layouts[0])), ("use_local_output", self.use_local_output),
                ("algorithm", self.algorithm)]

    def _decisions(self, decided) -> list[tuple[str, object]]:
        """What the style read of the block and will compute with (:meth:`_agreed`); the per-linear styles
        read nothing beyond the linear's structure."""
        return []

    def _check(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if not isinstance(module, nn.Linear):
            raise CommfuseTypeError(f"commfuse.tp.{type(self).__name__} parallelizes nn.Linear modules, got "
                                    f"{type(module).__name__}")
        self._check_mesh(device_mesh)
        self._check_linear(module)

    def _check_mesh(self, device_mesh: DeviceMesh) -> None:
        if device_mesh.ndim != 1:
            raise CommfuseValueError(f"commfuse.tp.{type(self).__name__} needs a 1-D mesh (the TP axis, e.g. "
                                     f"mesh['tp']), got a {device_mesh.ndim}-D mesh")

    def _check_linear(self, module: nn.Linear) -> None:
        if isinstance(module.weight, DTensor):
            raise CommfuseValueError(
                f"commfuse.tp.{type(self).__name__}: the module's weight is a DTensor already "
                f"({module.weight.placements}); apply the TP style before fully_shard, and only once"
            )

    def _once(self, message: str, *args) -> None:
        """A fallback to DTensor: ``message`` written down on the module's site and said at INFO on the
        ``commfuse`` logger, once per site and message (``sites.fallback`` keeps which it has said)."""
        sites.fallback(message % args)

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
        out = as_dtensor(y, mesh, have, full_shape)
        if want != have:
            out = out.redistribute(placements=[want])
        return out.to_local() if self.use_local_output else out

    def _install(self, module: nn.Module, mesh: DeviceMesh, forward, read=None) -> nn.Module:
        """``module`` with ``forward(module, mesh, *args)`` in place of its own forward. ``read(args, kwargs)``,
        when given, reads the module's arguments into one record (a :class:`_Call`) before anything is computed
        or sent, and ``forward(module, mesh, call)`` takes that: a refusal there is told to the peers, which
        wait in this forward's first call (``leave_calls``: this rank leaves the calls it will not make, as
        many as the forward made the last time it ran, or one before it ever ran), so that one rank's bad input
        is named on every rank."""
        label = f"{type(self).__name__} forward"
        # what this module runs and takes, for COMMFUSE_LOG and commfuse.explain (commfuse.runtime.sites)
        site = sites.Site(f"commfuse.tp.{type(self).__name__}", self, mesh, mesh.size(),
                          f"{type(self).__name__} on {type(module).__name__}{_shape_of(module)}", module)

        serial = next(_FORWARDS)
        group = mesh.get_group() if mesh.size() > 1 else None

        def fused_forward(*args, **kwargs):
            if read is not None:
                try:
                    args, kwargs = (read(args, kwargs),), {}
                except CommfuseError as error:
                    if group is not None and not torch.compiler.is_compiling():
                        first = args[0] if args else next(iter(kwargs.values()), None)
                        _tell_peers(group, label, ("commfuse.tp", serial, (getattr(first, "shape", None),),
                                                   torch.is_grad_enabled()), error)
                    raise
            if torch.compiler.is_compiling():
                return forward(module, mesh, *args, **kwargs)
            # a hook of the user's that raises between the style's calls (the rope hook) leaves the calls
            # this rank will not make on the group's board, for the peers that wait in them
            key = ("commfuse.tp", serial, tuple(getattr(a, "shape", None) for a in args[:1]), torch.is_grad_enabled())
            with counted_calls(group, label, key), sites.at_site(site):
                return forward(module, mesh, *args, **kwargs)

        module.forward = fused_forward
        module.__dict__["_commfuse_site"] = site
        return module

    def _columns(self, mesh: DeviceMesh, x, linears, who: str, options: tuple,
                 rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """``x`` (the module input, placed ``input_layouts`` when local) through column-parallel ``linears``:
        each one's local output, sharded on its features. A sequence-sharded input is gathered once, fused
        with every GEMM (``all_gather_matmul`` with one weight per linear); any other layout is gathered
        through DTensor first. ``options``: the style's options for the fused op's fingerprint
        (:func:`~commfuse.nn._common.config`). ``rows``: this rank's rows of one replicated projection
        (a stacked one, :func:`_stacked_rows`), its weight's and bias's gradients summed over the mesh."""
        local, have = _local_input(x, self.input_layouts[0], mesh, who)
        n = mesh.size()
        if rows is not None:
            (lin,) = linears
            linears = [_Rows(lin, rows, mesh.get_group() if n > 1 else None)]
        # weights read per call: fully_shard swaps in the unsharded parameters before each forward
        ws = [lin.weight.to_local().t() for lin in linears]
        feature = local.ndim - 1
        if isinstance(have, Shard) and have.dim != feature and n > 1 and _even(have.dim, n, x):
            ys = ops.all_gather_matmul(local, ws if len(ws) > 1 else ws[0], group=mesh.get_group(),
                                       gather_dim=have.dim, algorithm=self.algorithm, config=options)
            ys = list(ys) if len(ws) > 1 else [ys]
        else:
            if not isinstance(have, Replicate):
                self._once(f"{who}: input placed %r on %d ranks has nothing to fuse; gathering it through "
                           "DTensor first", have, n)
                local = _redistributed(local, have, Replicate(), mesh, x)
            elif n > 1:
                # each rank's input gradient is its output features' part of the whole: summed over the mesh,
                # as DTensor sums it for torch's style (a Partial gradient, or an all-reduce for a local input)
                local = (x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor)
                         else replicated(local, mesh.get_group()))
            ys = [torch.matmul(local, w) for w in ws]
        # each bias in its output's dtype (autocast's, under it), as nn.Linear adds it there
        return [y + lin.bias.to_local().to(y.dtype) if lin.bias is not None else y for y, lin in zip(ys, linears)]

    def _row(self, mesh: DeviceMesh, local: torch.Tensor, linear: nn.Linear, who: str,
             options: tuple) -> torch.Tensor:
        """``local`` (sharded on its features) through the row-parallel ``linear``, the sum placed as
        ``output_layouts`` says: a sequence-sharded output is ``matmul_reduce_scatter``, fused; anything else
        is reduced through DTensor. Local or a DTensor as ``use_local_output`` says. ``options`` as for
        :meth:`_columns`."""
        feature = local.ndim - 1
        w = linear.weight.to_local()
        n = mesh.size()
        want = _normalized(self.output_layouts[0], local.ndim)
        bias = linear.bias
        if isinstance(want, Shard) and want.dim != feature and n > 1 and local.shape[want.dim] % n == 0:
            z = ops.matmul_reduce_scatter(local, w.t(), group=mesh.get_group(), scatter_dim=want.dim,
                                          algorithm=self.algorithm, config=options)
            return self._scattered(mesh, z, want, bias)
        if n > 1:
            self._once(f"{who}: output placed %r has no reduce-scatter to fuse (a replicated or feature-sharded "
                       "output, or shards of unequal size); reducing through DTensor", want)
        z = torch.matmul(local, w.t())
        out = as_dtensor(z, mesh, Partial(), z.shape).redistribute(placements=[want])
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.to_local() if self.use_local_output else out

    def _scattered(self, mesh: DeviceMesh, z: torch.Tensor, placed: Shard, bias) -> torch.Tensor:
        """This rank's reduce-scattered piece ``z`` (placed ``placed``) plus the replicated ``bias``, handed on."""
        if bias is not None:
            # every rank adds the bias to its own rows: the gradient of the whole is the sum over the mesh
            z = z + replicated(bias.to_local(), mesh.get_group()).to(z.dtype)
        full = list(z.shape)
        full[placed.dim] *= mesh.size()
        return self._output(z, placed, mesh, full)

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
    (default ``Shard(-1)``) and ``use_local_output`` (default True) as in
    torch's ``ColwiseParallel``. ``algorithm``: commfuse's algorithm for the
    fused op (``"auto"``, ``"ring"``...).
    """

    _collectives = (Collective.ALL_GATHER,)

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, algorithm: str = "auto") -> None:
        super().__init__(input_layouts=input_layouts or Replicate(), output_layouts=output_layouts or Shard(-1),
                         use_local_output=use_local_output, algorithm=algorithm)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._agreed(module, device_mesh, lambda: self._check(module, device_mesh))
        _colwise(self, module, device_mesh)
        return self._install(module, device_mesh, self._forward)

    def _forward(self, module: nn.Linear, mesh: DeviceMesh, x) -> torch.Tensor:
        who = "commfuse.tp.ColwiseParallel"
        (y,) = self._columns(mesh, x, [module], who, config(who, bias=module.bias is not None))
        return self._output(y, Shard(y.ndim - 1), mesh, [*y.shape[:-1], module.out_features])


class RowwiseParallel(_Style):
    """Row-parallel ``nn.Linear`` (weight ``Shard(1)``, bias ``Replicate()``), its output's reduce-scatter fused
    with the GEMM.

    ``input_layouts`` (default ``Shard(-1)``, the features a column-parallel
    layer produced) and ``use_local_output`` (default True) as in torch's
    ``RowwiseParallel``. ``output_layouts`` (default ``Replicate()``): with
    ``Shard(d)`` for a dim d other than the feature dim (the sequence dim
    under sequence parallelism) the forward is ``matmul_reduce_scatter``
    along d, each step's partial GEMM overlapping the ring; ``Replicate()`` is
    an all-reduce, through DTensor, as in torch. The bias is added once after
    the reduction, and its gradient is summed over the mesh. ``algorithm``:
    commfuse's algorithm for the fused op.
    """

    _collectives = (Collective.REDUCE_SCATTER,)

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, algorithm: str = "auto") -> None:
        super().__init__(input_layouts=input_layouts or Shard(-1), output_layouts=output_layouts or Replicate(),
                         use_local_output=use_local_output, algorithm=algorithm)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._agreed(module, device_mesh, lambda: self._check(module, device_mesh))
        _rowwise(self, module, device_mesh)
        return self._install(module, device_mesh, self._forward)

    def _forward(self, module: nn.Linear, mesh: DeviceMesh, x) -> torch.Tensor:
        who = "commfuse.tp.RowwiseParallel"
        local, have = _local_input(x, self.input_layouts[0], mesh, who)
        feature = local.ndim - 1
        if have != Shard(feature):
            self._once(f"{who}: input placed %r, not on its features; moving it through DTensor first", have)
            local = _redistributed(local, have, Shard(feature), mesh, x)
        return self._row(mesh, local, module, who, config(who, bias=module.bias is not None))


def _colwise(style: _Style, linear: nn.Linear, mesh: DeviceMesh) -> None:
    style._distribute(linear, "weight", mesh, Shard(0))
    if linear.bias is not None:
        style._distribute(linear, "bias", mesh, Shard(0))


def _rowwise(style: _Style, linear: nn.Linear, mesh: DeviceMesh) -> None:
    style._distribute(linear, "weight", mesh, Shard(1))
    if linear.bias is not None:
        style._distribute(linear, "bias", mesh, Replicate())


def _linears(style: _Style, module: nn.Module, names: dict[str, str], mesh: DeviceMesh) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` projections of a block a block style parallelizes, by argument: ``names`` maps each of
    the style's arguments (``w1``, ``wq``, ``qkv``...) to a submodule's path in the block, dotted where the
    projection sits deeper (torchtitan's ``qkv_linear.wqkv``), resolved with ``get_submodule``. The modules
    stay where they are, so their parameters' names and state-dict keys do not change."""
    style._check_mesh(mesh)
    found = {}
    for argument, path in names.items():
        if not isinstance(path, str):
            raise CommfuseTypeError(f"commfuse.tp.{type(style).__name__}: {argument} names a projection of the "
                                    f"block (a submodule's path such as 'wq' or 'qkv_linear.wqkv'), got {path!r}")
        try:
            child = module.get_submodule(path)
        except AttributeError:
            child = None
        if not isinstance(child, nn.Linear):
            what = "has no submodule" if child is None else f"has a {type(child).__name__}, not an nn.Linear, at"
            raise CommfuseValueError(
                f"commfuse.tp.{type(style).__name__}: {type(module).__name__} {what} {path!r} (the {argument}= "
                f"argument, its {style._roles[argument]}); name each projection by its path in the block, "
                f"dotted where it sits deeper ('qkv_linear.wq')"
            )
        style._check_linear(child)
        found[argument] = child
    return found


class _Call:
    """One call of a block style's forward, read before anything is computed or sent (``_Style._install``'s
    ``read``): the block's input and what it was given besides (masks by name; what goes to the rope hook;
    transformers' ``position_embeddings``)."""

    __slots__ = ("x", "shape", "masks", "args", "kwargs", "rotary")

    def __init__(self, x, masks=None, args=(), kwargs=None, rotary=None) -> None:
        self.x, self.shape = x, getattr(x, "shape", None)
        self.masks, self.args, self.kwargs, self.rotary = masks or {}, args, kwargs or {}, rotary


def _input_name(forward) -> str:
    """The name of a module forward's first parameter, its input (``x``; transformers' ``hidden_states``)."""
    try:
        params = [p for p in inspect.signature(forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return "x"
    return params[0].name if params else "x"


def _input_of(who: str, block: str, name: str, args: tuple, kwargs: dict) -> tuple[object, tuple, dict]:
    """The block's input, given positionally or by its keyword (transformers calls ``self_attn(hidden_states=
    ...)``), and the rest of its arguments."""
    if args:
        return args[0], args[1:], kwargs
    if name in kwargs:
        rest = dict(kwargs)
        return rest.pop(name), (), rest
    raise CommfuseTypeError(f"{who}: {block}'s forward got no input: neither a positional argument nor {name}= "
                            f"(got {', '.join(f'{k}=' for k in kwargs) or 'nothing'})")


def _per_linear(inputs: list[str], output: str, stacked: bool = False) -> str:
    """What to use instead of a block style: the per-linear styles, which keep the block's own forward. A
    stacked projection (``[q; k; v]``, ``[gate; up]``) is no per-rank cut under ``Shard(0)``: its output is
    gathered whole, and the output projection takes it whole (every rank then computes every head)."""
    if stacked:
        plan = ", ".join([f"'{p}': ColwiseParallel(output_layouts=Replicate())" for p in inputs]
                         + [f"'{output}': RowwiseParallel(input_layouts=Replicate())"])
    else:
        plan = ", ".join([f"'{p}': ColwiseParallel()" for p in inputs] + [f"'{output}': RowwiseParallel()"])
    return (f"leave the block's forward to it and fuse each linear with commfuse.tp's per-linear styles "
            f"({plan}, by their paths in the block)")


def _module_at(block: nn.Module, path: str) -> nn.Module | None:
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


def _probe_input(block: nn.Module, features: int, seq: int = 4) -> torch.Tensor | None:
    """A small random input (2, ``seq``, ``features``) in the block's dtype and on its device, from a generator
    of its own (the caller's random stream is left as it was); None where the block's weights are not real
    (the meta device: nothing can be computed before they are)."""
    param = next(block.parameters(), None)
    if param is None or param.device.type == "meta":
        return None
    x = torch.randn(2, seq, features, generator=torch.Generator().manual_seed(1234), dtype=torch.float64)
    return x.to(device=param.device, dtype=param.dtype)


def _own_forward_runs(block: nn.Module, *, required: tuple = ()) -> bool:
    """Whether the block's class defines a forward that can be called with its input and the keywords
    ``required`` only (every other parameter has a default)."""
    forward = type(block).forward
    if forward is nn.Module.forward:
        return False
    try:
        params = list(inspect.signature(forward).parameters.values())[2:]  # self, the input
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in required
               for p in params)


def _run_own(block: nn.Module, x: torch.Tensor, **kwargs):
    """The block's own forward (its class's, before a style replaced it; no hooks of the block) in eval mode,
    without gradients; each module's training flag is put back after."""
    modes = [(m, m.training) for m in block.modules()]
    try:
        block.eval()
        with torch.no_grad():
            return type(block).forward(block, x, **kwargs)
    finally:
        for m, mode in modes:
            m.training = mode


def _tolerance(x: torch.Tensor) -> float:
    """How far a style's computation may be from the block's own on the probe: sums in another order only."""
    return 1e-4 if x.dtype in (torch.float32, torch.float64) else 3e-2


class _MLP:
    """A feed-forward block as :class:`SwiGLUParallel` read it (per block: one style may be applied to many)."""

    __slots__ = ("where", "names", "gate", "up", "gate_up", "down", "activation", "options", "input_name",
                 "hf", "rows")

    def hidden(self, gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
        """The activation of the gate, times the up projection's output where the block is gated."""
        h = ACTIVATIONS[self.activation](gate)
        return h if up is None else h * up

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output as the style computes it, on whole weights in this process (the check)."""
        if self.gate_up is not None:
            gate, up = F.linear(x, self.gate_up.weight, self.gate_up.bias).chunk(2, dim=-1)
        else:
            gate = F.linear(x, self.gate.weight, self.gate.bias)
            up = None if self.up is None else F.linear(x, self.up.weight, self.up.bias)
        return F.linear(self.hidden(gate, up), self.down.weight, self.down.bias)


class SwiGLUParallel(_Style):
    """A feed-forward block, ``w2(act(w1(x)) * w3(x))`` (gated: SwiGLU, GeGLU) or ``w2(act(w1(x)))``, its up
    projections fed by one gather.

    Apply it to the block (e.g. a Llama ``feed_forward``, a transformers ``LlamaMLP``), not its linears:
    ``w1`` and ``w3`` become column-parallel and ``w2`` row-parallel, with torch's placements. With a
    sequence-sharded input (``input_layouts``, default ``Shard(1)``) the forward is one ``all_gather_matmul``
    serving both up projections, the activation and gate, and one ``matmul_reduce_scatter`` into
    ``output_layouts`` (default ``Shard(1)``). ``use_local_output`` (default True) as torch's
    ``RowwiseParallel`` on ``w2``, whose output the block's is: :mod:`commfuse.tp` says when to set it False
    (a DTensor residual stream).

    **The block's parts.** ``w1`` (gate), ``w3`` (up) and ``w2`` (down) name the block's ``nn.Linear``
    projections by their paths in it, dotted where they sit deeper (``"mlp.w1"``); ``gate_up`` names one
    fused projection whose rows are ``[gate; up]`` (Phi-3's ``gate_up_proj``), in place of ``w1`` and
    ``w3``; it is placed ``Replicate()``, its rows as the block holds them (so ``state_dict``, DCP and
    ``full_tensor()`` see the truth), and each rank computes with its rows of the gate and of the up
    projection, their gradients summed over the mesh: the price is that projection's whole weight on every
    rank and an all-reduce of its gradient. (``_StridedShard(0, split_factor=2)`` would state the cut to
    ``full_tensor()``, but torch 2.13's DCP saves and loads such a shard at the wrong rows.)
    ``gated=False`` takes a plain ``w2(act(w1(x)))`` block. ``activation``: ``"silu"`` (the default),
    ``"gelu"``, ``"gelu_tanh"`` or ``"relu"``. Biases on any projection are computed.

    **transformers modules.** Given no names, a transformers MLP is read from itself: ``gate_proj``,
    ``up_proj``, ``down_proj`` (Llama, Qwen, Mistral, Gemma), ``gate_up_proj`` and ``down_proj`` (Phi-3),
    ``fc1`` and ``fc2`` (plain); its activation is its ``act_fn`` / ``activation_fn`` module, told by what it
    computes. ``SwiGLUParallel()`` on a ``Qwen3MLP`` or a ``Gemma3MLP`` needs no arguments.

    **What it verifies when applied.** Every parameter, buffer and submodule of the block is one the style
    computes with (the projections and the activation module); an activation module must compute one of the
    activations above; and where the block's own forward takes its input alone, it is run on a small random
    input in this process and compared with the style's computation on the same whole weights. Anything
    else is refused by name (``CommfuseValueError``: the block's path where it can be found, else its class;
    the part; what to use instead, the per-linear styles, which keep the block's own forward).
    """

    _roles = {"w1": "gate projection", "w2": "down projection", "w3": "up projection",
              "gate_up": "fused gate and up projection"}

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, algorithm: str = "auto", w1: str | None = None,
                 w2: str | None = None, w3: str | None = None, gate_up: str | None = None,
                 gated: bool | None = None, activation: str | None = None) -> None:
        super().__init__(input_layouts=input_layouts or Shard(1), output_layouts=output_layouts or Shard(1),
                         use_local_output=use_local_output, algorithm=algorithm)
        who = "commfuse.tp.SwiGLUParallel"
        if activation is not None and activation not in ACTIVATIONS:
            raise CommfuseValueError(f"{who}: activation={activation!r} is not one the style computes; it takes "
                                     f"{', '.join(map(repr, ACTIVATIONS))}")
        if gate_up is not None and (w1 is not None or w3 is not None):
            raise CommfuseValueError(f"{who}: gate_up={gate_up!r} names one fused projection in place of w1 and w3, "
                                     "but w1 or w3 is given too: give one or the other")
        if gated is False and (w3 is not None or gate_up is not None):
            raise CommfuseValueError(f"{who}: gated=False takes a block without an up projection, but "
                                     f"{'w3' if w3 is not None else 'gate_up'}= names one")
        self.given = {"w1": w1, "w2": w2, "w3": w3, "gate_up": gate_up}
        self.gated, self.activation = gated, activation

    def __repr__(self) -> str:
        return (f"commfuse.tp.SwiGLUParallel(input_layouts={self.input_layouts[0]}, "
                f"output_layouts={self.output_layouts[0]}, use_local_output={self.use_local_output}, "
                f"algorithm={self.algorithm!r}, activation={self.activation!r})")

    def _names(self, module: nn.Module) -> dict[str, str]:
        given = self.given
        if given["gate_up"] is not None:
            return {"gate_up": given["gate_up"], "w2": given["w2"] or "w2"}
        if all(v is None for v in given.values()) and is_transformers(module):
            for names in ({"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
                          {"gate_up": "gate_up_proj", "w2": "down_proj"}, {"w1": "fc1", "w2": "fc2"}):
                gated = "w3" in names or "gate_up" in names
                if all(isinstance(_module_at(module, p), nn.Linear) for p in names.values()) and (
                        self.gated is None or self.gated == gated):
                    return names
        names = {"w1": given["w1"] or "w1", "w2": given["w2"] or "w2"}
        if self.gated is not False:
            names["w3"] = given["w3"] or "w3"
        return names

    def _read(self, module: nn.Module, mesh: DeviceMesh) -> _MLP:
        who = "commfuse.tp.SwiGLUParallel"
        names = self._names(module)
        lin = _linears(self, module, names, mesh)
        parts = _MLP()
        parts.where, parts.names, parts.hf = where(module), names, is_transformers(module)
        parts.gate, parts.up, parts.gate_up, parts.down = lin.get("w1"), lin.get("w3"), lin.get("gate_up"), lin["w2"]
        parts.input_name = _input_name(module.forward)
        claimed = list(names.values())
        acts = [p for p in ("act_fn", "activation_fn", "act", "activation") if isinstance(getattr(module, p, None),
                                                                                        nn.Module)]
        inputs = [p for k, p in names.items() if k != "w2"]
        instead = _per_linear(inputs, names["w2"], stacked="gate_up" in names)
        parts.activation = self.activation or "silu"
        if acts:
            path, child = acts[0], getattr(module, acts[0])
            found = activation_name(child)
            if found is None:
                raise CommfuseValueError(
                    f"{who}: {parts.where} has the activation {path!r} ({type(child).__name__}), which computes none "
                    f"of the activations the style computes ({', '.join(ACTIVATIONS)}); {instead}")
            if self.activation is not None and self.activation != found:
                raise CommfuseValueError(
                    f"{who}: {parts.where}'s activation {path!r} ({type(child).__name__}) computes {found!r}, but "
                    f"activation={self.activation!r} is given: give the block's, or none")
            parts.activation = found
            claimed.append(path)
        left = unclaimed(module, claimed)
        if left:
            raise CommfuseValueError(
                f"{who}: {parts.where} holds {', '.join(left)}, which the style does not compute (it computes "
                f"{' and '.join(repr(p) for p in claimed)}: down(act(gate(x)) * up(x))); {instead}")
        down = parts.down
        up_out = parts.gate_up.out_features // 2 if parts.gate_up is not None else parts.gate.out_features
        if parts.up is not None and parts.up.out_features != up_out or down.in_features != up_out:
            raise CommfuseValueError(
                f"{who}: {parts.where}'s projections do not chain: the gate gives {up_out} features, "
                f"{'' if parts.up is None else f'the up projection {parts.up.out_features}, '}the down "
                f"projection {names['w2']!r} takes {down.in_features}")
        if parts.gate_up is not None and (parts.gate_up.out_features % 2
                                          or (parts.gate_up.out_features // 2) % mesh.size()):
            raise CommfuseValueError(
                f"{who}: {parts.where}'s fused gate and up projection {names['gate_up']!r} has "
                f"{parts.gate_up.out_features} rows, which are not [gate; up] of equal size each dividing by the "
                f"mesh's {mesh.size()} ranks (each rank computes with its rows of each)")
        self._verify(module, parts, instead)
        parts.options = (("gate_bias", bool((parts.gate_up or parts.gate).bias is not None)),
                         ("up_bias", bool(parts.up is not None and parts.up.bias is not None)),
                         ("down_bias", down.bias is not None), ("activation", parts.activation),
                         ("gated", parts.up is not None or parts.gate_up is not None),
                         ("gate_up", parts.gate_up is not None))
        return parts

    def _verify(self, module: nn.Module, parts: _MLP, instead: str) -> None:
        """The block's own forward against the style's computation, on a small input (where it can run)."""
        if not _own_forward_runs(module):
            return
        x = _probe_input(module, (parts.gate_up or parts.gate).in_features)
        if x is None:
            return
        try:
            want = _run_own(module, x)
        except Exception:  # noqa: BLE001 - a forward that needs more than its input: not checked this way
            return
        if not isinstance(want, torch.Tensor) or want.shape[:-1] != x.shape[:-1]:
            return
        with torch.no_grad():
            got = parts.reference(x)
        off = differs(got, want) if got.shape == want.shape else float("inf")
        if not off <= _tolerance(x):
            raise CommfuseValueError(
                f"commfuse.tp.SwiGLUParallel: {parts.where}'s own forward differs from what the style computes "
                f"(down(act(gate(x)) * up(x)) with activation {parts.activation!r}"
                f"{'' if parts.up is not None or parts.gate_up is not None else ', not gated'}) by {off:.3g} "
                f"relative on a random input: the block computes something else; {instead}")

    def _arguments_given(self) -> list[tuple[str, object]]:
        return [*super()._arguments_given(), *((f"{k}=", v) for k, v in self.given.items()), ("gated", self.gated),
                ("activation", self.activation)]

    def _decisions(self, parts: _MLP) -> list[tuple[str, object]]:
        return [("read as", " ".join(f"{k}={v!r}" for k, v in parts.names.items())), ("transformers", parts.hf),
                ("input", parts.input_name), *((f"computes {k}", v) for k, v in parts.options)]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        parts = self._agreed(module, device_mesh, lambda: self._read(module, device_mesh))
        if parts.gate_up is not None:
            _replicated_stacked(self, parts.gate_up, device_mesh)
            half = parts.gate_up.out_features // 2
            parts.rows = _stacked_rows([half, half], device_mesh.get_local_rank(), device_mesh.size())
        else:
            _colwise(self, parts.gate, device_mesh)
            if parts.up is not None:
                _colwise(self, parts.up, device_mesh)
        _rowwise(self, parts.down, device_mesh)
        who = "commfuse.tp.SwiGLUParallel"

        def read(args, kwargs):
            x, rest, more = _input_of(who, parts.where, parts.input_name, args, kwargs)
            if rest or more:
                given = [f"argument {i + 2} ({_described(v)})" for i, v in enumerate(rest)]
                given += [f"{k}= ({_described(v)})" for k, v in more.items()]
                raise CommfuseTypeError(f"{who}: {parts.where}'s forward got {', '.join(given)} besides its input; "
                                        "a feed-forward block takes its input only: commfuse does not ignore an "
                                        "argument")
            return _Call(x)

        def forward(module, mesh, call):
            return self._forward(mesh, parts, call.x)

        return self._install(module, device_mesh, forward, read)

    def _forward(self, mesh: DeviceMesh, parts: _MLP, x) -> torch.Tensor:
        who = "commfuse.tp.SwiGLUParallel"
        options = (who, parts.options)
        if parts.gate_up is not None:
            (both,) = self._columns(mesh, x, [parts.gate_up], who, options, parts.rows)
            gate, up = both.chunk(2, dim=-1)  # this rank's rows of each
        elif parts.up is not None:
            gate, up = self._columns(mesh, x, [parts.gate, parts.up], who, options)
        else:
            (gate,), up = self._columns(mesh, x, [parts.gate], who, options), None
        return self._row(mesh, parts.hidden(gate, up), parts.down, who, options)


def _stacked_rows(sizes: list[int], rank: int, n: int) -> torch.Tensor:
    """This rank's rows of a projection whose rows are blocks of ``sizes`` stacked (``[gate; up]``, ``[q; k;
    v]``): its ``1/n`` of each block, in block order (int64 indices)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return torch.cat([torch.arange(start + rank * (size // n), start + (rank + 1) * (size // n))
                      for start, size in zip(starts, sizes)])


def _replicated_stacked(style: _Style, linear: nn.Linear, mesh: DeviceMesh) -> None:
    """A stacked projection placed ``Replicate()``: every rank holds the rows as the block holds them, so
    ``full_tensor()``, ``state_dict`` and DCP see the truth. (``_StridedShard(0, split_factor)`` states each
    rank's rows of each block to ``full_tensor()``, but torch 2.13's DCP reads and writes such a shard as one
    contiguous chunk at the wrong offset: a checkpoint of other rows, silently.) The style computes with this
    rank's rows of it (:class:`_Rows`)."""
    style._distribute(linear, "weight", mesh, Replicate())
    if linear.bias is not None:
        style._distribute(linear, "bias", mesh, Replicate())


class _Rows:
    """This rank's rows of a replicated projection, as ``_columns`` reads a linear (``weight``, ``bias``, each
    with ``to_local()``): taken per call from the local whole, so their gradients land in the rows they came
    from, summed over ``group`` (every rank holds the whole parameter, and each computed with its rows)."""

    __slots__ = ("weight", "bias")

    def __init__(self, linear: nn.Linear, rows: torch.Tensor, group) -> None:
        self.weight = _Local(_picked(linear.weight, rows, group))
        self.bias = None if linear.bias is None else _Local(_picked(linear.bias, rows, group))


class _Local:
    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to_local(self) -> torch.Tensor:
        return self.t


def _picked(param, rows: torch.Tensor, group) -> torch.Tensor:
    whole = param.to_local() if isinstance(param, DTensor) else param
    if group is not None:
        whole = replicated(whole, group)
    return whole.index_select(0, rows.to(whole.device))


#: parameter names of a KV cache: never a rope hook's, refused when not None (the style attends over the call's
#: own tokens and would neither read nor update a cache)
_CACHE_NAMES = ("kv_cache", "past_key_values", "past_key_value", "layer_past", "past")
#: what transformers' decoder layers hand an attention module that its own forward does not read under the eager
#: and SDPA attention (the positions are in ``position_embeddings``; the cache position and ``use_cache`` only
#: matter to a cache, which is refused; a mixture of experts' output_router_logits is its router's)
_TRANSFORMERS_UNREAD = ("position_ids", "cache_position", "use_cache", "output_router_logits")
#: the attention functions of transformers whose computation the style mirrors (``config._attn_implementation``)
_TRANSFORMERS_ATTENTION = (None, "eager", "sdpa")


class _Attention:
    """An attention block as an attention style read it (per block: one style may be applied to many): its
    projections and their layout, its per-head norms, its attention options and its calling convention."""

    __slots__ = ("where", "names", "projections", "wo", "layout", "heads_per_kv", "head_dim", "q_norm", "k_norm",
                 "scale", "softcap", "window", "causal", "dropout", "hf", "implementation", "rope_fn",
                 "input_name", "arg_names", "options", "instead", "rows")

    def heads(self, ys: list, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (b, s, heads, head_dim) from the projections' outputs (whole heads, or this rank's)."""
        d = self.head_dim
        if self.layout == "separate":
            return tuple(y.view(b, s, -1, d) for y in ys)
        if self.layout == "grouped":
            return _split_qkv(ys[0], self.heads_per_kv, d)
        # stacked [q; k; v] (whole, or this rank's rows of each): q is heads_per_kv times as wide as k and v
        kv = ys[0].shape[-1] // (self.heads_per_kv + 2)
        return tuple(t.reshape(b, s, -1, d) for t in ys[0].split([kv * self.heads_per_kv, kv, kv], dim=-1))

    def normed(self, q: torch.Tensor, k: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k through the block's per-head norms (QK-norm), where it has them."""
        if self.q_norm is not None:
            q = _norm(self.q_norm, q, group)
        if self.k_norm is not None:
            k = _norm(self.k_norm, k, group)
        return q, k

    def rotated(self, q: torch.Tensor, k: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated by transformers' ``position_embeddings`` (cos, sin), with the block's family's own
        rotary function (which takes (batch, heads, seq, head_dim))."""
        cos, sin = rotary
        qt, kt = self.rope_fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return qt.transpose(1, 2), kt.transpose(1, 2)

    def causal_for(self, masked: bool) -> bool:
        """Whether the attention is causal on top of the mask: transformers' SDPA attention is causal only
        without a mask (the mask then holds it), its eager attention never (the mask holds it); a block of the
        explicit form applies ``causal`` and its mask together."""
        if not self.hf:
            return self.causal
        return self.causal and not masked and self.implementation == "sdpa"

    def reference(self, x: torch.Tensor, rotary) -> torch.Tensor:
        """The block's output as the style computes it, on whole weights in this process (the check)."""
        b, s = x.shape[0], x.shape[1]
        q, k, v = self.heads([F.linear(x, lin.weight, lin.bias) for lin in self.projections], b, s)
        q, k = self.normed(q, k)
        q, k = self.rotated(q, k, rotary)
        o = fused_attention.attend(q, k, v, causal=self.causal_for(False), scale=self.scale, softcap=self.softcap,
                                   window=None if self.hf else self.window)
        return F.linear(o.reshape(b, s, -1), self.wo.weight, self.wo.bias)


def _norm(norm: nn.Module, t: torch.Tensor, group) -> torch.Tensor:
    """``norm(t)`` with the norm's parameters as local tensors (they are replicated DTensors once the style is
    applied), their gradients summed over ``group`` (each rank normalizes other heads with the same weights)."""
    params = dict(norm.named_parameters())
    if not params:
        return norm(t)
    local = {}
    for name, p in params.items():
        p = p.to_local() if isinstance(p, DTensor) else p
        local[name] = replicated(p, group) if group is not None else p
    return torch.func.functional_call(norm, local, (t,), strict=False)


def _attention_config(style: _Style, parts: _Attention) -> tuple:
    """What an :class:`AttentionParallel` computes with that the shapes do not show, for its ops'
    fingerprints (and the ranks' agreement when it is applied)."""
    return (("causal", parts.causal), ("head_dim", parts.head_dim), ("rope", style.rope is not None),
            ("rope_module", style.rope_takes_module), ("layout", parts.layout),
            *zip(("q_bias", "k_bias", "v_bias") if len(parts.projections) == 3 else ("qkv_bias",),
                 (lin.bias is not None for lin in parts.projections)),
            ("heads_per_kv", parts.heads_per_kv or 0), ("o_bias", parts.wo.bias is not None),
            ("q_norm", type(parts.q_norm).__name__), ("k_norm", type(parts.k_norm).__name__),
            ("scale", 0.0 if parts.scale is None else float(parts.scale)),
            ("softcap", 0.0 if parts.softcap is None else float(parts.softcap)),
            ("window", parts.window or 0), ("transformers", parts.implementation or "no"))


class _AttentionStyle(_Style):
    """What the attention block styles share: the projections named by their paths (three, or one fused
    ``qkv``), ``head_dim``, the rope hook and the block's other forward arguments (masks by name, the rest to
    the hook), and the reading and checking of the block (:class:`_Attention`). :class:`AttentionParallel`
    (heads over the mesh) and :class:`RingAttentionParallel` (the sequence over the mesh) differ in what they do
    with them."""

    _native = False  # their rings are the consume and produce forms, not fused GEMMs
    _roles = {"wq": "query projection", "wk": "key projection", "wv": "value projection",
              "qkv": "fused QKV projection", "wo": "output projection", "q_norm": "query norm",
              "k_norm": "key norm"}
    #: the keywords the style itself gives the rope hook (besides ``module=`` with ``rope_takes_module``)
    _hook_keywords: tuple = ()
    #: whether the style computes per-head norms, a scale, a soft-cap, a window and transformers modules
    _extended = False

    @property
    def _who(self) -> str:
        return f"commfuse.tp.{type(self).__name__}"

    def _arguments_given(self) -> list[tuple[str, object]]:
        return [*super()._arguments_given(), ("head_dim", self.head_dim), ("causal", self.causal),
                ("rope", _named(self.rope)), ("rope_takes_module", self.rope_takes_module),
                *((f"{k}=", v) for k, v in {**self.given, **self.norm_names}.items()),
                *((k, getattr(self, k, None)) for k in ("scale", "softcap", "window", "qkv_layout"))]

    def _decisions(self, parts: _Attention) -> list[tuple[str, object]]:
        return [("read as", " ".join(f"{k}={v!r}" for k, v in parts.names.items())), ("qkv layout", parts.layout),
                ("head_dim read", parts.head_dim), ("query heads per key/value head", parts.heads_per_kv),
                ("query norm", type(parts.q_norm).__name__), ("key norm", type(parts.k_norm).__name__),
                ("scale read", parts.scale), ("softcap read", parts.softcap), ("window read", parts.window),
                ("causal read", parts.causal), ("attention dropout", parts.dropout), ("transformers", parts.hf),
                ("attention function", parts.implementation), ("rotary function", _named(parts.rope_fn)),
                ("input", parts.input_name), ("forward arguments", ", ".join(parts.arg_names))]

    def _attention_options(self, *, head_dim: int | None, causal: bool | None, rope, rope_takes_module: bool, wq, wk,
                           wv, qkv, wo, q_norm=None, k_norm=None, scale=None, softcap=None, window=None,
                           qkv_layout: str = "grouped") -> None:
        if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0):
            raise CommfuseValueError(f"head_dim must be a positive int, got {head_dim!r}")
        if rope is not None and not callable(rope):
            raise CommfuseTypeError(f"rope must be callable as rope(q, k, *args, **kwargs) -> (q, k), got {rope!r}")
        self.head_dim, self.causal, self.rope = head_dim, causal, rope
        self.rope_takes_module = bool(rope_takes_module)
        if self.rope_takes_module and (rope is None or not _takes_keyword(rope, "module")):
            got = "no rope hook is given" if rope is None else \
                f"the rope hook {getattr(rope, '__name__', rope)!r} takes no keyword 'module'"
            raise CommfuseTypeError(f"{self._who}: rope_takes_module=True calls the rope hook as "
                                    f"rope(q, k, *args, module=block, **kwargs), but {got}")
        for keyword in self._hook_keywords:
            if rope is not None and not _takes_keyword(rope, keyword):
                raise CommfuseTypeError(
                    f"{self._who}: the rope hook {getattr(rope, '__name__', rope)!r} takes no keyword {keyword!r}; "
                    f"the style calls it as rope(q, k, *args, {keyword}=..., **kwargs)")
        # the style gives the hook module= (and its own keywords) itself: none of the block's own arguments is
        # routed to those names
        given = (("module",) if self.rope_takes_module else ()) + self._hook_keywords
        self._rope_takes = (0, frozenset()) if rope is None else _takes(rope, 2, given=given)
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
            raise CommfuseValueError(f"{self._who}: scale must be a positive number (the scores' factor), got "
                                     f"{scale!r}")
        if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                    or softcap <= 0):
            raise CommfuseValueError(f"{self._who}: softcap must be a positive number, got {softcap!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise CommfuseValueError(f"{self._who}: window must be a positive int (keys per query), got {window!r}")
        if window is not None and causal is False:
            raise CommfuseValueError(f"{self._who}: window={window} is a causal sliding window, but causal=False")
        if qkv_layout not in ("grouped", "stacked"):
            raise CommfuseValueError(f"{self._who}: qkv_layout must be 'grouped' (torchtitan's FusedQKVLinear: per "
                                     f"key/value group its queries, key and value) or 'stacked' (Phi-3's qkv_proj: "
                                     f"[all q; all k; all v]), got {qkv_layout!r}")
        self.scale, self.softcap, self.window, self.qkv_layout = scale, softcap, window, qkv_layout
        self.norm_names = {"q_norm": q_norm, "k_norm": k_norm}
        separate = {"wq": wq, "wk": wk, "wv": wv}
        if qkv is not None:
            given = [f"{name}={value!r}" for name, value in separate.items() if value is not None]
            if given:
                raise CommfuseValueError(f"{self._who}: qkv={qkv!r} names one fused QKV "
                                         f"projection in place of wq, wk and wv, but {', '.join(given)} is given "
                                         "too: give one or the other")
        self.given = {**separate, "qkv": qkv, "wo": wo}

    def _instead(self, inputs: list[str], output: str, stacked: bool = False) -> str:
        """What a refusal suggests instead of the style."""
        return _per_linear(inputs, output, stacked)

    def _names(self, module: nn.Module) -> tuple[dict[str, str], str]:
        """The block's projections by argument (given, read from a transformers module, or the defaults
        ``wq``, ``wk``, ``wv``, ``wo``) and the layout of a fused one."""
        given = self.given
        if given["qkv"] is not None:
            return {"qkv": given["qkv"], "wo": given["wo"] or "wo"}, self.qkv_layout
        explicit = any(given[k] is not None for k in ("wq", "wk", "wv"))
        if not explicit and self._extended and is_transformers(module):
            if isinstance(_module_at(module, "qkv_proj"), nn.Linear):
                return {"qkv": "qkv_proj", "wo": given["wo"] or "o_proj"}, "stacked"
            if isinstance(_module_at(module, "q_proj"), nn.Linear):
                return {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": given["wo"] or "o_proj"}, "separate"
        names = {name: given[name] or name for name in ("wq", "wk", "wv")}
        return {**names, "wo": given["wo"] or "wo"}, "separate"

    def _read(self, module: nn.Module, device_mesh: DeviceMesh, n: int) -> _Attention:
        """The block read and checked: its projections (heads split evenly over ``n`` ranks; 1: no head split),
        its norms and options, and nothing it holds that the style does not compute."""
        who = self._who
        parts = _Attention()
        parts.where, parts.hf = where(module), self._extended and is_transformers(module)
        if is_transformers(module) and not self._extended:
            raise CommfuseValueError(
                f"{who}: {parts.where} is a transformers module, whose calling convention (hidden_states=, "
                f"position_embeddings=, a tuple returned) this style does not take; use AttentionParallel over "
                "the TP axis, or a block of the explicit form")
        names, parts.layout = self._names(module)
        parts.names = names
        lin = _linears(self, module, names, device_mesh)
        parts.wo = lin["wo"]
        parts.projections = [lin["qkv"]] if "qkv" in lin else [lin["wq"], lin["wk"], lin["wv"]]
        parts.input_name = _input_name(module.forward)
        parts.arg_names = _positional_names(module.forward)
        inputs = [p for k, p in names.items() if k != "wo"]
        parts.instead = instead = self._instead(inputs, names["wo"], parts.layout == "stacked")
        config_ = getattr(module, "config", None) if parts.hf else None
        # the head size, the scale, the cap, the window, causality: the block's own where it holds them
        head_dim = self.head_dim
        own = getattr(module, "head_dim", None) if parts.hf else None
        if own is not None and head_dim is not None and own != head_dim:
            raise CommfuseValueError(f"{who}: {parts.where} has head_dim {own}, but head_dim={head_dim} is given: "
                                     "give the block's, or none")
        head_dim = head_dim or own
        if head_dim is None:
            raise CommfuseValueError(f"{who}: head_dim is not given and {parts.where} holds none (a transformers "
                                     "module's head_dim is read from it): give head_dim=")
        parts.head_dim = head_dim
        parts.scale, parts.softcap, parts.window = self.scale, self.softcap, self.window
        parts.causal = True if self.causal is None else bool(self.causal)
        parts.dropout, parts.implementation, parts.rope_fn = 0.0, None, None
        if parts.hf:
            self._read_transformers(module, parts, config_)
        # the per-head norms: named, or a transformers module's q_norm / k_norm
        norms = {}
        for role, path in self.norm_names.items():
            if path is None and parts.hf and isinstance(getattr(module, role, None), nn.Module):
                path = role
            if path is None:
                continue
            child = _module_at(module, path) if isinstance(path, str) else None
            if child is None:
                raise CommfuseValueError(f"{who}: {parts.where} has no submodule {path!r} (the {role}= argument, "
                                         f"its {self._roles[role]})")
            if not per_head(child, head_dim):
                shapes = ", ".join(f"{name} {list(t.shape)}" for name, t in
                                   [*child.named_parameters(), *child.named_buffers()])
                raise CommfuseValueError(
                    f"{who}: {parts.where}'s {self._roles[role]} {path!r} ({type(child).__name__}: {shapes}) does "
                    f"not normalize one head of {head_dim} features at a time; a norm over all heads' features "
                    f"(OLMo 2's) needs every rank's heads, which the style does not gather; {instead}")
            norms[role] = (path, child)
        parts.q_norm = norms.get("q_norm", (None, None))[1]
        parts.k_norm = norms.get("k_norm", (None, None))[1]
        # the heads: whole on every rank
        parts.heads_per_kv = None
        if parts.layout == "grouped":
            parts.heads_per_kv = self._kv_groups(parts, lin["qkv"], parts.wo, n)
        elif parts.layout == "stacked":
            self._stacked(parts, lin["qkv"], parts.wo, n)
        else:
            for argument in ("wq", "wk", "wv"):
                out = lin[argument].out_features
                if out % head_dim or (out // head_dim) % n:
                    raise CommfuseValueError(
                        f"{who}: the {self._roles[argument]} {names[argument]!r} has "
                        f"{out} features, which is not whole heads of {head_dim} split evenly over {n} ranks: every "
                        f"rank must hold whole heads")
        claimed = list(names.values()) + [path for path, _ in norms.values()]
        left = unclaimed(module, claimed, hook_reads_block=self.rope_takes_module)
        if left:
            hint = " (per-head norms are named with q_norm= and k_norm=)" if self._extended and any(
                "Norm" in part for part in left) else ""
            raise CommfuseValueError(
                f"{who}: {parts.where} holds {', '.join(left)}, which the style does not compute (it computes "
                f"{', '.join(repr(p) for p in claimed)}){hint}; {instead}")
        return parts

    def _read_transformers(self, module: nn.Module, parts: _Attention, config_) -> None:
        """A transformers attention module's options, read from it: the scale (``scaling``: Gemma 2's
        ``query_pre_attn_scalar`` is in it), the logit soft-cap, the sliding window, causality, attention
        dropout and the attention function; the family's rotary function."""
        who = parts.where
        implementation = getattr(config_, "_attn_implementation", None)
        if implementation not in _TRANSFORMERS_ATTENTION:
            raise CommfuseValueError(
                f"{self._who}: {who} runs transformers' {implementation!r} attention; the style computes what the "
                f"'eager' and 'sdpa' attentions compute: build the model with attn_implementation='sdpa' or "
                f"'eager', or {parts.instead}")
        parts.implementation = implementation or "eager"
        if self.rope is not None:
            raise CommfuseValueError(f"{self._who}: {who} rotates q and k by the position_embeddings it is given, "
                                     "with its family's own rotary function; a rope hook is not taken for it")
        own = {"scale": getattr(module, "scaling", None), "softcap": getattr(module, "attn_logit_softcapping", None),
               "causal": getattr(module, "is_causal", True)}
        for name, value in own.items():
            mine = getattr(self, name)
            if mine is not None and value is not None and float(mine) != float(value):
                raise CommfuseValueError(f"{self._who}: {who} has {name} {value!r}, but {name}={mine!r} is given: "
                                         "give the block's, or none")
        parts.scale = float(own["scale"]) if own["scale"] is not None else parts.scale
        parts.softcap = float(own["softcap"]) if own["softcap"] is not None else parts.softcap
        parts.causal = bool(own["causal"])
        window = getattr(module, "sliding_window", getattr(config_, "sliding_window", None))
        parts.window = int(window) if window else None  # transformers applies it through the mask it builds
        parts.dropout = float(getattr(module, "attention_dropout", 0.0) or 0.0)
        parts.rope_fn = transformers_rope(module)
        if parts.rope_fn is None:
            raise CommfuseValueError(f"{self._who}: {who}'s modeling file has no apply_rotary_pos_emb, the rotary "
                                     f"function the style applies position_embeddings with; {parts.instead}")

    def _stacked(self, parts: _Attention, qkv: nn.Linear, wo: nn.Linear, n: int) -> None:
        """A fused projection whose rows are [all q; all k; all v] (Phi-3's ``qkv_proj``), checked: each rank's
        1/n of each block is whole heads, its query heads those that share its key/value heads."""
        d, path = parts.head_dim, parts.names["qkv"]
        heads = wo.in_features // d
        kv_heads = (qkv.out_features // d - heads) // 2
        if wo.in_features % d or qkv.out_features % d or kv_heads <= 0 \
                or qkv.out_features != (heads + 2 * kv_heads) * d:
            raise CommfuseValueError(
                f"{self._who}: the fused QKV projection {path!r} of {parts.where} has {qkv.out_features} rows, which "
                f"are not [q; k; v] heads of {d} with n_heads = {wo.in_features / d:g} read from the output "
                f"projection {parts.names['wo']!r}")
        if heads % kv_heads or kv_heads % n:
            raise CommfuseValueError(
                f"{self._who}: the fused QKV projection {path!r} of {parts.where} stacks {heads} query heads over "
                f"{kv_heads} key/value heads, which do not split evenly over {n} ranks with whole groups: every rank "
                f"must hold whole key/value heads and the query heads that share them; {parts.instead}")
        parts.heads_per_kv = heads // kv_heads

    def _kv_groups(self, parts: _Attention, qkv: nn.Linear, wo: nn.Linear, n: int) -> int:
        """The query heads per key/value head of a fused QKV projection (torchtitan's ``FusedQKVLinear``
        layout), read from its rows and ``wo``'s input features, checked: each of the ``n`` ranks must hold
        whole key/value groups."""
        d, path = parts.head_dim, parts.names["qkv"]
        heads, rows = wo.in_features // d, qkv.out_features // d
        kv_heads = (rows - heads) // 2
        if wo.in_features % d or qkv.out_features % d or kv_heads <= 0 or rows != heads + 2 * kv_heads \
                or heads % kv_heads:
            raise CommfuseValueError(
                f"{self._who}: the fused QKV projection {path!r} has {qkv.out_features} "
                f"features, which is not (n_heads + 2 * n_kv_heads) heads of {d} laid out as torchtitan's "
                f"FusedQKVLinear, with n_heads = {wo.in_features / d:g} read from the output projection "
                f"{parts.names['wo']!r} ({wo.in_features} input features) and n_heads dividing by n_kv_heads"
            )
        if kv_heads % n:
            raise CommfuseValueError(
                f"{self._who}: the fused QKV projection {path!r} holds n_kv_heads = {kv_heads} "
                f"key/value groups, which do not split evenly over {n} ranks: under Shard(0) every rank must hold "
                f"whole groups (its query heads, key head and value head)"
            )
        return heads // kv_heads

    def _arguments(self, names: tuple, args: tuple, kwargs: dict) -> tuple[dict, tuple, dict]:
        """The block's extra forward arguments split into (masks by name, rope's positional, rope's keyword),
        as the class docstring says; a KV cache that is not None, and what is neither a mask nor the hook's,
        is refused by name."""
        masks, rest, more, caches = {}, [], {}, []
        for i, value in enumerate(args):
            name = names[i] if i < len(names) else None
            if name in _CACHE_NAMES:
                caches.append((name, value))
            elif fused_attention.is_mask(name, value):
                masks[name or f"argument {i + 1} (a {type(value).__name__})"] = value
            else:
                rest.append((name, i, value))
        for name, value in kwargs.items():
            if name in _CACHE_NAMES:
                caches.append((name, value))
            elif fused_attention.is_mask(name, value):
                masks[name] = value
            else:
                more[name] = value
        self._refuse_cache(caches)
        positional, keywords = self._rope_takes
        refused = [] if positional is None else \
            [f"{name or f'argument {i + 1}'} ({_described(value)})" for name, i, value in rest[positional:]]
        refused += [f"{name}= ({_described(value)})" for name, value in more.items()
                    if keywords is not None and name not in keywords]
        if refused:
            hook = "no rope hook is given" if self.rope is None else \
                f"the rope hook {getattr(self.rope, '__name__', self.rope)!r} does not take it"
            raise CommfuseTypeError(
                f"{self._who}: the block's forward got {', '.join(refused)}, which is not a mask "
                f"(a parameter named {', '.join(fused_attention.MASK_NAMES)}, or a FlexAttention BlockMask or a "
                f"VarlenMetadata) and {hook}; commfuse does not ignore an argument: name a mask's parameter so, or, "
                "for an argument the rotary embedding reads (positions, a rotary cache), give a rope hook that takes "
                "it"
            )
        return masks, tuple(value for _, _, value in rest), more

    def _refuse_cache(self, caches: list) -> None:
        given = [f"{name}= ({_described(value)})" for name, value in caches if value is not None]
        if given:
            raise CommfuseValueError(
                f"{self._who}: the block's forward got the KV cache {', '.join(given)}; the style attends over the "
                "tokens of this call only and would neither read the cache nor write this call's keys and values "
                "into it. Run without a cache (transformers: use_cache=False, as training does), or generate with "
                "the block's own forward (the per-linear styles ColwiseParallel/RowwiseParallel keep it)")


class AttentionParallel(_AttentionStyle):
    """Self-attention with heads split over the mesh and the queries split over the ring (TPSP, query-split).

    Apply it to the attention block, whose ``nn.Linear`` projections to and
    from heads of ``head_dim`` are named by the arguments ``wq``, ``wk``,
    ``wv`` and ``wo`` (defaults ``"wq"``...), each by its path in the block,
    dotted where it sits deeper (torchtitan's ``"qkv_linear.wq"``); they are
    found when the style is applied, and stay where they are (their
    parameters' names and state-dict keys do not change). The projections
    become column-parallel and ``wo`` row-parallel, with torch's placements,
    so each rank holds whole heads (grouped-query attention included). The
    forward, for a sequence-sharded input (``input_layouts``, default
    ``Shard(1)``):

    - one ``all_gather_matmul`` of the input serves the Q, K and V projections
      (their biases added, where they have them);
    - ``q_norm`` and ``k_norm``, when named, are the block's per-head norms
      (QK-norm: any norm module over one head's ``head_dim`` features, as in
      Qwen3 and Gemma 3), applied to q and k before the rotary embedding; they
      stay the block's modules, their parameters replicated over the mesh
      (``Replicate()`` DTensors) and their gradients summed over it;
    - ``rope(q, k, *args, **kwargs) -> (q, k)``, when given, turns the rotary
      embeddings on with the block's own extra forward arguments (a Llama
      block's ``freqs_cis``) but its masks; q and k are (batch, sequence,
      local heads, head_dim) over the whole sequence. With
      ``rope_takes_module=True`` the hook also gets the block, by keyword:
      ``rope(q, k, *args, module=block, **kwargs)``, for a block that keeps
      its own rotary module (torchtitan's ``attention.rope``, called as
      ``rope(xq, xk, positions)``)::

          def rope(q, k, positions=None, *, module):
              return module.rope(q, k, positions)

    - with a sequence-sharded output (``output_layouts``, default
      ``Shard(1)``) each query slice's attention and its ``wo`` partial are the
      producer of a reduce-scatter ring (``produce_reduce_scatter``): the ring
      carries one slice's partial while the next slice is computed; each
      slice takes its rows of the mask and its keys' columns.

    ``causal`` (default True) masks each query to the keys up to its
    position; ``window`` keeps only the last ``window`` of them (a sliding
    window). ``scale`` is the scores' factor (default ``1 / sqrt(head_dim)``)
    and ``softcap`` caps the scores, ``softcap * tanh(scores / softcap)``,
    before the mask and the softmax (Gemma 2). ``use_local_output`` (default
    True) as torch's ``RowwiseParallel`` on ``wo``, whose output the block's
    is: :mod:`commfuse.tp` says when to set it False (a DTensor residual
    stream).

    **One fused QKV projection.** ``qkv`` (in place of ``wq``, ``wk``, ``wv``)
    names one ``nn.Linear``. With ``qkv_layout="grouped"`` (the default) its
    output rows are torchtitan's ``FusedQKVLinear`` layout,
    ``(n_kv_heads, R, head_dim)`` with ``R = n_heads // n_kv_heads + 2``: for
    each key/value head, its ``n_heads // n_kv_heads`` query heads, then its
    key head, then its value head. ``n_heads`` is read from ``wo`` (its input
    features over ``head_dim``) and ``n_kv_heads`` from the rest of the rows.
    The projection is column-parallel (``Shard(0)``, as torch's
    ``ColwiseParallel`` and torchtitan shard it), so each rank's rows are
    whole key/value groups: ``n_kv_heads`` must divide by the mesh size. The
    one gather feeds the one fused GEMM, whose output is split per group into
    q, k and v as ``FusedQKVLinear.forward`` splits it. With
    ``qkv_layout="stacked"`` the rows are ``[all q; all k; all v]`` (Phi-3's
    ``qkv_proj``), placed ``Replicate()`` so that ``full_tensor()``,
    ``state_dict`` and DCP see the rows as the block holds them; each rank
    computes with its rows of q, k and v, their gradients summed over the
    mesh (the price: the projection's whole weight on every rank and an
    all-reduce of its gradient; ``_StridedShard`` would state the cut, but
    torch 2.13's DCP saves and loads such a shard at the wrong rows, and a
    plain ``Shard(0)`` would hand each rank other heads). Grouped-query
    ``[q; k; v]`` included: each rank takes its key/value heads' rows and
    those of the query heads that share them.

    **transformers modules.** Given no projection names, a transformers
    attention module (Llama, Mistral, Mixtral, Qwen2, Qwen3, Gemma, Gemma 2,
    Gemma 3, Phi-3...) is read from itself: ``q_proj``, ``k_proj``,
    ``v_proj``, ``o_proj`` or ``qkv_proj`` (stacked) and ``o_proj``, its
    ``head_dim``, ``scaling`` (Gemma's ``query_pre_attn_scalar`` is in it),
    ``attn_logit_softcapping``, ``is_causal``, ``q_norm`` and ``k_norm``, its
    ``attention_dropout`` and its config's attention function (``eager`` or
    ``sdpa``; others are refused). ``AttentionParallel()`` on a
    ``Qwen3Attention`` needs no arguments, and the module then takes what
    transformers hands it: ``hidden_states=`` by keyword,
    ``position_embeddings=(cos, sin)`` over the whole sequence (applied with
    the family's own ``apply_rotary_pos_emb``), ``attention_mask`` (the 4-D
    mask transformers builds per layer, sliding windows included; the
    attention is causal where transformers' own is: without a mask under
    ``sdpa``), ``position_ids``, ``cache_position`` and ``use_cache`` (which
    its attention does not read), and returns ``(output, None)`` as its own
    forward returns ``(output, attention weights)``. Refused by name there: a
    ``past_key_values`` cache that is not None (give ``use_cache=False``), a
    sliding-window layer called without a mask over a sequence longer than
    its window, ``output_attentions=True``, attention dropout in training, and
    any other argument that is not None.

    **What it verifies when applied.** Every parameter, buffer and submodule
    of the block is one the style computes with (the projections and norms;
    with ``rope_takes_module=True`` also modules without parameters, which
    the hook may read), a norm is per head, and the heads split evenly; for a
    transformers module, its own forward is run on a small random input in
    this process and compared with the style's computation on the same whole
    weights. Anything else is refused by name (``CommfuseValueError``: the
    block's path where it can be found, else its class; the part; what to
    use instead, the per-linear styles, which keep the block's own forward).

    **Masks and the block's other arguments.** Every argument the block's
    forward gets after its input is one of three things, decided by the name of
    the block's own forward parameter it binds to (or the keyword it is
    given by) and by its type:

    - a mask, when its parameter is named ``attn_mask``, ``attention_mask``,
      ``attention_masks`` (torchtitan's), ``mask`` or ``block_mask`` (a
      boolean or additive ``scaled_dot_product_attention`` mask, a
      FlexAttention ``BlockMask``, or torchtitan's ``VarlenMetadata``),
      ``document_ids`` or ``doc_ids`` (document ids per position) or
      ``cu_seqlens`` (cumulative document lengths over the flattened batch),
      or when its value is a ``BlockMask`` or a ``VarlenMetadata`` whatever its
      name. Masks cover the whole sequence, are the same on every rank, apply
      together with ``causal``, and go to the attention only
      (``commfuse.fused.attention.resolve_mask`` says what each may be).
      The ranks' masks are compared as ``ParallelAttention`` compares them
      (``cu_seqlens`` and CPU ``document_ids`` on every call, a dense mask
      under ``COMMFUSE_CHECK=always``): where they differ every rank raises
      ``MismatchError`` naming the block, the ranks and the values;
    - a KV cache, when its parameter is named ``kv_cache``,
      ``past_key_values``, ``past_key_value``, ``layer_past`` or ``past``:
      None passes, anything else is refused by name (the style would neither
      read it nor write to it), and it never goes to the rope hook;
    - anything else goes to ``rope``, positionally or by keyword as it came,
      when the hook's signature takes it; an argument that is neither (no
      ``rope``, or one that does not take it) is refused by name with a
      ``CommfuseTypeError``: nothing the block is given is ignored.

    A refusal of an argument happens before anything is computed or sent,
    and the peers, waiting in the forward's first call, are told by name.
    """

    _extended = True

    def __init__(self, *, head_dim: int | None = None, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True, algorithm: str = "auto",
                 causal: bool | None = None, rope=None, rope_takes_module: bool = False, wq: str | None = None,
                 wk: str | None = None, wv: str | None = None, qkv: str | None = None, wo: str | None = None,
                 qkv_layout: str = "grouped", q_norm: str | None = None, k_norm: str | None = None,
                 scale: float | None = None, softcap: float | None = None, window: int | None = None) -> None:
        super().__init__(input_layouts=input_layouts or Shard(1), output_layouts=output_layouts or Shard(1),
                         use_local_output=use_local_output, algorithm=algorithm)
        self._attention_options(head_dim=head_dim, causal=causal, rope=rope, rope_takes_module=rope_takes_module,
                                wq=wq, wk=wk, wv=wv, qkv=qkv, wo=wo, q_norm=q_norm, k_norm=k_norm, scale=scale,
                                softcap=softcap, window=window, qkv_layout=qkv_layout)

    def __repr__(self) -> str:
        return (f"commfuse.tp.AttentionParallel(head_dim={self.head_dim}, input_layouts={self.input_layouts[0]}, "
                f"output_layouts={self.output_layouts[0]}, use_local_output={self.use_local_output}, "
                f"algorithm={self.algorithm!r})")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def decide() -> _Attention:
            parts = self._read(module, device_mesh, device_mesh.size())
            if parts.hf:
                self._verify(module, parts)
            parts.options = _attention_config(self, parts)
            return parts

        parts = self._agreed(module, device_mesh, decide)
        parts.rows = None
        for linear in parts.projections:
            if parts.layout == "stacked":
                _replicated_stacked(self, linear, device_mesh)
                q, kv = parts.wo.in_features, parts.wo.in_features // parts.heads_per_kv
                parts.rows = _stacked_rows([q, kv, kv], device_mesh.get_local_rank(), device_mesh.size())
            else:
                _colwise(self, linear, device_mesh)
        _rowwise(self, parts.wo, device_mesh)
        for norm in (parts.q_norm, parts.k_norm):  # replicated, as SequenceParallel places a norm's
            for child in () if norm is None else norm.modules():
                for name, _ in list(child.named_parameters(recurse=False)):
                    self._distribute(child, name, device_mesh, Replicate())

        def read(args, kwargs):
            return self._read_call(module, device_mesh, parts, args, kwargs)

        def forward(block, mesh, call):
            return self._forward(block, mesh, parts, call)

        return self._install(module, device_mesh, forward, read)

    def _verify(self, module: nn.Module, parts: _Attention) -> None:
        """A transformers module's own forward against the style's computation on a small random input, the
        same whole weights, made-up rotary embeddings and no mask (where the weights are real)."""
        config_ = getattr(module, "config", None)
        rope = getattr(config_, "rope_parameters", None) or {}
        factor = getattr(config_, "partial_rotary_factor", None) or rope.get("partial_rotary_factor", 1.0)
        width = int(parts.head_dim * factor)  # the rotary embeddings' width, as the model's rotary module makes it
        seq = 4 if parts.window is None else max(1, min(4, parts.window))
        x = _probe_input(module, parts.projections[0].in_features, seq)
        if x is None:
            return
        angles = torch.rand(1, seq, width, generator=torch.Generator().manual_seed(99), dtype=torch.float64) * 6
        rotary = (angles.cos().to(x.dtype).to(x.device), angles.sin().to(x.dtype).to(x.device))
        try:
            want = _run_own(module, x, position_embeddings=rotary, attention_mask=None)
        except Exception as e:  # noqa: BLE001 - named: the style cannot say it computes what the block does
            raise CommfuseValueError(
                f"{self._who}: {parts.where}'s own forward did not run on a small input with position_embeddings "
                f"and no mask ({type(e).__name__}: {e}), so the style cannot check that it computes the same; "
                f"{parts.instead}") from e
        want = want[0] if isinstance(want, tuple) else want
        try:
            with torch.no_grad():
                got = parts.reference(x, rotary)
        except Exception as e:  # noqa: BLE001 - the block's rotary embeddings are not applied as the style does
            raise CommfuseValueError(
                f"{self._who}: {parts.where}'s rotary embeddings of width {width} do not apply to its heads of "
                f"{parts.head_dim} as the style applies them (its family's apply_rotary_pos_emb on whole heads: "
                f"{type(e).__name__}: {e}); the block applies them its own way; {parts.instead}") from e
        off = differs(got, want) if isinstance(want, torch.Tensor) and got.shape == want.shape else float("inf")
        if not off <= _tolerance(x):
            raise CommfuseValueError(
                f"{self._who}: {parts.where}'s own forward differs from what the style computes (projections, "
                f"{'per-head norms, ' if parts.q_norm is not None or parts.k_norm is not None else ''}rotary "
                f"embeddings, attention with scale {parts.scale}, soft-cap {parts.softcap}, output projection) by "
                f"{off:.3g} relative on a random input: the block computes something the style does not; "
                f"{parts.instead}")

    def _read_call(self, block: nn.Module, mesh: DeviceMesh, parts: _Attention, args: tuple, kwargs: dict) -> _Call:
        """One call's arguments read and checked, before anything is computed or sent."""
        who = self._who
        x, args, kwargs = _input_of(who, parts.where, parts.input_name, args, kwargs)
        if not parts.hf:
            masks, args, kwargs = self._arguments(parts.arg_names, args, kwargs) if args or kwargs else ({}, args,
                                                                                                         kwargs)
            return _Call(x, masks, args, kwargs)
        given = dict(zip(parts.arg_names, args))
        twice = sorted(set(given) & set(kwargs))
        if len(args) > len(parts.arg_names) or twice:
            raise CommfuseTypeError(f"{who}: {parts.where}'s forward got {len(args) + 1} positional arguments"
                                    f"{f' and {twice} again by keyword' if twice else ''}; it takes "
                                    f"{', '.join((parts.input_name, *parts.arg_names))}")
        given.update(kwargs)
        rotary = given.pop("position_embeddings", None)
        mask = given.pop("attention_mask", None)
        self._refuse_cache([(name, given.pop(name)) for name in list(given) if name in _CACHE_NAMES])
        for name in _TRANSFORMERS_UNREAD:
            given.pop(name, None)
        if given.pop("output_attentions", None):
            raise CommfuseValueError(f"{who}: {parts.where} was asked for its attention weights "
                                     "(output_attentions=True); the style does not form them")
        rest = [f"{name}= ({_described(value)})" for name, value in given.items() if value is not None]
        if rest:
            raise CommfuseTypeError(f"{who}: {parts.where}'s forward got {', '.join(rest)}, which the style does not "
                                    "compute with; commfuse does not ignore an argument")
        if parts.dropout and block.training:
            raise CommfuseValueError(f"{who}: {parts.where} is in training mode with attention_dropout "
                                     f"{parts.dropout}; the style does not drop attention weights: build the model "
                                     "with attention_dropout=0.0, or call .eval()")
        if not (isinstance(rotary, (tuple, list)) and len(rotary) == 2
                and all(isinstance(t, torch.Tensor) for t in rotary)):
            raise CommfuseTypeError(f"{who}: {parts.where} needs position_embeddings=(cos, sin), the rotary "
                                    f"embeddings of the whole sequence, got {_described(rotary)}")
        whole = _whole_sequence(x, self.input_layouts[0], mesh)
        cos = rotary[0]
        if whole is not None and (cos.ndim < 2 or cos.shape[-2] != whole or rotary[1].shape != cos.shape):
            raise CommfuseValueError(
                f"{who}: {parts.where} got position_embeddings of shapes {list(cos.shape)} and "
                f"{list(rotary[1].shape)}; they must cover the whole sequence of {whole} positions ((batch or 1, "
                f"{whole}, rotary dim), as the model's rotary module makes them from the whole position_ids)")
        if mask is None and parts.window is not None and whole is not None and whole > parts.window:
            raise CommfuseValueError(
                f"{who}: {parts.where} is a sliding-window layer (sliding_window={parts.window}) called without an "
                f"attention_mask over {whole} positions; transformers applies the window through the mask it builds "
                "for the layer: call it with the model's mask")
        return _Call(x, {"attention_mask": mask}, rotary=tuple(rotary))

    def _forward(self, block: nn.Module, mesh: DeviceMesh, parts: _Attention, call: _Call):
        """The block's forward on one read call (:meth:`_read_call`)."""
        who = self._who
        x, given, args, kwargs = call.x, call.masks, call.args, call.kwargs
        kind = fused_attention.mask_kind(given) if given else "none"
        options = (who, parts.options + (("mask", kind),))
        ys = self._columns(mesh, x, parts.projections, who, options, parts.rows)
        if ys[0].ndim != 3:
            raise CommfuseValueError(f"{who}: takes (batch, sequence, features) inputs, got {ys[0].ndim}-D")
        b, s = ys[0].shape[0], ys[0].shape[1]
        n = mesh.size()
        q, k, v = parts.heads(ys, b, s)
        q, k = parts.normed(q, k, mesh.get_group() if n > 1 else None)
        if parts.hf:
            q, k = parts.rotated(q, k, call.rotary)
        elif self.rope_takes_module:
            q, k = self.rope(q, k, *args, module=block, **kwargs)
        elif self.rope is not None:
            q, k = self.rope(q, k, *args, **kwargs)
        mask = fused_attention.resolve_mask(who, given, batch=b, seq=s, heads=q.shape[2], world_size=n,
                                            rank=mesh.get_local_rank()) if kind != "none" else None
        causal = parts.causal_for(mask is not None)
        window = None if parts.hf or not causal else parts.window
        scores = dict(scale=parts.scale, softcap=parts.softcap, window=window)
        wo = parts.wo
        want = _normalized(self.output_layouts[0], 3)
        traced = torch.compiler.is_compiling() or as_custom_op()
        # the mask the ranks compare on this call (fused_attention.shared_mask), as ParallelAttention compares
        # its own: its digest rides the attention's reduce-scatter on gloo, else one exchange before the attention
        shared = None if mask is None or n == 1 or traced else fused_attention.shared_mask(given, check_mode(None))
        compared = None
        if shared is not None:
            digest, described = fused_attention.mask_shared(*shared)
            compared = (f"{who}'s mask", digest, described)
        if want == Shard(1) and n > 1 and s % n == 0 and traced:
            # one op in the graph (and, under selective activation checkpointing, to its policy): attention and
            # out-projection, reduce-scattered
            from commfuse import library

            z = library.attention_reduce_scatter(q, k, v, wo.weight.to_local(), causal=causal,
                                                 group=mesh.get_group(), algorithm=self.algorithm, mask=mask,
                                                 **scores)
            out = self._scattered(mesh, z, want, wo.bias)
        elif want == Shard(1) and n > 1 and s % n == 0:
            # auto decided on the partials' size (known before any attention runs), so that each query slice's
            # attention runs once: the ring's own producer calls are the only ones
            w = wo.weight.to_local()
            call = fused_attention.reduce_scatter_call(self.algorithm, batch=b, rows=s // n, hidden=w.shape[0],
                                                       dtype=ops.autocast_dtype(q) or q.dtype,
                                                       group=mesh.get_group(), device=q.device)
            def run():
                return fused_attention.attention_reduce_scatter(call, q, k, v, w, causal=causal, mask=mask,
                                                                config=options, **scores)

            z = run() if compared is None else agree_around(call, mesh.get_group(), *compared, run,
                                                             label="AttentionParallel.mask", device=q.device)
            out = self._scattered(mesh, z, want, wo.bias)
        else:
            if compared is not None:
                agree_shared(mesh.get_group(), *compared, label="AttentionParallel.mask", device=q.device)
            o = fused_attention.attend(q, k, v, causal=causal, mask=None if mask is None else mask.rows(0, s, s),
                                       **scores)
            out = self._row(mesh, o.reshape(b, s, -1), wo, who, options)
        return (out, None) if parts.hf else out


def _whole_sequence(x, layout: Placement, mesh: DeviceMesh) -> int | None:
    """The length of the whole sequence a block's input (dim 1) is part of: a DTensor's, a local shard's times
    the mesh size under ``Shard(1)``, a replicated input's own; None where it cannot be told."""
    if isinstance(x, DTensor):
        return x.shape[1] if x.ndim >= 2 else None
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        return None
    layout = _normalized(layout, x.ndim)
    if isinstance(layout, Shard):
        return x.shape[1] * mesh.size() if layout.dim == 1 else x.shape[1]
    return x.shape[1]


def _tell_peers(group, label: str, key, error: BaseException) -> None:
    """A refusal before this rank's forward made a call, told to the peers that wait in the forward's calls:
    this rank leaves them on the group's board (``leave_calls``, the first one served), as many as the forward
    made the last time it ran with ``key`` (``counted_calls`` learned it), or one before it ever ran."""
    state = state_of_group(group)
    if state.rank is None:  # no commfuse call has run on the group yet: its rank and size, as a backend gives them
        state.rank, state.world_size = dist.get_rank(group), dist.get_world_size(group)
    learned = counted_calls._LEARNED.get(key)
    leave_calls(state, label, error, 1 if learned is None else learned)


class RingAttentionParallel(_AttentionStyle):
    """Self-attention under context parallelism: the sequence cut over the mesh, the weights replicated, K/V
    passed around the ring (``commfuse.ring_attention``). The CP counterpart of :class:`AttentionParallel`.

    Apply it to the attention block with the CP axis, ``parallelize_module(block, mesh["cp"], style)``;
    its projections are named as for :class:`AttentionParallel` (``wq``, ``wk``, ``wv`` or one fused ``qkv``,
    ``wo``, by their paths in the block) and stay where they are, plain parameters: every rank holds the
    whole weights. The block's input is this rank's shard of the sequence (b, L, hidden), cut as ``layout``
    says (``commfuse.context.shard_sequence``: ``"contiguous"``, or ``"zigzag"``, equal causal work on every
    rank), a local tensor or a DTensor placed ``Shard(1)`` on the mesh; its output is this rank's shard of
    the block's output, local (``use_local_output=True``, the default) or a ``Shard(1)`` DTensor. The
    forward:

    - the block's own projections give q, k, v of this rank's tokens (all heads; grouped-query included);
    - ``rope(q, k, *args, positions=pos, **kwargs) -> (q, k)``, when given, with ``pos`` the global
      positions of this rank's tokens (``commfuse.context.positions``, int64 (L,), in shard order) and the
      block's own extra forward arguments (a Llama block's ``freqs_cis`` or rotary cache, which covers the
      whole sequence: the hook indexes it by ``pos``); ``rope_takes_module=True`` adds ``module=block``
      (torchtitan's ``attention.rope(xq, xk, positions)``). The hook must take the keyword ``positions``: a
      hook that rotated by the shard's row numbers would be silently wrong on every rank but the first;
    - ``commfuse.ring_attention`` in place of the block's attention core (``causal``, ``layout``,
      ``algorithm``), and ``document_lengths=`` given to the block's call (lengths over the whole sequence,
      as ``ring_attention`` takes them: one list, or one per batch row) for documents;
    - ``wo`` on this rank's attention output.

    **The weights' gradients.** Each rank's projections see other tokens, so the gradient of the whole is
    the sum over the CP ranks. With ``sum_grads=True`` (the default) the style sums them in the backward
    (an all-reduce per projection over the CP group), as ``commfuse.nn.RingAttention`` does: each rank's
    loss is its shard's part and every rank ends with the gradient of their sum. Exactly one reduction over
    the CP axis must happen: where a data-parallel wrapper already reduces over the CP ranks (torchtitan's
    FSDP over ``dp_shard_cp``, a DDP group that holds the CP ranks) give ``sum_grads=False``, and the
    wrapper's average over the CP ranks is the gradient of the mean of the ranks' losses (torchtitan's
    convention). Both on at once: an averaging wrapper averages the CP sums, which are equal on every CP
    rank, so the gradients are those of the style alone and the wrapper's reduction over CP is a wasted
    all-reduce; a summing wrapper counts them CP-size times.

    Refused by name: a mask argument other than ``document_lengths`` (dense masks, ``BlockMask``,
    ``VarlenMetadata``, ``document_ids``, ``cu_seqlens``: ring attention takes causal and document masks
    only), the block's own ``positions`` argument (the style gives the hook this rank's), a DTensor input not
    placed ``Shard(1)`` or whose sequence does not divide over the mesh, a zigzag shard that does not cut into
    two equal chunks, a weight that is a DTensor already (apply the style before ``fully_shard``).
    """

    _collectives = (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)
    _hook_keywords = ("positions",)

    def __init__(self, *, head_dim: int, causal: bool = True, layout: str = "contiguous", algorithm: str = "auto",
                 rope=None, rope_takes_module: bool = False, sum_grads: bool = True, use_local_output: bool = True,
                 wq: str | None = None, wk: str | None = None, wv: str | None = None, qkv: str | None = None,
                 wo: str = "wo") -> None:
        super().__init__(input_layouts=Shard(1), output_layouts=Shard(1), use_local_output=use_local_output,
                         algorithm=algorithm)
        self._attention_options(head_dim=head_dim, causal=causal, rope=rope, rope_takes_module=rope_takes_module,
                                wq=wq, wk=wk, wv=wv, qkv=qkv, wo=wo)
        self.layout = check_layout(layout)
        self.sum_grads = bool(sum_grads)

    def __repr__(self) -> str:
        return (f"commfuse.tp.RingAttentionParallel(head_dim={self.head_dim}, causal={self.causal}, "
                f"layout={self.layout!r}, algorithm={self.algorithm!r}, sum_grads={self.sum_grads})")

    def _arguments_given(self) -> list[tuple[str, object]]:
        return [*super()._arguments_given(), ("layout", self.layout), ("sum_grads", self.sum_grads)]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        parts = self._agreed(module, device_mesh, lambda: self._read(module, device_mesh, 1))  # no head split
        projections, wo, heads_per_kv = parts.projections, parts.wo, parts.heads_per_kv
        names = parts.arg_names  # the block's own parameters, read before it is replaced

        def forward(block, mesh, x, *args, **kwargs):
            return self._forward(block, mesh, names, projections, wo, heads_per_kv, x, *args, **kwargs)

        return self._install(module, device_mesh, forward)

    def _instead(self, inputs: list[str], output: str, stacked: bool = False) -> str:
        return ("keep the block's own forward under context parallelism (torch's context_parallel), or leave the "
                "block unsharded")

    def _without_positions(self, names: tuple, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The block's arguments less its own ``positions`` (None is dropped; anything else is refused)."""
        given = kwargs.pop("positions", None)
        if "positions" in names[: len(args)]:
            i = names.index("positions")
            given, args = args[i] if given is None else given, args[:i] + args[i + 1 :]
        if given is not None:
            raise CommfuseValueError(
                f"{self._who}: the block's forward got positions= ({_described(given)}); under context "
                "parallelism the style gives the rope hook this rank's global positions (commfuse.context."
                "positions, by layout) itself, and per-token positions from the caller are not supported")
        return args, kwargs

    def _forward(self, block: nn.Module, mesh: DeviceMesh, names: tuple, projections: list, wo: nn.Linear,
                 heads_per_kv: int | None, x, *args, **kwargs) -> torch.Tensor:
        who = self._who
        document_lengths = kwargs.pop("document_lengths", None)
        args, kwargs = self._without_positions(names, args, kwargs)
        given, args, kwargs = self._arguments(names, args, kwargs) if args or kwargs else ({}, args, kwargs)
        masks = [f"{name} ({_described(value)})" for name, value in given.items() if value is not None]
        if masks:
            raise CommfuseValueError(
                f"{who}: the block's forward got the mask {', '.join(masks)}; ring attention takes a causal mask "
                "(causal=) and documents (document_lengths=, the lengths over the whole sequence) only")
        n, rank = mesh.size(), mesh.get_local_rank()
        if isinstance(x, DTensor):
            if x.device_mesh != mesh:
                raise CommfuseValueError(f"{who}: the input is a DTensor on {x.device_mesh}, but the module was "
                                         f"parallelized over {mesh}")
            placed = _normalized(x.placements[0], x.ndim)
            if placed != Shard(1) or x.shape[1] % n:
                raise CommfuseValueError(
                    f"{who}: rank {rank}: the input is a DTensor of shape {list(x.shape)} placed {placed!r}; under "
                    f"context parallelism it must be the sequence sharded evenly, Shard(1) with the sequence "
                    f"dividing by the mesh's {n} ranks")
            local = x.to_local()
        elif isinstance(x, torch.Tensor):
            local = x
        else:
            raise CommfuseTypeError(f"{who}: the input must be a tensor or a DTensor, got {type(x).__name__}")
        if local.ndim != 3:
            raise CommfuseValueError(f"{who}: takes (batch, sequence shard, features) inputs, got shape "
                                     f"{list(local.shape)}")
        group = mesh.get_group() if n > 1 else None
        groups = (group,) if self.sum_grads and group is not None else ()
        b, length, d = local.shape[0], local.shape[1], self.head_dim
        ys = [replicated_linear(lin, local, *groups) for lin in projections]
        if heads_per_kv is None:
            q, k, v = (y.view(b, length, -1, d) for y in ys)
        else:
            q, k, v = _split_qkv(ys[0], heads_per_kv, d)
        if self.rope is not None:
            pos = positions(length * n, rank, n, self.layout, device=local.device)
            if self.rope_takes_module:
                q, k = self.rope(q, k, *args, positions=pos, module=block, **kwargs)
            else:
                q, k = self.rope(q, k, *args, positions=pos, **kwargs)
        o = ops.ring_attention(q, k, v, group=group, causal=bool(self.causal), layout=self.layout,
                               algorithm=self.algorithm, document_lengths=document_lengths)
        y = replicated_linear(wo, o.reshape(b, length, -1), *groups)
        return self._output(y, Shard(1), mesh, [b, length * n, y.shape[-1]])

def _split_qkv(qkv: torch.Tensor, heads_per_kv: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (batch, sequence, heads, head_dim) of a fused QKV projection's output, whose features are
    (key/value groups, heads_per_kv + 2, head_dim): each group's query heads, then its key head, then its value
    head. torchtitan's ``FusedQKVLinear.forward`` split, on this rank's whole groups.

    ========  ====================================================
    qkv       (b, s, groups * (heads_per_kv + 2) * head_dim)
    q         (b, s, groups * heads_per_kv, head_dim), contiguous
    k, v      (b, s, groups, head_dim), contiguous
    ========  ====================================================
    """
    b, s = qkv.shape[0], qkv.shape[1]
    q, k, v = torch.split(qkv.view(b, s, -1, heads_per_kv + 2, head_dim), [heads_per_kv, 1, 1], dim=-2)
    return tuple(t.reshape(b, s, -1, head_dim).contiguous() for t in (q, k, v))


def _shape_of(module: nn.Module) -> str:
    """``(in -> out)`` of a linear, or the names of a block's children: how a site is told apart before
    ``commfuse.explain`` names it by its path."""
    if isinstance(module, nn.Linear):
        return f"({module.in_features} -> {module.out_features})"
    names = [name for name, _ in module.named_children()][:4]
    return f"({', '.join(names)})" if names else ""


def _positional_names(forward) -> tuple:
    """The names of a module forward's positional parameters after its input (the block's own arguments a
    style reads its masks from); () when they cannot be read or take ``*args`` only."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return ()
    named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(named[1:])


def _takes(hook, skip: int, given: tuple = ()) -> tuple[int | None, frozenset | None]:
    """What ``hook`` takes after its first ``skip`` positional arguments, besides the keywords ``given`` that
    its caller passes itself: (how many more positional ones, None: any; the keyword names, None: any). A hook
    whose signature cannot be read takes anything."""
    try:
        params = [p for p in inspect.signature(hook).parameters.values() if p.name not in given]
    except (TypeError, ValueError):
        return None, None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    more = None if any(p.kind == p.VAR_POSITIONAL for p in params) else max(len(positional) - skip, 0)
    keywords = None if any(p.kind == p.VAR_KEYWORD for p in params) else frozenset(
        p.name for p in params[skip:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return more, keywords


def _takes_keyword(hook, name: str) -> bool:
    """Whether ``hook`` can be called with the keyword ``name`` (a hook whose signature cannot be read can)."""
    try:
        params = inspect.signature(hook).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind == p.VAR_KEYWORD or (p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
               for p in params)


def _named(fn) -> str | None:
    """A callable by its module and qualified name (None for None), as the ranks compare a rope hook."""
    if fn is None:
        return None
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _described(value) -> str:
    """An argument in a few words: its type, and a tensor's dtype and shape."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"
