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
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

import commfuse.ops as ops
from commfuse.context import check_layout, positions
from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.fused import attention as fused_attention
from commfuse.nn._common import as_dtensor, config, replicated, replicated_linear
from commfuse.runtime import sites
from commfuse.runtime.checkpointing import as_custom_op
from commfuse.runtime.loop import counted_calls
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

    def _install(self, module: nn.Module, mesh: DeviceMesh, forward) -> nn.Module:
        """``module`` with ``forward(module, mesh, *args)`` in place of its own forward."""
        label = f"{type(self).__name__} forward"
        # what this module runs and takes, for COMMFUSE_LOG and commfuse.explain (commfuse.runtime.sites)
        site = sites.Site(f"commfuse.tp.{type(self).__name__}", self, mesh, mesh.size(),
                          f"{type(self).__name__} on {type(module).__name__}{_shape_of(module)}")

        serial = next(_FORWARDS)

        def fused_forward(*args, **kwargs):
            if torch.compiler.is_compiling():
                return forward(module, mesh, *args, **kwargs)
            # a hook of the user's that raises between the style's calls (the rope hook) leaves the calls
            # this rank will not make on the group's board, for the peers that wait in them
            key = ("commfuse.tp", serial, tuple(getattr(a, "shape", None) for a in args[:1]), torch.is_grad_enabled())
            with counted_calls(mesh.get_group() if mesh.size() > 1 else None, label, key), sites.at_site(site):
                return forward(module, mesh, *args, **kwargs)

        module.forward = fused_forward
        module.__dict__["_commfuse_site"] = site
        return module

    def _columns(self, mesh: DeviceMesh, x, linears, who: str, options: tuple) -> list[torch.Tensor]:
        """``x`` (the module input, placed ``input_layouts`` when local) through column-parallel ``linears``:
        each one's local output, sharded on its features. A sequence-sharded input is gathered once, fused
        with every GEMM (``all_gather_matmul`` with one weight per linear); any other layout is gathered
        through DTensor first. ``options``: the style's options for the fused op's fingerprint
        (:func:`~commfuse.nn._common.config`)."""
        local, have = _local_input(x, self.input_layouts[0], mesh, who)
        # weights read per call: fully_shard swaps in the unsharded parameters before each forward
        ws = [lin.weight.to_local().t() for lin in linears]
        n = mesh.size()
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
        self._check(module, device_mesh)
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
        self._check(module, device_mesh)
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


class SwiGLUParallel(_Style):
    """A SwiGLU feed-forward block, ``w2(silu(w1(x)) * w3(x))``, its two up projections fed by one gather.

    Apply it to the block (e.g. a Llama ``feed_forward``), not its linears:
    ``w1`` and ``w3`` become column-parallel and ``w2`` row-parallel, with
    torch's placements. With a sequence-sharded input (``input_layouts``,
    default ``Shard(1)``) the forward is one ``all_gather_matmul`` serving both
    up projections, the gate, and one ``matmul_reduce_scatter`` into
    ``output_layouts`` (default ``Shard(1)``). ``w1``, ``w2``, ``w3`` name the
    block's ``nn.Linear`` projections by their path in it, dotted where they
    sit deeper (``"mlp.w1"``); they are found when the style is applied.
    ``use_local_output`` (default True) as torch's ``RowwiseParallel`` on
    ``w2``, whose output the block's is: :mod:`commfuse.tp` says when to set
    it False (a DTensor residual stream).
    """

    _roles = {"w1": "gate projection", "w2": "down projection", "w3": "up projection"}

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, algorithm: str = "auto", w1: str = "w1", w2: str = "w2",
                 w3: str = "w3") -> None:
        super().__init__(input_layouts=input_layouts or Shard(1), output_layouts=output_layouts or Shard(1),
                         use_local_output=use_local_output, algorithm=algorithm)
        self.names = {"w1": w1, "w2": w2, "w3": w3}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        lin = _linears(self, module, self.names, device_mesh)
        _colwise(self, lin["w1"], device_mesh)
        _colwise(self, lin["w3"], device_mesh)
        _rowwise(self, lin["w2"], device_mesh)
        w1, w2, w3 = lin["w1"], lin["w2"], lin["w3"]

        def forward(module, mesh, x):
            return self._forward(mesh, w1, w2, w3, x)

        return self._install(module, device_mesh, forward)

    def _forward(self, mesh: DeviceMesh, w1: nn.Linear, w2: nn.Linear, w3: nn.Linear, x) -> torch.Tensor:
        who = "commfuse.tp.SwiGLUParallel"
        options = config(who, gate_bias=w1.bias is not None, up_bias=w3.bias is not None,
                         down_bias=w2.bias is not None)
        gate, up = self._columns(mesh, x, [w1, w3], who, options)
        return self._row(mesh, nn.functional.silu(gate) * up, w2, who, options)


class _AttentionStyle(_Style):
    """What the attention block styles share: the projections named by their paths (three, or one fused
    ``qkv``), ``head_dim``, the rope hook and the block's other forward arguments (masks by name, the rest to
    the hook). :class:`AttentionParallel` (heads over the mesh) and :class:`RingAttentionParallel` (the
    sequence over the mesh) differ in what they do with them."""

    _native = False  # their rings are the consume and produce forms, not fused GEMMs
    _roles = {"wq": "query projection", "wk": "key projection", "wv": "value projection",
              "qkv": "fused QKV projection", "wo": "output projection"}
    #: the keywords the style itself gives the rope hook (besides ``module=`` with ``rope_takes_module``)
    _hook_keywords: tuple = ()

    @property
    def _who(self) -> str:
        return f"commfuse.tp.{type(self).__name__}"

    def _attention_options(self, *, head_dim: int, causal: bool, rope, rope_takes_module: bool, wq, wk, wv, qkv,
                           wo) -> None:
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
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
        separate = {"wq": wq, "wk": wk, "wv": wv}
        if qkv is not None:
            given = [f"{name}={value!r}" for name, value in separate.items() if value is not None]
            if given:
                raise CommfuseValueError(f"{self._who}: qkv={qkv!r} names one fused QKV "
                                         f"projection in place of wq, wk and wv, but {', '.join(given)} is given "
                                         "too: give one or the other")
            self.names = {"qkv": qkv, "wo": wo}
        else:
            self.names = {**{name: value or name for name, value in separate.items()}, "wo": wo}

    def _projections(self, module: nn.Module, device_mesh: DeviceMesh, n: int) -> tuple[list, nn.Linear, int | None]:
        """The block's Q/K/V projections (three, or the one fused), its ``wo``, and the query heads per
        key/value group of a fused one (None for three); the heads checked to split evenly over ``n`` ranks
        (1: no head split)."""
        lin = _linears(self, module, self.names, device_mesh)
        d = self.head_dim
        wo = lin["wo"]
        if "qkv" in lin:
            return [lin["qkv"]], wo, self._kv_groups(lin["qkv"], wo, n)
        projections = [lin["wq"], lin["wk"], lin["wv"]]
        for argument, linear in zip(("wq", "wk", "wv"), projections):
            out = linear.out_features
            if out % d or (out // d) % n:
                raise CommfuseValueError(
                    f"{self._who}: the {self._roles[argument]} {self.names[argument]!r} has "
                    f"{out} features, which is not whole heads of {d} split evenly over {n} ranks: every rank "
                    f"must hold whole heads"
                )
        return projections, wo, None

    def _kv_groups(self, qkv: nn.Linear, wo: nn.Linear, n: int) -> int:
        """The query heads per key/value head of a fused QKV projection (torchtitan's ``FusedQKVLinear``
        layout), read from its rows and ``wo``'s input features, checked: each of the ``n`` ranks must hold
        whole key/value groups."""
        d, path = self.head_dim, self.names["qkv"]
        heads, rows = wo.in_features // d, qkv.out_features // d
        kv_heads = (rows - heads) // 2
        if wo.in_features % d or qkv.out_features % d or kv_heads <= 0 or rows != heads + 2 * kv_heads \
                or heads % kv_heads:
            raise CommfuseValueError(
                f"{self._who}: the fused QKV projection {path!r} has {qkv.out_features} "
                f"features, which is not (n_heads + 2 * n_kv_heads) heads of {d} laid out as torchtitan's "
                f"FusedQKVLinear, with n_heads = {wo.in_features / d:g} read from the output projection "
                f"{self.names['wo']!r} ({wo.in_features} input features) and n_heads dividing by n_kv_heads"
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
        as the class docstring says; what is neither is refused by name."""
        masks, rest, more = {}, [], {}
        for i, value in enumerate(args):
            name = names[i] if i < len(names) else None
            if fused_attention.is_mask(name, value):
                masks[name or f"argument {i + 1} (a {type(value).__name__})"] = value
            else:
                rest.append((name, i, value))
        for name, value in kwargs.items():
            if fused_attention.is_mask(name, value):
                masks[name] = value
            else:
                more[name] = value
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
                f"VarlenMetadata) and {hook}; commfuse does not ignore an argument: name a mask's parameter so, or give a rope "
                "hook that takes the argument"
            )
        return masks, tuple(value for _, _, value in rest), more


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

    - one ``all_gather_matmul`` of the input serves the Q, K and V projections;
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

    ``causal`` (default True) masks each query to the keys up to its position.
    ``use_local_output`` (default True) as torch's ``RowwiseParallel`` on
    ``wo``, whose output the block's is: :mod:`commfuse.tp` says when to set
    it False (a DTensor residual stream).

    **One fused QKV projection.** ``qkv`` (in place of ``wq``, ``wk``, ``wv``)
    names one ``nn.Linear`` whose output rows are torchtitan's
    ``FusedQKVLinear`` layout, ``(n_kv_heads, R, head_dim)`` with
    ``R = n_heads // n_kv_heads + 2``: for each key/value head, its
    ``n_heads // n_kv_heads`` query heads, then its key head, then its value
    head. ``n_heads`` is read from ``wo`` (its input features over
    ``head_dim``) and ``n_kv_heads`` from the rest of the rows. The
    projection is column-parallel (``Shard(0)``, as torch's
    ``ColwiseParallel`` and torchtitan shard it), so each rank's rows are
    whole key/value groups: ``n_kv_heads`` must divide by the mesh size. The
    one gather feeds the one fused GEMM, whose output is split per group into
    q, k and v as ``FusedQKVLinear.forward`` splits it.

    **Masks and the block's other arguments.** Every argument the block's
    forward gets after its input is one of two things, decided by the name of
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
      (``commfuse.fused.attention.resolve_mask`` says what each may be);
    - anything else goes to ``rope``, positionally or by keyword as it came,
      when the hook's signature takes it; an argument that is neither (no
      ``rope``, or one that does not take it) is refused by name with a
      ``CommfuseTypeError``: nothing the block is given is ignored.
    """

    def __init__(self, *, head_dim: int, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True, algorithm: str = "auto",
                 causal: bool = True, rope=None, rope_takes_module: bool = False, wq: str | None = None,
                 wk: str | None = None, wv: str | None = None, qkv: str | None = None, wo: str = "wo") -> None:
        super().__init__(input_layouts=input_layouts or Shard(1), output_layouts=output_layouts or Shard(1),
                         use_local_output=use_local_output, algorithm=algorithm)
        self._attention_options(head_dim=head_dim, causal=causal, rope=rope, rope_takes_module=rope_takes_module,
                                wq=wq, wk=wk, wv=wv, qkv=qkv, wo=wo)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        projections, wo, heads_per_kv = self._projections(module, device_mesh, device_mesh.size())
        for linear in projections:
            _colwise(self, linear, device_mesh)
        _rowwise(self, wo, device_mesh)
        names = _positional_names(module.forward)  # the block's own parameters, read before it is replaced

        def forward(block, mesh, x, *args, **kwargs):
            return self._forward(block, mesh, names, projections, wo, heads_per_kv, x, *args, **kwargs)

        return self._install(module, device_mesh, forward)

    def _forward(self, block: nn.Module, mesh: DeviceMesh, names: tuple, projections: list, wo: nn.Linear,
                 heads_per_kv: int | None, x, *args, **kwargs) -> torch.Tensor:
        """The block's forward: ``projections`` are wq, wk, wv, or the one fused QKV projection whose rows hold
        ``heads_per_kv`` query heads per key/value group (None for the three)."""
        who = "commfuse.tp.AttentionParallel"
        given, args, kwargs = self._arguments(names, args, kwargs) if args or kwargs else ({}, args, kwargs)
        causal = bool(self.causal)
        if heads_per_kv is None:
            wq, wk, wv = projections
            layout = dict(q_bias=wq.bias is not None, k_bias=wk.bias is not None, v_bias=wv.bias is not None)
        else:
            layout = dict(qkv_bias=projections[0].bias is not None, heads_per_kv=heads_per_kv)
        options = config(who, causal=causal, head_dim=self.head_dim, rope=self.rope is not None,
                         rope_module=self.rope_takes_module, **layout, o_bias=wo.bias is not None,
                         mask=fused_attention.mask_kind(given))
        ys = self._columns(mesh, x, projections, who, options)
        if ys[0].ndim != 3:
            raise CommfuseValueError(f"{who}: takes (batch, sequence, features) inputs, got {ys[0].ndim}-D")
        b, s, d = ys[0].shape[0], ys[0].shape[1], self.head_dim
        if heads_per_kv is None:
            q, k, v = (y.view(b, s, -1, d) for y in ys)
        else:
            q, k, v = _split_qkv(ys[0], heads_per_kv, d)
        if self.rope_takes_module:
            q, k = self.rope(q, k, *args, module=block, **kwargs)
        elif self.rope is not None:
            q, k = self.rope(q, k, *args, **kwargs)
        n = mesh.size()
        mask = fused_attention.resolve_mask(who, given, batch=b, seq=s, heads=q.shape[2], world_size=n,
                            rank=mesh.get_local_rank()) if given else None
        want = _normalized(self.output_layouts[0], 3)
        if want == Shard(1) and n > 1 and s % n == 0 and (torch.compiler.is_compiling() or as_custom_op()):
            # one op in the graph (and, under selective activation checkpointing, to its policy): attention and
            # out-projection, reduce-scattered
            from commfuse import library

            z = library.attention_reduce_scatter(q, k, v, wo.weight.to_local(), causal=causal,
                                                 group=mesh.get_group(), algorithm=self.algorithm, mask=mask)
            return self._scattered(mesh, z, want, wo.bias)
        if want == Shard(1) and n > 1 and s % n == 0:
            # auto decided on the partials' size (known before any attention runs), so that each query slice's
            # attention runs once: the ring's own producer calls are the only ones
            w = wo.weight.to_local()
            call = fused_attention.reduce_scatter_call(self.algorithm, batch=b, rows=s // n, hidden=w.shape[0],
                                                       dtype=ops.autocast_dtype(q) or q.dtype,
                                                       group=mesh.get_group(), device=q.device)
            z = fused_attention.attention_reduce_scatter(call, q, k, v, w, causal=causal, mask=mask, config=options)
            return self._scattered(mesh, z, want, wo.bias)
        o = fused_attention.attend(q, k, v, causal=causal, mask=None if mask is None else mask.rows(0, s, s))
        return self._row(mesh, o.reshape(b, s, -1), wo, who, options)



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

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        projections, wo, heads_per_kv = self._projections(module, device_mesh, 1)  # no head split under CP
        names = _positional_names(module.forward)  # the block's own parameters, read before it is replaced

        def forward(block, mesh, x, *args, **kwargs):
            return self._forward(block, mesh, names, projections, wo, heads_per_kv, x, *args, **kwargs)

        return self._install(module, device_mesh, forward)

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


def _described(value) -> str:
    """An argument in a few words: its type, and a tensor's dtype and shape."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"
