"""ZeRO-3 / FSDP-style data parallelism with the parameter gather and the gradient scatter fused into the GEMMs.

``ShardedLinear`` keeps rank r's rows ``tensor_split(out_features, N)[r]`` of
the weight (and bias) only. Forward: the weight shards travel a ring and each
arriving shard computes its block of output columns (``y[..., cols_s] = x @
W_s^T + b_s``), so the full weight is never materialised. Backward: the input
gradient needs the weight again: a second all-gather ring in which each
arriving shard adds ``dy[..., cols_s] @ W_s``; the weight gradient of shard d
is ``dy[..., cols_d]^T @ x`` summed over the data-parallel ranks: the
reduce-scatter ring (Flash-RS) whose producer is exactly that GEMM, so no full
weight gradient exists anywhere either. Un-overlapped: nothing but the first
GEMM's own shard in each ring. The layer's options that change what a rank
computes but not the shapes (a bias, ``reduce``) join the rings' fingerprint,
so a rank whose layer was built otherwise is named on every rank.

Mixed precision, as FSDP2's ``MixedPrecisionPolicy`` and ``torch.autocast``
give it to ``nn.Linear``: the input and the gathered weight shards are in the
compute dtype (autocast's while it is on, else ``param_dtype``, else the
parameters' own), so the weight ring carries that dtype; the weight gradients
are reduced in ``reduce_dtype`` (else the parameters' dtype) and land in the
parameters' dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from commfuse import ops
from commfuse.errors import CommfuseValueError
from commfuse.fused import sharded_linear
from commfuse.nn._common import (
    algorithm_option,
    as_dtensor,
    config,
    config_words,
    layer_mesh,
    linear_from_row_shards,
    load_row_shard,
    local,
    resolve_group,
    shard_range,
    site_forward,
    world,
)
from commfuse.nn.linear import _init_linear
from commfuse.planning.derive import configured
from commfuse.runtime.checkpointing import as_custom_op
from commfuse.schedule import Collective


config_words("avg", "sum")  # a mismatch names the other rank's reduce too


class ShardedLinear(nn.Module):
    """A linear layer whose weight lives sharded over the data-parallel group (ZeRO-3 / FSDP).

    ``reduce="avg"`` (default) averages the weight gradient over the group as
    DDP and FSDP do; ``"sum"`` sums it. ``out_features`` must divide by the
    group size. Input (..., in) -> output (..., out), with each rank's own batch.
    """

    algorithm = algorithm_option(Collective.ALL_GATHER, Collective.REDUCE_SCATTER)

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, group=None,
                 algorithm: str = "auto", reduce: str = "avg", param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, device=None, dtype=None) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.rank, self.world_size = world(self.group)
        if out_features % self.world_size:
            raise CommfuseValueError(
                f"ShardedLinear needs out_features divisible by the group size: {out_features} over {self.world_size}"
            )
        if reduce not in ("avg", "sum"):
            raise CommfuseValueError(f"reduce must be 'avg' or 'sum', got {reduce!r}")
        self.in_features, self.out_features, self.algorithm, self.reduce = in_features, out_features, algorithm, reduce
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise CommfuseValueError(f"{name} must be a floating-point torch.dtype or None, got {value!r}")
        #: mixed precision, as FSDP2's MixedPrecisionPolicy: the dtype the shards are gathered and computed in,
        #: and the one the gradients are reduced in (None: the parameters' own)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        #: False: backward passes accumulate this rank's whole gradient unreduced (gradient accumulation); the
        #: next backward with True reduce-scatters the sum (see commfuse.fsdp.no_sync)
        self.requires_gradient_sync = True
        self._held: dict[str, list[torch.Tensor]] = {}
        self.backend = None  # a backend name or object for the ops; None: the one that fits the tensors
        _, rows = shard_range(out_features, self.rank, self.world_size)
        weight = torch.empty(rows, in_features, device=device, dtype=dtype)
        bias_ = torch.empty(rows, device=device, dtype=dtype) if bias else None
        _init_linear(weight, bias_, in_features)
        # With more than one rank the parameters are DTensors Shard(0) on the group's mesh, so that
        # clip_grad_norm_, state_dict, distributed checkpoints and optimizers see the whole layer; the ops work
        # on their local shards. fully_shard must leave them alone (commfuse.fsdp.fully_shard does).
        # a DeviceMesh given as the group is the mesh: give fully_shard the same one
        self._mesh = layer_mesh(group, self.group, self.world_size, device)
        self.weight = nn.Parameter(self._distributed(weight))
        self.bias = nn.Parameter(self._distributed(bias_)) if bias else None
        self._own = (self.weight, self.bias)

    def use_mesh(self, mesh) -> None:
        """Put the parameters on ``mesh``, a 1-D DeviceMesh over the same ranks as the layer's group (the one
        given to ``fully_shard``, so that ``clip_grad_norm_`` and optimizers see one mesh); their values and
        gradients are kept. :func:`commfuse.fsdp.fully_shard` calls this."""
        if self._mesh is None or mesh == self._mesh:
            return
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
        if mesh.ndim != 1 or mesh.mesh.flatten().tolist() != list(ranks):
            raise CommfuseValueError(
                f"rank {self.rank}: ShardedLinear({self.in_features}, {self.out_features}) is sharded over ranks "
                f"{list(ranks)}, but the mesh given is over {mesh.mesh.tolist()}: give fully_shard the layer's "
                "data-parallel mesh, or build the layer with group=that mesh"
            )
        self._mesh = mesh
        for name in ("weight", "bias"):
            old = getattr(self, name)
            if old is None:
                continue
            new = nn.Parameter(self._distributed(local(old).detach()), requires_grad=old.requires_grad)
            if old.grad is not None:
                new.grad = self._distributed(local(old.grad))
            setattr(self, name, new)
        self._own = (self.weight, self.bias)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether backward reduces the gradients (True) or accumulates them unreduced (False), as FSDP2's
        method of the same name."""
        self.requires_gradient_sync = bool(requires_gradient_sync)

    def _hold(self, name: str, parts: list[torch.Tensor] | None) -> None:
        """Add an unreduced gradient (its row blocks, one per rank) to what the next synced backward reduces."""
        if parts is None:
            return
        held = self._held.get(name)
        if held is None:
            self._held[name] = parts
        else:
            for mine, more in zip(held, parts):
                mine.add_(more)

    def _with_held(self, name: str, produce):
        """``produce`` plus the gradient accumulated since the last reduction, block by block."""
        held = self._held.get(name)
        if held is None:
            return produce
        return lambda d: produce(d).add_(held[d])

    def _distributed(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import Shard

        return as_dtensor(t, self._mesh, Shard(0), [t.shape[0] * self.world_size, *t.shape[1:]])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"rank={self.rank}/{self.world_size}, algorithm={self.algorithm!r}, reduce={self.reduce!r}")

    @site_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not self._own[0] or self.bias is not self._own[1]:
            raise CommfuseValueError(
                f"rank {self.rank}: ShardedLinear({self.in_features}, {self.out_features}) no longer holds the "
                f"parameters it made (now a {type(self.weight).__name__} of shape {list(self.weight.shape)}): "
                "something re-registered them, most likely torch's fully_shard, which would shard the shards "
                "again and give wrong gradients. ShardedLinear is its own data-parallel sharding: use "
                "commfuse.fsdp.fully_shard(model, mesh=...), or pass "
                "ignored_params=commfuse.fsdp.sharded_params(model) to torch's fully_shard"
            )
        # autocast's dtype when it is on (as nn.Linear under FSDP2 computes: autocast casts the parameters that
        # FSDP2 gathered in param_dtype), else param_dtype; gradients still reduced in reduce_dtype, else the
        # parameters' own
        compute = ops.autocast_dtype(x) or self.param_dtype
        if compute is not None and x.is_floating_point():
            x = x.to(compute)
        elif compute is None and x.dtype != self.weight.dtype:
            raise CommfuseValueError(
                f"rank {self.rank}: ShardedLinear({self.in_features}, {self.out_features}): the input has dtype "
                f"{x.dtype} but the weight has {self.weight.dtype}; nn.Linear under FSDP2 refuses mixed dtypes too "
                "(mat1 and mat2 must have the same dtype): run under torch.autocast, give the layer a param_dtype "
                "(FSDP2's MixedPrecisionPolicy through commfuse.fsdp.fully_shard), or cast the input or the layer"
            )
        if self.world_size > 1 and (torch.compiler.is_compiling() or (
                as_custom_op() and self.backend is None and self.requires_gradient_sync and not self._held)):
            return self._compiled(x)  # one op in the graph (and, under selective checkpointing, to its policy)
        return self._ring(x, compute)

    def _ring(self, x: torch.Tensor, compute: torch.dtype | None) -> torch.Tensor:
        if self.world_size == 1:
            w, b = self.weight, self.bias
            if compute is not None:
                w, b = w.to(compute), (b.to(compute) if b is not None else None)
            return nn.functional.linear(x, w, b)
        weight, bias = local(self.weight), local(self.bias) if self.bias is not None else None
        # auto decides on one shard's bytes in the compute dtype (all shards are alike), the same on every rank
        call = sharded_linear.all_gather_call(self.algorithm, weight, compute or self.weight.dtype, group=self.group,
                                              backend=self.backend, device=x.device)
        call = configured(call, config("ShardedLinear", bias=self.bias is not None, reduce=self.reduce))
        return sharded_linear.sharded_linear_fn(call, self, x, weight, bias)

    def _compiled(self, x: torch.Tensor) -> torch.Tensor:
        """The forward as ``torch.ops.commfuse.sharded_linear``: one op in the graph, its backward the same
        rings as eager's. Gradient accumulation without sync keeps gradients in the module, which no op of a
        graph can do: refused here (with ``fullgraph=False`` torch.compile then runs this forward eagerly)."""
        from commfuse import library

        if not self.requires_gradient_sync or self._held:
            raise CommfuseValueError(
                f"rank {self.rank}: ShardedLinear({self.in_features}, {self.out_features}) under torch.compile "
                "with gradient sync off (no_sync / set_requires_gradient_sync(False)) or with gradients held from "
                "such steps: the held gradients live in the module, which a compiled graph cannot update; run the "
                "accumulation steps eagerly, or compile with fullgraph=False (that forward then runs eagerly)"
            )
        if self.backend is not None:
            raise CommfuseValueError(f"ShardedLinear under torch.compile takes its group's backend; "
                                     f"backend={self.backend!r} cannot be given")
        bias = self.bias
        return library.sharded_linear(x, local(self.weight), local(bias) if bias is not None else None,
                                      group=self.group, algorithm=self.algorithm, reduce=self.reduce,
                                      reduce_dtype=self.reduce_dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group=None, algorithm: str = "auto",
                    reduce: str = "avg") -> "ShardedLinear":
        with torch.random.fork_rng(devices=[]):  # converting must not move the global RNG
            layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group,
                        algorithm=algorithm, reduce=reduce, device=linear.weight.device, dtype=linear.weight.dtype)
        load_row_shard(layer, linear)
        return layer

    def to_linear(self) -> nn.Linear:
        return linear_from_row_shards(self)
