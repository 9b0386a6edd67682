"""Tensor-parallel linear layers with sequence parallelism (TPSP), and the MLP built from them.

Activations are (batch, seq, hidden) with the sequence sharded along
``sequence_dim`` (default 1), as torch's own tensor-parallel styles do.

======================= ========================== ================================ =========================
layer                   input (per rank)           forward                          backward
======================= ========================== ================================ =========================
ColumnParallelLinear    (b, s/N, in)               AG(x) @ W_r^T: all-gather ring   RS(dy @ W_r) ring (+ wgrad
                                                   + GEMM per arriving shard        GEMMs in its steps)
RowParallelLinear       (b, s, in/N)               RS(x @ W_r^T): GEMM per step     AG(dz) @ W_r ring (+ wgrad
                                                   + reduce-scatter ring            GEMM per arriving slice)
======================= ========================== ================================ =========================

Each layer's options that change what a rank computes but not the shapes (a
bias, ``keep_gathered``, the MLP's activation) join the fingerprint of its
ring, so a rank whose layer was built otherwise is named on every rank.

Under ``torch.autocast`` the layers compute as ``nn.Linear`` does there: the
GEMMs in the autocast dtype, the activations gathered and reduce-scattered in
it, the bias added in it; the outputs are in it, the gradients in the input's
and the parameters' own dtypes. Outside autocast an input whose dtype is not
the weight's is refused by name, as ``nn.Linear`` refuses it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import commfuse.ops as ops
from commfuse.errors import CommfuseValueError
from commfuse.nn._common import (
    algorithm_option,
    as_param,
    config,
    config_words,
    even,
    gather_dim,
    layer_mesh,
    linear_from_row_shards,
    load_row_shard,
    local,
    replicated,
    resolve_group,
    shard_range,
    site_forward,
    world,
)
from commfuse.schedule import Collective


def _init_linear(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    """nn.Linear's default initialisation, with the fan-in of the whole (unsharded) layer."""
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)


def _placement(kind: str, dim: int = 0):
    """A DTensor placement (imported on first use: a layer at world size 1 needs none)."""
    from torch.distributed.tensor import Replicate, Shard

    return Shard(dim) if kind == "shard" else Replicate()


class _TPLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, group, sequence_dim: int,
                 algorithm: str, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group = resolve_group(group)
        self.rank, self.world_size = world(self.group)
        self.sequence_dim = sequence_dim
        self.algorithm = algorithm
        self.backend = None  # a backend name or object for the ops; None: the one that fits the tensors
        # With more than one rank the parameters are DTensors on the group's mesh (a 1-D DeviceMesh given as
        # the group is that mesh) with torch's TP placements, so that clip_grad_norm_, state_dict, checkpoints
        # and optimizers see the whole layer; the ops work on the local shards.
        self._mesh = layer_mesh(group, self.group, self.world_size, device)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"rank={self.rank}/{self.world_size}, sequence_dim={self.sequence_dim}, algorithm={self.algorithm!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, ())

    def _run(self, x: torch.Tensor, more: tuple) -> torch.Tensor:
        """The forward, with ``more`` options of the module that holds this layer in its fingerprint."""
        raise NotImplementedError


class ColumnParallelLinear(_TPLinear):
    """``y = all_gather(x, sequence_dim) @ W_r^T + b_r``: sequence-sharded in, feature-sharded out.

    This rank holds rows ``tensor_split(out_features, N)[r]`` of the weight
    (and bias). Input (b, s/N, in) -> output (b, s, out_r). ``keep_gathered``
    keeps the gathered input for the weight gradient (memory) instead of
    gathering it again in the backward (time).
    """

    algorithm = algorithm_option(Collective.ALL_GATHER, native=True)

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, group=None,
                 sequence_dim: int = 1, algorithm: str = "auto", keep_gathered: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, group=group, sequence_dim=sequence_dim,
                         algorithm=algorithm, device=device, dtype=dtype)
        self.keep_gathered = keep_gathered
        even("out_features", out_features, self.world_size, "ColumnParallelLinear")
        _, rows = shard_range(out_features, self.rank, self.world_size)
        weight = torch.empty(rows, in_features, device=device, dtype=dtype)
        bias_ = torch.empty(rows, device=device, dtype=dtype) if bias else None
        _init_linear(weight, bias_, in_features)
        shard = _placement("shard", 0)
        self.weight = as_param(weight, self._mesh, shard, (out_features, in_features))
        self.bias = as_param(bias_, self._mesh, shard, (out_features,)) if bias else None

    @site_forward
    def _run(self, x: torch.Tensor, more: tuple) -> torch.Tensor:
        y = ops.all_gather_matmul(x, local(self.weight).t(), group=self.group, gather_dim=self.sequence_dim,
                                  algorithm=self.algorithm, keep_gathered=self.keep_gathered,
                                  backend=self.backend,
                                  config=config("ColumnParallelLinear", *more, bias=self.bias is not None,
                                                keep_gathered=bool(self.keep_gathered)))
        return y + local(self.bias).to(y.dtype) if self.bias is not None else y  # autocast's dtype under it

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group=None, sequence_dim: int = 1, algorithm: str = "auto",
                    keep_gathered: bool = True) -> "ColumnParallelLinear":
        """This rank's shard of an existing ``nn.Linear`` (its weights are copied, exactly)."""
        with torch.random.fork_rng(devices=[]):  # converting must not move the global RNG
            layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group,
                        sequence_dim=sequence_dim, algorithm=algorithm, keep_gathered=keep_gathered,
                        device=linear.weight.device, dtype=linear.weight.dtype)
        load_row_shard(layer, linear)
        return layer

    def to_linear(self) -> nn.Linear:
        """The whole layer as an ``nn.Linear`` on every rank (gathers the shards)."""
        return linear_from_row_shards(self)


class RowParallelLinear(_TPLinear):
    """``z = reduce_scatter(x @ W_r^T, sequence_dim) + b``: feature-sharded in, sequence-sharded out.

    This rank holds columns ``tensor_split(in_features, N)[r]`` of the weight;
    the bias is replicated and added after the reduce-scatter (its gradient is
    summed over the group, since each rank sees a different part of the
    sequence). Input (b, s, in_r) -> output (b, s/N, out).
    """

    algorithm = algorithm_option(Collective.REDUCE_SCATTER, native=True)

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, group=None,
                 sequence_dim: int = 1, algorithm: str = "auto", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, group=group, sequence_dim=sequence_dim,
                         algorithm=algorithm, device=device, dtype=dtype)
        even("in_features", in_features, self.world_size, "RowParallelLinear")
        _, cols = shard_range(in_features, self.rank, self.world_size)
        weight = torch.empty(out_features, cols, device=device, dtype=dtype)
        bias_ = torch.empty(out_features, device=device, dtype=dtype) if bias else None
        _init_linear(weight, bias_, in_features)
        self.weight = as_param(weight, self._mesh, _placement("shard", 1), (out_features, in_features))
        self.bias = as_param(bias_, self._mesh, _placement("replicate"), (out_features,)) if bias else None

    @site_forward
    def _run(self, x: torch.Tensor, more: tuple) -> torch.Tensor:
        z = ops.matmul_reduce_scatter(x, local(self.weight).t(), group=self.group, scatter_dim=self.sequence_dim,
                                      algorithm=self.algorithm, backend=self.backend,
                                      config=config("RowParallelLinear", *more, bias=self.bias is not None))
        return z + replicated(local(self.bias), self.group).to(z.dtype) if self.bias is not None else z

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group=None, sequence_dim: int = 1,
                    algorithm: str = "auto") -> "RowParallelLinear":
        """This rank's shard of an existing ``nn.Linear`` (its weights are copied, exactly)."""
        with torch.random.fork_rng(devices=[]):  # converting must not move the global RNG
            layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group,
                        sequence_dim=sequence_dim, algorithm=algorithm, device=linear.weight.device,
                        dtype=linear.weight.dtype)
        start, cols = shard_range(linear.in_features, layer.rank, layer.world_size)
        with torch.no_grad():
            local(layer.weight).copy_(linear.weight[:, start : start + cols])
            if layer.bias is not None:
                local(layer.bias).copy_(linear.bias)
        return layer

    def to_linear(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=local(self.weight).device, dtype=self.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(gather_dim(self.weight, 1, self.in_features, self.group))
            if self.bias is not None:
                linear.bias.copy_(local(self.bias))
        return linear


_ACTIVATIONS = {"gelu": nn.functional.gelu, "relu": nn.functional.relu, "silu": nn.functional.silu,
                "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}
config_words(*_ACTIVATIONS)  # a mismatch names the other rank's activation too


class ParallelMLP(nn.Module):
    """Column-parallel up projection, activation, row-parallel down projection (the Megatron TPSP MLP).

    Input and output (b, s/N, hidden). Forward: all-gather ring fused with
    the up GEMM, reduce-scatter ring fused with the down GEMM; backward the
    opposite rings. What stays un-overlapped: the activation and its
    gradient (local, no communication) and the first hop of nothing else.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, activation: str = "gelu", bias: bool = True,
                 group=None, sequence_dim: int = 1, algorithm: str = "auto", device=None, dtype=None) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise CommfuseValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        kw = dict(bias=bias, group=group, sequence_dim=sequence_dim, algorithm=algorithm, device=device,
                  dtype=dtype)
        self.fc1 = ColumnParallelLinear(hidden_size, ffn_hidden_size, **kw)
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, **kw)

    @property
    def algorithm(self) -> str:
        return self.fc1.algorithm

    @algorithm.setter
    def algorithm(self, value: str) -> None:
        self.fc1.algorithm = self.fc2.algorithm = value

    @property
    def backend(self):
        return self.fc1.backend

    @backend.setter
    def backend(self, value) -> None:
        self.fc1.backend = self.fc2.backend = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        more = (("activation", self.activation),)  # both rings: the activation is between them
        return self.fc2._run(_ACTIVATIONS[self.activation](self.fc1._run(x, more)), more)

    @classmethod
    def from_linears(cls, fc1: nn.Linear, fc2: nn.Linear, *, activation: str = "gelu", group=None,
                     sequence_dim: int = 1, algorithm: str = "auto") -> "ParallelMLP":
        """This rank's shard of an MLP given as its two ``nn.Linear`` layers."""
        mlp = cls.__new__(cls)
        nn.Module.__init__(mlp)
        if activation not in _ACTIVATIONS:
            raise CommfuseValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        mlp.activation = activation
        mlp.fc1 = ColumnParallelLinear.from_linear(fc1, group=group, sequence_dim=sequence_dim, algorithm=algorithm)
        mlp.fc2 = RowParallelLinear.from_linear(fc2, group=group, sequence_dim=sequence_dim, algorithm=algorithm)
        return mlp

    def to_linears(self) -> tuple[nn.Linear, nn.Linear]:
        return self.fc1.to_linear(), self.fc2.to_linear()
