"""Rank-side bodies of test_moe_routing_gloo.py (run inside ``commfuse.launch`` processes, in the torchtitan
environment): torchtitan 0.3's own MoE module, built from its config classes and run unparallelized on each
rank with every expert, as the reference of ``commfuse.nn.MoE`` over the ranks with the same weights."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _harness import prepare  # noqa: E402

# torch's grouped GEMM (torchtitan's experts) wants rows of 16 bytes in bfloat16: dims that are multiples of 8
HIDDEN, FFN = 8, 16


@dataclass(frozen=True)
class Routing:
    """One router and MoE configuration, in torchtitan's words (``make_router_config``, ``make_moe_config``);
    ``groups`` and ``limited`` may be "n" or "2n" (the world size, twice it); the expert count is 4n."""

    topk: int = 2
    score_func: str = "sigmoid"
    route_norm: bool = False
    route_scale: float = 1.0
    bias: bool = False
    load_balance_coeff: float | None = None
    groups: int | str | None = None
    limited: int | str | None = None
    shared: int | None = None  # the shared experts' hidden dim (make_ffn_config's)
    bf16_experts: bool = False  # torchtitan's GroupedExperts as it is (its GEMMs in bfloat16)


OPTION_SETS = {
    "route_scale": Routing(route_scale=2.5),
    "route_scale, renormalised": Routing(route_norm=True, route_scale=2.5),
    "router bias, softmax": Routing(score_func="softmax", bias=True),
    "router bias, sigmoid": Routing(bias=True, route_norm=True),
    "expert bias and its update": Routing(load_balance_coeff=1e-3),
    "node-limited, a group a rank": Routing(groups="n", limited=1),
    "node-limited, two groups a rank": Routing(topk=3, score_func="softmax", groups="2n", limited=2),
    "shared experts": Routing(score_func="softmax", shared=2 * FFN),
    "DeepSeek-V3-like": Routing(topk=3, route_norm=True, route_scale=2.5, bias=True, load_balance_coeff=1e-3,
                                groups="2n", limited="n", shared=2 * FFN),
    "DeepSeek-V3-like, torchtitan's bfloat16 experts": Routing(
        topk=3, route_norm=True, route_scale=2.5, bias=True, load_balance_coeff=1e-3, groups="2n", limited="n",
        shared=2 * FFN, bf16_experts=True),
}

#: fp32 kernels that differ (torch's grouped GEMM and torchtitan's scatter-add against commfuse's GEMMs and
#: index_add): sums in another order. torchtitan's stock experts cast their GEMMs to bfloat16.
FP32_TOL, BF16_TOL = 2e-5, 3e-2


def _sized(value, n: int):
    return {"n": n, "2n": 2 * n}.get(value, value) if isinstance(value, str) else value


def _whole(n: int, experts: int, r: Routing, seed: int = 1) -> dict:
    """Every weight, the same on every rank, in commfuse's layout (``MoE.load_experts``'s keywords). Skewed: the
    router row of expert 0 and, at 4 ranks, of the last rank's experts scores below every other on the
    (positive) tokens, and their expert bias is -1, so that no token chooses them."""
    g = torch.Generator().manual_seed(seed)
    whole = {"router": torch.randn(experts, HIDDEN, generator=g),
             "w13": torch.randn(experts, HIDDEN, 2 * FFN, generator=g) / HIDDEN ** 0.5,
             "w2": torch.randn(experts, FFN, HIDDEN, generator=g) / FFN ** 0.5}
    per_rank = experts // n
    starved = [0] + (list(range((n - 1) * per_rank, n * per_rank)) if n >= 4 else [])
    whole["router"][starved] = -10.0
    if r.bias:
        whole["router_bias"] = 0.5 * torch.randn(experts, generator=g)
    if r.load_balance_coeff is not None:
        bias = 0.05 * torch.randn(experts, generator=g)
        bias[starved] = -1.0
        whole["expert_bias"] = bias
    if r.shared is not None:
        whole["shared_w13"] = torch.randn(HIDDEN, 2 * r.shared, generator=g) / HIDDEN ** 0.5
        whole["shared_w2"] = torch.randn(r.shared, HIDDEN, generator=g) / r.shared ** 0.5
    return whole, starved


def _tokens(n: int, seed: int = 2) -> list[torch.Tensor]:
    """Every rank's tokens, (1, T, hidden), positive; rank 1 has none."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, c, HIDDEN, generator=g).abs() + 0.1 for c in [6, 0, 9, 4][:n]]


def _grad_weights(rank: int, y: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-1, 1, y.numel()).reshape(y.shape) * (rank + 1)


@functools.cache
def _float32_experts():
    """torchtitan's ``GroupedExperts`` with its forward's bfloat16 casts left out (the same grouped GEMMs,
    ``_grouped_mm``, in float32): what the fp32 comparisons run."""
    import torch.nn.functional as F
    from torchtitan.models.common.moe import GroupedExperts

    class Float32GroupedExperts(GroupedExperts):
        def forward(self, x_RD, num_tokens_per_expert_E):
            offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            h_RF = F.silu(self._grouped_mm(A=x_RD, B_t=self.w1_EFD.transpose(-2, -1), offs=offsets_E))
            h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=self.w3_EFD.transpose(-2, -1), offs=offsets_E)
            return self._grouped_mm(A=h_RF, B_t=self.w2_EDF.transpose(-2, -1), offs=offsets_E)

    return Float32GroupedExperts


def _torchtitan_moe(n: int, experts: int, r: Routing, whole: dict):
    """torchtitan's MoE from its config builders (as its DeepSeek-V3 builds one; the ``standard`` token
    dispatcher, which with no EP mesh dispatches locally), holding ``whole``."""
    from torchtitan.models.common.config_utils import (
        make_ffn_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )

    init = {"weight": torch.nn.init.zeros_, "bias": torch.nn.init.zeros_}  # every weight is copied in below
    config = make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=HIDDEN, num_experts=experts, gate_param_init=init, top_k=r.topk,
                                  score_func=r.score_func, route_norm=r.route_norm, route_scale=r.route_scale,
                                  num_expert_groups=_sized(r.groups, n), num_limited_groups=_sized(r.limited, n),
                                  bias=r.bias),
        routed_experts=make_routed_experts_config(dim=HIDDEN, hidden_dim=FFN, num_experts=experts, top_k=r.topk,
                                                  param_init=init, comm_backend="standard"),
        shared_experts=None if r.shared is None else make_ffn_config(
            dim=HIDDEN, hidden_dim=r.shared, w1_param_init=init, w2w3_param_init=init),
        load_balance_coeff=r.load_balance_coeff,
    )
    moe = config.build()
    inner = moe.routed_experts.inner_experts
    if not r.bf16_experts:
        inner.__class__ = _float32_experts()
    with torch.no_grad():
        moe.router.gate.weight.copy_(whole["router"])
        if r.bias:
            moe.router.gate.bias.copy_(whole["router_bias"])
        inner.w1_EFD.copy_(whole["w13"][..., :FFN].transpose(1, 2))
        inner.w3_EFD.copy_(whole["w13"][..., FFN:].transpose(1, 2))
        inner.w2_EDF.copy_(whole["w2"].transpose(1, 2))
        if r.shared is not None:
            moe.shared_experts.w1.weight.copy_(whole["shared_w13"][:, :r.shared].t())
            moe.shared_experts.w3.weight.copy_(whole["shared_w13"][:, r.shared:].t())
            moe.shared_experts.w2.weight.copy_(whole["shared_w2"].t())
        if r.load_balance_coeff is not None:
            moe.expert_bias_E.copy_(whole["expert_bias"])
    return moe


def _grads_in_commfuse_layout(moe, r: Routing) -> dict:
    """torchtitan's gradients under commfuse's names and layout (zeros where a rank's tokens gave none)."""
    def g(p):
        return torch.zeros_like(p) if p.grad is None else p.grad

    inner = moe.routed_experts.inner_experts
    out = {"router": g(moe.router.gate.weight),
           "w13": torch.cat([g(inner.w1_EFD).transpose(1, 2), g(inner.w3_EFD).transpose(1, 2)], dim=-1),
           "w2": g(inner.w2_EDF).transpose(1, 2)}
    if r.bias:
        out["router_bias"] = g(moe.router.gate.bias)
    if r.shared is not None:
        se = moe.shared_experts
        out["shared_w13"] = torch.cat([g(se.w1.weight).t(), g(se.w3.weight).t()], dim=1)
        out["shared_w2"] = g(se.w2.weight).t()
    return {k: v.contiguous() for k, v in out.items()}


class _Block(torch.nn.Module):
    """What torchtitan's load-balancing hook looks for: a block with ``moe_enabled`` and ``moe``."""

    def __init__(self, moe) -> None:
        super().__init__()
        self.moe_enabled, self.moe = True, moe


def _torchtitan_reference(rank: int, n: int, r: Routing, parallel_dims) -> dict:
    """torchtitan on this rank's tokens: the output, the input's gradient, every parameter's gradient of the
    mean of the ranks' losses (each rank's summed over the ranks, divided by n); with load balancing, the
    counts, the expert bias after one optimizer step with torchtitan's own hook (the counts summed over its
    loss mesh, every rank), and the output of a forward after it."""
    from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook

    experts = 4 * n
    whole, starved = _whole(n, experts, r)
    moe = _torchtitan_moe(n, experts, r, whole)
    x = _tokens(n)[rank].clone().requires_grad_()
    y = moe(x)
    (y * _grad_weights(rank, y)).sum().backward()
    grads = _grads_in_commfuse_layout(moe, r)
    for t in grads.values():
        dist.all_reduce(t)
        t /= n
    ref = {"whole": whole, "starved": starved, "y": y.detach(), "dx": x.grad, "grads": grads}
    # which experts torchtitan's router chose, every rank's tokens: the skew the test means
    with torch.no_grad():
        _, chosen, _ = moe.router(x, moe.expert_bias_E if r.load_balance_coeff is not None else None)
    picked = torch.zeros(experts)
    picked[chosen.flatten()] = 1
    dist.all_reduce(picked)
    ref["picked"] = picked.nonzero().flatten().tolist()
    if r.load_balance_coeff is not None:
        ref["counts"] = moe.tokens_per_expert_E.clone()
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleDict({"0": _Block(moe)})
        opt = torch.optim.SGD(moe.parameters(), lr=0.0)
        register_moe_load_balancing_hook(opt, [model], parallel_dims)
        opt.step()
        ref["expert_bias"] = moe.expert_bias_E.clone()
        with torch.no_grad():
            ref["y_after"] = moe(x)
    return ref


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> str | None:
    """None, or how ``got`` differs from ``want`` (within ``tol`` of the larger of 1 and want's largest)."""
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, torchtitan's {list(want.shape)}"
    if not got.numel():
        return None
    scale = max(want.abs().max().item(), 1.0)
    err = (got - want).abs().max().item()
    return None if err <= tol * scale else f"max difference {err:.3g} (tolerance {tol * scale:.3g})"


def routing_matches_torchtitan(rank: int, n: int, algorithms: list[str]) -> dict[str, list[str]]:
    """Each option set of :data:`OPTION_SETS`: torchtitan's MoE (every expert, this rank's tokens) against
    ``commfuse.nn.MoE`` over the ranks under each algorithm: the output, the input's gradient, every
    parameter's gradient (the experts', the router's and its bias's, the shared experts'); with load
    balancing the counts, the expert bias after one optimizer step with each one's hook (exactly), and the
    next output. Problems by option set."""
    prepare()
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  (build_mesh puts size-1 axes on it)
    from torchtitan.distributed import ParallelDims

    from commfuse.nn import MoE
    from commfuse.nn._common import local

    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=n, cp=1, tp=1, pp=1, ep=1, world_size=n)
    parallel_dims.build_mesh()  # its loss mesh: every rank, as its hook sums the counts over
    out: dict[str, list[str]] = {}
    for name, r in OPTION_SETS.items():
        problems = out.setdefault(name, [])
        tol = BF16_TOL if r.bf16_experts else FP32_TOL
        ref = _torchtitan_reference(rank, n, r, parallel_dims)
        experts = 4 * n
        if set(ref["picked"]) & set(ref["starved"]):
            problems.append(f"the routing is not skewed as meant: experts {ref['starved']} should go unpicked, "
                            f"torchtitan picked {ref['picked']}")
        for algorithm in algorithms:
            moe = MoE(HIDDEN, FFN, experts, r.topk, gating=r.score_func, normalize=r.route_norm,
                      route_scale=r.route_scale, router_bias=r.bias, load_balance_coeff=r.load_balance_coeff,
                      num_expert_groups=_sized(r.groups, n), num_limited_groups=_sized(r.limited, n),
                      shared_ffn_size=r.shared, algorithm=algorithm).load_experts(**ref["whole"])
            x = _tokens(n)[rank].clone().requires_grad_()
            y = moe(x)
            y.backward(_grad_weights(rank, y))
            lo, hi = moe.expert_range
            checks = [("output", y.detach(), ref["y"]), ("input gradient", x.grad, ref["dx"])]
            for pname, want in ref["grads"].items():
                got = local(getattr(moe, pname).grad)
                checks.append((f"{pname} gradient", got, want[lo:hi] if pname in ("w13", "w2") else want))
            if r.load_balance_coeff is not None:
                checks.append(("tokens per expert", moe.tokens_per_expert.clone(), ref["counts"]))
                opt = torch.optim.SGD(moe.parameters(), lr=0.0)
                moe.register_expert_bias_update(opt)
                opt.step()
                if not torch.equal(moe.expert_bias, ref["expert_bias"]):
                    problems.append(f"{algorithm}: expert bias after one step {moe.expert_bias.tolist()}, "
                                    f"torchtitan's {ref['expert_bias'].tolist()}")
                with torch.no_grad():
                    checks.append(("output after the expert bias's update", moe(x), ref["y_after"]))
            for what, got, want in checks:
                differs = _close(got, want, tol)
                if differs:
                    problems.append(f"{algorithm}: {what} differs from torchtitan's: {differs}")
    return out
