"""commfuse where torchtitan trains: its tensor-parallel projections, fused on any backend.

torchtitan 0.3 keeps parameters and activations as plain local tensors (its default
``spmd_backend="spmd_types"``) and chooses how the tensor-parallel GEMMs run with
``tp_gemm_backend`` on the model config: ``"default"`` leaves the sequence-parallel all-gather and
reduce-scatter to its module boundaries, ``"dist_gemm"`` folds them into the GEMMs over CUDA
symmetric memory (``torchtitan/models/common/dist_gemm.py``). :func:`use_commfuse` is the same
choice, made with commfuse's fused ops instead, so it runs wherever commfuse has a backend (NCCL,
HCCL, XLA, gloo)::

    from torchtitan.models.llama3 import llama3_configs
    from commfuse.integrations.torchtitan import use_commfuse

    model_config = llama3_configs["8B"](attn_backend="flex")
    use_commfuse(model_config, algorithm="auto")   # in place, before torchtitan builds the model

In a torchtitan config function that is one line after ``model_spec`` is set:
``use_commfuse(config.model_spec.model)``. torchtitan's model code is not changed: the modules below
subclass its ``dist_gemm`` modules (so its sharding setup declares the contracts it declares for
those: no boundary all-gather before the attention and the feed-forward, the output projections'
reduce-scatter done inside the module) and keep the stock parameter layouts, FQNs and state-dict
keys (the fused ``wqkv`` still saves as ``wq``/``wk``/``wv``). Like ``dist_gemm`` they need
``spmd_backend="spmd_types"`` with sequence parallelism on; torchtitan's own check refuses anything
else by name when the model is sharded.

What is fused, per transformer block whose attention is torchtitan's ``GQAttention`` and whose
feed-forward is its SwiGLU ``FeedForward``:

- ``attention.qkv_linear``: the sequence all-gather with the Q/K/V GEMM
  (:func:`commfuse.all_gather_matmul`; one gather feeds the fused ``wqkv``, or ``wq``, ``wk`` and
  ``wv`` when the config keeps them apart);
- ``attention.wo`` and ``feed_forward.w2``: the GEMM with the reduce-scatter back to a sequence
  shard (:func:`commfuse.matmul_reduce_scatter`);
- ``feed_forward.w1`` and ``w3``: one gather feeding both GEMMs.

- ``attention`` itself, where its core allows it (:class:`Attention`): the attention runs per query
  slice, each slice times ``wo`` being the producer of ``wo``'s reduce-scatter ring, as
  :class:`commfuse.nn.ParallelAttention` does. Each slice's attention is commfuse's SDPA on the slice's rows
  with the slice's rows of the mask (torchtitan's causal SDPA; its FlexAttention ``BlockMask`` and varlen
  documents evaluated per slice), not torchtitan's flex or varlen kernel; ``use_commfuse(...,
  query_split=False)`` keeps torchtitan's core whole between the fused projections instead.

The TP group is the caller's (:func:`bind_group`) or else, per forward, the ``"tp"`` axis of
torchtitan's current mesh context, as its ``dist_gemm`` modules read it. With no TP group (TP off,
or degree 1) a module runs the stock projection and says so once, as ``dist_gemm`` does.

Tested with torchtitan :data:`TESTED` (CI's torchtitan stage, ``ci/test_torchtitan.sh``); another
release gets a warning, and one whose seam moved (a class or field these modules build on) a
:class:`~commfuse.errors.CommfuseTypeError` naming what is missing.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.nn.functional as F

import commfuse.ops as ops
from commfuse import log
from commfuse.errors import CommfuseTypeError, CommfuseValueError, CommfuseWarning
from commfuse.fused import attention as fused_attention
from commfuse.planning.derive import layer_config
from commfuse.runtime.admission import op_calls

#: torchtitan releases CI runs this integration with.
TESTED = ("0.3.0",)

try:
    from torchtitan.distributed.spmd_types import current_spmd_mesh
    from torchtitan.models.common import attention as _attention
    from torchtitan.models.common import dist_gemm as _dist_gemm
    from torchtitan.models.common import feed_forward as _feed_forward
    from torchtitan.models.common import linear as _linear
except ImportError as e:  # not installed, or a release whose seam moved
    raise ImportError(f"commfuse.integrations.torchtitan needs torchtitan's model code (tested with "
                      f"torchtitan {', '.join(TESTED)}): {e}") from e

__all__ = ["Attention", "FeedForward", "FusedQKVLinear", "QKVLinear", "RowParallelLinear", "TESTED", "bind_group",
           "use_commfuse"]


def _seam(module, name: str, where: str):
    """``module.name``, or an error naming what torchtitan no longer has."""
    try:
        return getattr(module, name)
    except AttributeError:
        raise CommfuseTypeError(f"commfuse.integrations.torchtitan: torchtitan {_installed()} has no "
                                f"{module.__name__}.{name} ({where}); this integration is tested with torchtitan "
                                f"{', '.join(TESTED)}") from None


def _installed() -> str:
    try:
        return version("torchtitan")
    except PackageNotFoundError:
        return "(version unknown)"


_StockFusedQKV = _seam(_attention, "FusedQKVLinear", "the fused Q/K/V projection")
_StockQKV = _seam(_attention, "QKVLinear", "the separate Q/K/V projections")
_GQAttention = _seam(_attention, "GQAttention", "the attention block")
_StockFFN = _seam(_feed_forward, "FeedForward", "the SwiGLU feed-forward")
_Linear = _seam(_linear, "Linear", "the configurable linear")
_DistQKV = _seam(_dist_gemm, "AllGatherFusedQKVLinear", "what its sharding setup treats as a fused Q/K/V")
_DistRow = _seam(_dist_gemm, "RowParallelLinear", "what its sharding setup treats as a fused row-parallel")
_DistFFN = _seam(_dist_gemm, "AllGatherFusedFeedForward", "what its sharding setup treats as a fused feed-forward")
_SDPA = _seam(_attention, "ScaledDotProductAttention", "the SDPA attention core")
_Flex = _seam(_attention, "FlexAttention", "the FlexAttention core")
_Varlen = _seam(_attention, "VarlenAttention", "the varlen attention core")


def _group(module):
    """The TP group ``module`` runs on: its bound group, else the ``tp`` axis of torchtitan's current mesh
    context; None (run the stock projection) when TP is off or of degree 1."""
    group = module._commfuse_group
    if group is None:
        mesh = current_spmd_mesh()
        if mesh is module._commfuse_mesh[0]:  # the same context as the last forward: its group, remembered
            group = module._commfuse_mesh[1]
        else:
            group = None if mesh is None or "tp" not in (mesh.mesh_dim_names or ()) else mesh.get_group("tp")
            module._commfuse_mesh = (mesh, group)
    if group is None or group.size() == 1:
        name = type(module).__name__
        log.once(("torchtitan unfused", name), "commfuse.integrations.torchtitan.%s: tensor parallelism is not "
                 "active (no TP group bound and no 'tp' axis of degree > 1 in torchtitan's mesh context); running the "
                 "stock projection, nothing fused", name, level=logging.WARNING)
        return None
    return group


def _bias(y: torch.Tensor, linear) -> torch.Tensor:
    """``y`` plus ``linear``'s bias, added in ``y``'s dtype as ``nn.Linear`` adds it (autocast's, under it)."""
    return y if linear.bias is None else y + linear.bias.to(y.dtype)


def _heads(t: torch.Tensor, b: int, s: int, head_dim: int) -> torch.Tensor:
    return t.reshape(b, s, -1, head_dim).contiguous()


class _Fused:
    """What the four modules share: the algorithm from their config (settable per module, as the bench does) and
    the TP group :func:`bind_group` gives them (None: torchtitan's mesh context)."""

    def __init__(self, config):
        super().__init__(config)
        self.algorithm = config.algorithm
        self._commfuse_group = None
        self._commfuse_mesh = (None, None)  # (the last mesh context seen, its TP group): get_group once per mesh


class FusedQKVLinear(_Fused, _DistQKV):
    """torchtitan's fused Q/K/V projection (one ``wqkv``, rows laid out ``(n_kv_heads, R, head_dim)``,
    ``R = n_heads // n_kv_heads + 2``) whose sequence all-gather runs inside the GEMM: one
    :func:`commfuse.all_gather_matmul` along the sequence dim. Takes the block's sequence shard
    ``(B, S/N, D)``, returns ``xq, xk, xv`` ``(B, S, local heads, head_dim)`` as the stock module does."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_DistQKV.Config):
        algorithm: str = "auto"

    def forward(self, x: torch.Tensor):  # noqa: D102
        group = _group(self)
        if group is None:
            return _StockFusedQKV.forward(self, x)
        b = x.shape[0]
        qkv = ops.all_gather_matmul(x, self.wqkv.weight.t(), group=group, gather_dim=1, algorithm=self.algorithm,
                                    config=layer_config("torchtitan.FusedQKVLinear", bias=self.wqkv.bias is not None,
                                                        r=self.r_dim, head_dim=self.head_dim))
        qkv = _bias(qkv, self.wqkv)
        s = qkv.shape[1]
        xq, xk, xv = torch.split(qkv.view(b, s, -1, self.r_dim, self.head_dim), [self.heads_per_kv, 1, 1], dim=-2)
        return _heads(xq, b, s, self.head_dim), _heads(xk, b, s, self.head_dim), _heads(xv, b, s, self.head_dim)


class QKVLinear(_Fused, _StockQKV):
    """torchtitan's separate Q/K/V projections (``wq``, ``wk``, ``wv``) fed by one sequence all-gather
    fused with all three GEMMs (:func:`commfuse.all_gather_matmul` with three weights)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_StockQKV.Config):
        algorithm: str = "auto"

    def forward(self, x: torch.Tensor):  # noqa: D102
        group = _group(self)
        if group is None:
            return _StockQKV.forward(self, x)
        b = x.shape[0]
        linears = (self.wq, self.wk, self.wv)
        ys = ops.all_gather_matmul(x, [lin.weight.t() for lin in linears], group=group, gather_dim=1,
                                   algorithm=self.algorithm,
                                   config=layer_config("torchtitan.QKVLinear", bias=self.wq.bias is not None,
                                                       head_dim=self.head_dim))
        xq, xk, xv = (_bias(y, lin) for y, lin in zip(ys, linears))
        s = xq.shape[1]
        return _heads(xq, b, s, self.head_dim), _heads(xk, b, s, self.head_dim), _heads(xv, b, s, self.head_dim)


class RowParallelLinear(_Fused, _DistRow):
    """A row-parallel projection (attention's ``wo``, the feed-forward's ``w2``) whose reduce-scatter back to
    the sequence shard runs inside the GEMM: :func:`commfuse.matmul_reduce_scatter` along the sequence dim.
    Takes ``(B, S, K/N)``, returns this rank's ``(B, S/N, out_features)``. A bias (replicated) is added to
    every rank's rows; its gradient is then a partial sum per rank, reduced by whatever reduces torchtitan's
    other replicated parameters (as for its stock rowwise bias)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_DistRow.Config):
        algorithm: str = "auto"

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: D102
        group = _group(self)
        if group is None:
            return _Linear.forward(self, input)
        z = ops.matmul_reduce_scatter(input, self.weight.t(), group=group, scatter_dim=1, algorithm=self.algorithm,
                                      config=layer_config("torchtitan.RowParallelLinear", bias=self.bias is not None))
        return _bias(z, self)


class FeedForward(_Fused, _DistFFN):
    """torchtitan's SwiGLU feed-forward (``w2(silu(w1(x)) * w3(x))``, stock ``w1``/``w2``/``w3``) with one
    sequence all-gather fused with the ``w1`` and ``w3`` GEMMs and ``w2``'s GEMM fused with the reduce-scatter
    back to the sequence shard. Takes and returns the block's sequence shard ``(B, S/N, D)``."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_DistFFN.Config):
        algorithm: str = "auto"

        def __post_init__(self) -> None:
            """Nothing to refuse: ``dist_gemm``'s check (no ``w1``/``w3`` bias: its multi-weight gather takes
            none) does not apply, commfuse adds the biases after its fused GEMMs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        group = _group(self)
        if group is None:
            return _StockFFN.forward(self, x)
        h1, h3 = ops.all_gather_matmul(x, [self.w1.weight.t(), self.w3.weight.t()], group=group, gather_dim=1,
                                       algorithm=self.algorithm,
                                       config=layer_config("torchtitan.FeedForward", bias1=self.w1.bias is not None,
                                                           bias3=self.w3.bias is not None))
        h = F.silu(_bias(h1, self.w1)) * _bias(h3, self.w3)
        z = ops.matmul_reduce_scatter(h, self.w2.weight.t(), group=group, scatter_dim=1, algorithm=self.algorithm,
                                      config=layer_config("torchtitan.FeedForward.w2", bias=self.w2.bias is not None))
        return _bias(z, self.w2)


class Attention(_Fused, _GQAttention):
    """torchtitan's ``GQAttention`` whose output projection is fed by the query-split attention: the fused Q/K/V
    projection (:class:`FusedQKVLinear` or :class:`QKVLinear`, one gather), its Q/K norms and RoPE as stock,
    then :func:`commfuse.fused.attention.attention_reduce_scatter` (the paper's Algorithm 4): query slice d's
    attention times this rank's columns of ``wo`` is this rank's partial of rank d's output rows, the producer of
    the reduce-scatter ring, so the output's reduce-scatter travels while the next slice's attention runs.
    Takes and returns the block's sequence shard ``(B, S/N, D)``; parameters, FQNs and state-dict keys are the
    stock ones (``qkv_linear``, ``wo``, ``inner_attention`` kept as built).

    The attention of each slice is commfuse's (:func:`commfuse.fused.attention.attend`: SDPA on the slice's
    rows against the keys it may see), not ``inner_attention``'s kernel, so only cores whose result it
    reproduces are swapped (:func:`use_commfuse` leaves the others stock): torchtitan's
    ``ScaledDotProductAttention`` (causal, no masks), ``FlexAttention`` with the ``BlockMask`` torchtitan's
    decoder builds (``get_attention_masks``: causal, and within a document; ``causal`` False in the config
    for a model whose masks let a query see later keys), ``VarlenAttention`` whose window is causal (-1, 0) or
    whole (-1, -1), its ``VarlenMetadata`` read as documents. The mask is cut per query slice
    (:class:`commfuse.fused.attention.AttentionMask`)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_GQAttention.Config):
        algorithm: str = "auto"
        causal: bool = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.causal = config.causal
        if not isinstance(self.qkv_linear, _Fused) or not isinstance(self.wo, RowParallelLinear):
            raise CommfuseTypeError(f"commfuse.integrations.torchtitan.Attention: qkv_linear and wo must be this "
                                    f"module's fused ones (use_commfuse makes them), got "
                                    f"{type(self.qkv_linear).__name__} and {type(self.wo).__name__}")

    def forward(self, x_BLD: torch.Tensor, attention_masks=None, positions: torch.Tensor | None = None):  # noqa: D102
        group = _group(self)
        if group is None:
            return _GQAttention.forward(self, x_BLD, attention_masks, positions)
        who = "commfuse.integrations.torchtitan.Attention"
        if isinstance(self.inner_attention, _SDPA) and attention_masks is not None:
            raise CommfuseValueError(f"{who}: got attention_masks ({type(attention_masks).__name__}) with "
                                     "torchtitan's ScaledDotProductAttention core, which takes none (stock raises "
                                     "too): use FlexAttention or VarlenAttention for masks")
        n = group.size()
        b, rows = x_BLD.shape[0], x_BLD.shape[1]
        given = {} if attention_masks is None else {"attention_masks": attention_masks}
        kind = fused_attention.mask_kind(given)
        config = layer_config("torchtitan.Attention", causal=bool(self.causal), mask=kind,
                              scale=0.0 if self.scaling is None else float(self.scaling),
                              qk_norm=self.q_norm is not None, bias=self.wo.bias is not None)
        weight = self.wo.weight
        compiling = torch.compiler.is_compiling()
        call = None if compiling else fused_attention.reduce_scatter_call(
            self.algorithm, batch=b, rows=rows, hidden=weight.shape[0], group=group, device=x_BLD.device,
            dtype=ops.autocast_dtype(x_BLD) or x_BLD.dtype)  # the partials' dtype: autocast's under it
        # a rank whose mask is refused, or whose projection fails, still leaves both calls: its peers are told why
        with op_calls(None if call is None else call.be, f"{who}.forward", 2):
            mask = fused_attention.resolve_mask(who, given, batch=b, seq=rows * n, heads=self.n_heads // n,
                                                world_size=n, rank=group.rank()) if given else None
            xq, xk, xv = self.qkv_linear(x_BLD)
            if self.q_norm is not None:
                xq, xk = self.q_norm(xq), self.k_norm(xk)
            xq, xk = self.rope(xq, xk, positions)
            if compiling:  # one op in the graph (commfuse.library)
                from commfuse import library

                z = library.attention_reduce_scatter(xq, xk, xv, weight, causal=self.causal, group=group,
                                                     algorithm=self.algorithm, mask=mask, scale=self.scaling)
            else:
                z = fused_attention.attention_reduce_scatter(call, xq, xk, xv, weight, causal=self.causal, mask=mask,
                                                             config=config, scale=self.scaling)
        return _bias(z, self.wo)


def _query_split_causal(inner) -> bool | None:
    """Whether torchtitan's attention core ``inner`` (its config) attends causally, for a core whose result
    :class:`Attention`'s query slices reproduce; None for a core they do not (left stock)."""
    kind = type(inner)
    if kind is _SDPA.Config:  # GQAttention calls it with is_causal's default, True, and no mask
        return True
    if kind is _Flex.Config:  # its masks are torchtitan's decoder's: causal, within a document
        return True
    if kind is _Varlen.Config:
        window = tuple(inner.window_size)
        return True if window == (-1, 0) else False if window == (-1, -1) else None  # a sliding window: stock
    return None


def _fields(config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def _as(cls, config, algorithm: str):
    """``config`` rebuilt as ``cls.Config`` (every field kept), with ``algorithm``."""
    return cls.Config(**{**_fields(config), "algorithm": algorithm})


def use_commfuse(model_config, *, algorithm: str = "auto", query_split: bool = True) -> list[str]:
    """Make the torchtitan model built from ``model_config`` (a decoder config with ``layers``, e.g.
    ``llama3_configs[...]``'s) run commfuse's fused modules for its tensor-parallel projections. In place,
    before the model is built; returns the FQNs of what it swapped, e.g. ``"layers.0.attention.qkv_linear"``.

    A block's attention is swapped as a pair (Q/K/V and ``wo``): torchtitan drops the block's input
    all-gather only when both are fused. Blocks whose attention or feed-forward is not torchtitan's stock
    ``GQAttention`` / SwiGLU ``FeedForward`` (or its ``dist_gemm`` variants) are left as they are and not
    listed; a MoE block's routed and shared experts are not tensor-parallel GEMMs of this kind.
    ``algorithm`` as for every commfuse op (``"auto"``, ``"ring"``, ``"vanilla"``, ...).

    ``query_split`` (default): a block whose attention core :class:`Attention` reproduces (SDPA, FlexAttention
    with the decoder's masks, causal or whole varlen) also runs its attention per query slice feeding ``wo``'s
    reduce-scatter (listed as ``"layers.0.attention"``); False, or another core, keeps torchtitan's core whole
    between the fused projections."""
    _check_version()
    layers = getattr(model_config, "layers", None)
    if not isinstance(layers, (list, tuple)):
        raise CommfuseTypeError(f"use_commfuse: expected a torchtitan decoder config with a list of layer configs "
                                f"in .layers, got {type(model_config).__name__} (layers={type(layers).__name__})")
    swapped = []
    for i, layer in enumerate(layers):
        attention = getattr(layer, "attention", None)
        if isinstance(attention, _GQAttention.Config) and type(attention.wo) in (_Linear.Config, _DistRow.Config,
                                                                                 RowParallelLinear.Config):
            qkv = attention.qkv_linear
            if isinstance(qkv, _StockFusedQKV.Config) and type(qkv) in (_StockFusedQKV.Config, _DistQKV.Config,
                                                                        FusedQKVLinear.Config):
                attention.qkv_linear = _as(FusedQKVLinear, qkv, algorithm)
            elif type(qkv) in (_StockQKV.Config, QKVLinear.Config):
                attention.qkv_linear = _as(QKVLinear, qkv, algorithm)
            else:
                qkv = None
            if qkv is not None:
                attention.wo = _as(RowParallelLinear, attention.wo, algorithm)
                swapped += [f"layers.{i}.attention.qkv_linear", f"layers.{i}.attention.wo"]
                causal = _query_split_causal(attention.inner_attention)
                if query_split and causal is not None and type(attention) in (_GQAttention.Config, Attention.Config):
                    layer.attention = Attention.Config(**{**_fields(attention), "algorithm": algorithm,
                                                          "causal": causal})
                    swapped.append(f"layers.{i}.attention")
        ffn = getattr(layer, "feed_forward", None)
        if type(ffn) in (_StockFFN.Config, _DistFFN.Config, FeedForward.Config):
            layer.feed_forward = _as(FeedForward, ffn, algorithm)
            swapped.append(f"layers.{i}.feed_forward")
    return swapped


def bind_group(model: torch.nn.Module, group) -> int:
    """Run ``model``'s commfuse modules on ``group`` instead of torchtitan's mesh context (None: back to the
    context). Returns how many modules were bound."""
    bound = 0
    for module in model.modules():
        if isinstance(module, _Fused):
            module._commfuse_group = group
            bound += 1
    return bound


def _check_version() -> None:
    have = _installed()
    if have not in TESTED:
        warnings.warn(f"commfuse.integrations.torchtitan is tested with torchtitan {', '.join(TESTED)}; this is "
                      f"torchtitan {have}", CommfuseWarning, stacklevel=3)
