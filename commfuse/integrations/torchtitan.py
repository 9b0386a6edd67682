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

Attention itself runs torchtitan's own core (``inner_attention``: FlexAttention, varlen or SDPA, with
its masks) between the fused Q/K/V projection and the fused output projection. Slicing that core per
query slice to feed the reduce-scatter (what :class:`commfuse.nn.ParallelAttention` does with its own
attention) would replace torchtitan's kernels and their mask formats, so it is not done here; see
``docs/torchtitan.md``.

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
from commfuse.errors import CommfuseTypeError, CommfuseWarning
from commfuse import log
from commfuse.planning.pipelined import layer_config

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

__all__ = ["FeedForward", "FusedQKVLinear", "QKVLinear", "RowParallelLinear", "TESTED", "bind_group",
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

def _group(module):
    """The TP group ``module`` runs on: its bound group, else the ``tp`` axis of torchtitan's current mesh
    context; None (run the stock projection) when TP is off or of degree 1."""
    group = module._commfuse_group
    if group is None:
        mesh = current_spmd_mesh()
        if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
            group = None
        else:
            group = mesh.get_group("tp")
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


def _fields(config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def _as(cls, config, algorithm: str):
    """``config`` rebuilt as ``cls.Config`` (every field kept), with ``algorithm``."""
    return cls.Config(**{**_fields(config), "algorithm": algorithm})


def use_commfuse(model_config, *, algorithm: str = "auto") -> list[str]:
    """Make the torchtitan model built from ``model_config`` (a decoder config with ``layers``, e.g.
    ``llama3_configs[...]``'s) run commfuse's fused modules for its tensor-parallel projections. In place,
    before the model is built; returns the FQNs of what it swapped, e.g. ``"layers.0.attention.qkv_linear"``.

    A block's attention is swapped as a pair (Q/K/V and ``wo``): torchtitan drops the block's input
    all-gather only when both are fused. Blocks whose attention or feed-forward is not torchtitan's stock
    ``GQAttention`` / SwiGLU ``FeedForward`` (or its ``dist_gemm`` variants) are left as they are and not
    listed; a MoE block's routed and shared experts are not tensor-parallel GEMMs of this kind.
    ``algorithm`` as for every commfuse op (``"auto"``, ``"ring"``, ``"vanilla"``, ...)."""
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
