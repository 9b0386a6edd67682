"""Rank-side bodies of the FSDP2 tests: commfuse's ShardedLinear inside a model that torch's fully_shard
shards, against the unsharded model trained on the whole batch."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import commfuse as cf
from commfuse.nn import ShardedLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tp_cases import _close, _full, _run  # noqa: E402  (the shared checks of the DTensor tests)


def _models(n):
    """(reference, sharded): a ShardedLinear then an nn.Linear that FSDP2 shards, from the same weights."""
    torch.manual_seed(21)
    l1, l2 = nn.Linear(8, 4 * n), nn.Linear(4 * n, 6)
    ref = nn.Sequential(nn.Linear(8, 4 * n), nn.ReLU(), nn.Linear(4 * n, 6))
    ref[0].load_state_dict(l1.state_dict()), ref[2].load_state_dict(l2.state_dict())
    mine = nn.Sequential(ShardedLinear.from_linear(l1, algorithm="ring"), nn.ReLU(), l2)
    return ref, mine


def with_fully_shard(rank, n):
    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))

    def helper_trains_like_the_unsharded_model():
        ref, mine = _models(n)
        cf.fsdp.fully_shard(mine, mesh=mesh)
        for name, p in mine.named_parameters():
            if not isinstance(p, DTensor):
                raise AssertionError(f"{name} is a {type(p).__name__}, not a DTensor")
        opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt_m = torch.optim.AdamW(mine.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(5)
        for step in range(4):
            x = torch.randn(2 * n, 3, 8, generator=g)
            # the reference sees the whole batch; each rank its rows, gradients averaged over the ranks
            (ref(x).square().sum() / n).backward()
            mine(x.tensor_split(n)[rank]).square().sum().backward()
            for (name, pr), (_, pm) in zip(ref.named_parameters(), mine.named_parameters()):
                _close(pm.grad, pr.grad, f"step {step} {name} grad")
            nr = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            nm = torch.nn.utils.clip_grad_norm_(mine.parameters(), 0.5)
            _close(nm, nr, f"step {step} clip_grad_norm_ (the whole model's norm, on every rank)")
            opt_r.step(), opt_m.step()
            opt_r.zero_grad(), opt_m.zero_grad()
        for (name, pr), (_, pm) in zip(ref.named_parameters(), mine.named_parameters()):
            _close(pm, pr, f"{name} after 4 AdamW steps")
        state = mine.state_dict()
        for key in ("0.weight", "0.bias", "2.weight"):
            if list(state[key].shape) != list(ref.state_dict()[key].shape):
                raise AssertionError(f"state_dict[{key!r}] has shape {list(state[key].shape)}, the layer's "
                                     f"{list(ref.state_dict()[key].shape)}")

    def torch_fully_shard_never_gives_wrong_gradients():
        from torch.distributed.fsdp import fully_shard

        _, mine = _models(n)
        try:
            fully_shard(mine, mesh=mesh)
            mine(torch.randn(2, 3, 8)).sum().backward()
        except cf.errors.CommfuseValueError as e:
            if "commfuse.fsdp.fully_shard" not in str(e) or "ignored_params" not in str(e):
                raise AssertionError(f"the error does not say what to do: {e}") from e
        except Exception:  # noqa: BLE001 - torch refusing the DTensor parameters itself is an error too
            pass
        else:
            raise AssertionError("torch's fully_shard over a ShardedLinear ran a backward")
        # with the documented ignored_params, torch's own fully_shard is right
        ref, mine = _models(n)
        fully_shard(mine, mesh=mesh, ignored_params=cf.fsdp.sharded_params(mine))
        x = torch.randn(2 * n, 3, 8)
        (ref(x).square().sum() / n).backward()
        mine(x.tensor_split(n)[rank]).square().sum().backward()
        for (name, pr), (_, pm) in zip(ref.named_parameters(), mine.named_parameters()):
            _close(pm.grad, pr.grad, f"{name} grad with ignored_params")

    def reregistered_parameters_raise():
        layer = ShardedLinear(8, 2 * n)
        layer.weight = nn.Parameter(torch.zeros(2 * n, 8))
        try:
            layer(torch.randn(2, 8))
        except cf.errors.CommfuseValueError as e:
            assert "no longer holds the parameters" in str(e) and f"rank {rank}" in str(e), e
        else:
            raise AssertionError("a ShardedLinear ran with a weight it did not make")

    def gradient_accumulation():
        ref, mine = _models(n)
        cf.fsdp.fully_shard(mine, mesh=mesh)
        g = torch.Generator().manual_seed(8)
        batches = [torch.randn(2 * n, 3, 8, generator=g) for _ in range(3)]
        for x in batches:
            (ref(x).square().sum() / n).backward()  # the reference accumulates the three micro-batches
        with cf.fsdp.no_sync(mine):
            for x in batches[:2]:
                mine(x.tensor_split(n)[rank]).square().sum().backward()
            held = mine[0].weight.grad  # None, or zeros where torch materializes a missing gradient (2.9)
            if held is not None and _full(held).abs().max().item() != 0:
                raise AssertionError("ShardedLinear reduced a gradient inside no_sync")
            if mine[0].requires_gradient_sync:
                raise AssertionError("no_sync left ShardedLinear's gradient sync on")
        mine(batches[2].tensor_split(n)[rank]).square().sum().backward()  # synced: reduces all three
        for (name, pr), (_, pm) in zip(ref.named_parameters(), mine.named_parameters()):
            _close(pm.grad, pr.grad, f"{name} grad after 2 unsynced and 1 synced micro-batches")
        # the held sums were used once: another synced backward reduces only its own micro-batch
        for p in (*ref.parameters(), *mine.parameters()):
            p.grad = None
        x = batches[0]
        (ref(x).square().sum() / n).backward()
        mine(x.tensor_split(n)[rank]).square().sum().backward()
        _close(mine[0].weight.grad, ref[0].weight.grad, "ShardedLinear grad of a lone synced micro-batch")

    def mixed_precision():
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        torch.manual_seed(31)
        lin = nn.Linear(8, 4 * n)
        mine = nn.Sequential(ShardedLinear.from_linear(lin, algorithm="ring"))
        theirs = nn.Sequential(nn.Linear(8, 4 * n))  # FSDP2's own sharding with the same policy
        theirs[0].load_state_dict(lin.state_dict())
        cf.fsdp.fully_shard(mine, mesh=mesh, mp_policy=policy)
        fully_shard(theirs, mesh=mesh, mp_policy=policy)
        layer = mine[0]
        if (layer.param_dtype, layer.reduce_dtype) != (torch.bfloat16, torch.float32):
            raise AssertionError(f"the policy did not reach ShardedLinear: {layer.param_dtype}, {layer.reduce_dtype}")
        x = torch.randn(2, 3, 8)
        ym, yt = mine(x), theirs(x)
        if ym.dtype != torch.bfloat16 or yt.dtype != torch.bfloat16:
            raise AssertionError(f"outputs are {ym.dtype} (commfuse) and {yt.dtype} (FSDP2), not bfloat16")
        if not torch.allclose(ym.float(), yt.float(), rtol=1e-2, atol=1e-2):
            raise AssertionError(f"bf16 outputs differ by {(ym.float() - yt.float()).abs().max().item():.3g}")
        ym.float().square().sum().backward()
        yt.float().square().sum().backward()
        for (name, pm), (_, pt) in zip(mine.named_parameters(), theirs.named_parameters()):
            if pm.dtype != torch.float32 or pm.grad.dtype != torch.float32:
                raise AssertionError(f"{name}: parameter {pm.dtype}, gradient {pm.grad.dtype}: not float32")
            got, want = _full(pm.grad), _full(pt.grad)
            if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
                raise AssertionError(f"{name} grad differs from FSDP2's by {(got - want).abs().max().item():.3g}")

    _run(results, "commfuse-fully-shard", helper_trains_like_the_unsharded_model)
    _run(results, "gradient-accumulation", gradient_accumulation)
    _run(results, "mixed-precision", mixed_precision)
    _run(results, "torch-fully-shard", torch_fully_shard_never_gives_wrong_gradients)
    _run(results, "reregistered", reregistered_parameters_raise)
    return results
