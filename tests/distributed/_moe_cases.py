"""Rank-side bodies of test_moe_gloo.py (run inside ``commfuse.launch`` processes)."""

from __future__ import annotations

import torch

import commfuse as cf
from commfuse.errors import CommfuseError
from commfuse.nn import MoE, moe_reference
from commfuse.nn._common import local
from commfuse.nn.moe import route
from commfuse.runtime.c10d import C10dBackend
from commfuse.runtime.observe import measure

HIDDEN, FFN = 8, 12


def _weights(n: int, experts: int, *, starve_rank: int | None, starve_expert: int | None, seed: int = 1):
    """Full router and expert weights, the same on every rank. A starved expert (and every expert of a
    starved rank) gets a router row that no token picks."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(experts, HIDDEN, generator=g)
    w13 = torch.randn(experts, HIDDEN, 2 * FFN, generator=g) / HIDDEN ** 0.5
    w2 = torch.randn(experts, FFN, HIDDEN, generator=g) / FFN ** 0.5
    per_rank = experts // n
    starved = set()
    if starve_rank is not None:
        starved.update(range(starve_rank * per_rank, (starve_rank + 1) * per_rank))
    if starve_expert is not None:
        starved.add(starve_expert)
    for e in starved:
        router[e] = -10.0  # tokens are positive: this row scores below every other
    return router, w13, w2, sorted(starved)


def _tokens(n: int, seed: int = 2) -> list[torch.Tensor]:
    """Every rank's tokens; rank 1 has none (it sends nothing, and gets nothing back)."""
    g = torch.Generator().manual_seed(seed)
    counts = [6, 0, 9, 4][:n]
    xs = [torch.randn(c, HIDDEN, generator=g) for c in counts]
    return [x.abs() + 0.1 for x in xs]  # positive inputs: a negative router row scores below the rest


def _reference(xs, router, w13, w2, topk, gating):
    """The one-process reference over every rank's tokens: outputs and input gradients by rank (each of its
    own loss), and the parameters' gradients of the mean of the ranks' losses (the experts' summed over every
    rank's tokens, divided by the rank count; the router's averaged over the ranks)."""
    r_ = router.clone().requires_grad_()
    w13_ = w13.clone().requires_grad_()
    w2_ = w2.clone().requires_grad_()
    xr = [x.clone().requires_grad_() for x in xs]
    ys = [moe_reference(x, r_, w13_, w2_, topk, gating) for x in xr]
    loss = sum(((y * _grad_weights(q, y)).sum() for q, y in enumerate(ys)), torch.zeros(()))
    loss.backward()
    # the router's gradient on each rank is its own tokens' only
    router_grads = []
    for x in xs:
        r1 = router.clone().requires_grad_()
        q = len(router_grads)
        y = moe_reference(x, r1, w13, w2, topk, gating)
        (y * _grad_weights(q, y)).sum().backward() if y.numel() else None
        router_grads.append(r1.grad if r1.grad is not None else torch.zeros_like(router))
    n = len(xs)
    return ys, [x.grad for x in xr], w13_.grad / n, w2_.grad / n, sum(router_grads) / n


def _grad_weights(rank: int, y: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-1, 1, y.numel()).reshape(y.shape) * (rank + 1)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> bool:
    if got.shape != want.shape:
        return False
    scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
    return got.numel() == 0 or (got - want).abs().max().item() <= tol * scale


def matches_reference(rank: int, n: int, algorithms: list[str]) -> list[str]:
    """Forward and backward of MoE against the one-process reference: top-1 and top-2, softmax and sigmoid
    gating, skewed routing (a rank with no tokens, an expert no token picks, and at 3+ ranks a rank whose
    experts no token picks). fp32 forward outputs exactly (within 1e-6 where blocks are cut in slices);
    gradients (sums in another order) within 2e-5: the input's of this rank's loss, the parameters' of the
    mean of the ranks' losses."""
    problems: list[str] = []
    experts = 2 * n
    starve_rank = n - 1 if n >= 3 else None
    for topk, gating in ((1, "softmax"), (2, "softmax"), (2, "sigmoid")):
        router, w13, w2, starved = _weights(n, experts, starve_rank=starve_rank, starve_expert=0)
        xs = _tokens(n)
        ys, dxs, dw13, dw2, drouter = _reference(xs, router, w13, w2, topk, gating)
        picked = set()
        for x in xs:
            if x.numel():
                picked.update(torch.topk((x @ router.t()), topk).indices.flatten().tolist())
        if picked & set(starved):
            problems.append(f"the test's routing is not skewed as meant: experts {sorted(picked & set(starved))} "
                            "were picked")
        for algorithm in algorithms:
            where = f"top-{topk} {gating} {algorithm}"
            moe = MoE(HIDDEN, FFN, experts, topk, gating=gating, algorithm=algorithm).load_experts(router, w13, w2)
            x, y = _forward_backward(problems, where, moe, rank, xs[rank], ys[rank])
            lo, hi = moe.expert_range
            _gradients_and_modes(problems, where, moe, xs[rank], y,
                                 (("input", x.grad, dxs[rank]), ("w13", moe.w13.grad, dw13[lo:hi]),
                                  ("w2", moe.w2.grad, dw2[lo:hi]), ("router", moe.router.grad, drouter)))
    return problems


def _forward_backward(problems: list, where: str, moe, rank: int, x_in: torch.Tensor, want: torch.Tensor):
    """``moe`` on a copy of ``x_in``, its output checked against the reference's ``want``, then its backward:
    ``(x, y)``. Whole blocks run the experts' GEMMs on the reference's rows, exactly; blocks cut in slices
    (ring:m, sliced:c) run them on fewer rows at a time, which the BLAS may block differently."""
    x = x_in.clone().requires_grad_()
    y = moe(x)
    ((call,),) = moe._calls.values()  # what the layer ran (auto resolved)
    exact = call.spec.name in ("vanilla", "ring") and call.spec.parts == 1
    if not (torch.equal(y, want) if exact else _close(y, want, 1e-6)):
        problems.append(f"{where}: forward differs from the reference (max "
                        f"{(y - want).abs().max().item() if y.numel() else 0:g})")
    y.backward(_grad_weights(rank, y))
    return x, y


def _gradients_and_modes(problems: list, where: str, moe, x: torch.Tensor, y: torch.Tensor, checks) -> None:
    """Each ``(name, got, want)`` gradient compared, then the measurement modes the benchmark uses run on the same
    layer end to end."""
    for name, got, want in checks:
        got = torch.zeros_like(want) if got is None else local(got)  # a DTensor's: this rank's piece
        if not _close(got, want):
            problems.append(f"{where}: {name} gradient differs (max {(got - want).abs().max().item():g})")
    for mode in ("comm_only", "compute_only"):
        with measure(mode):
            out = moe(x.clone().requires_grad_())
            out.backward(torch.ones_like(out))
        if out.shape != y.shape:
            problems.append(f"{where}: {mode} gave shape {list(out.shape)}")


def uneven_no_empty_messages(rank: int, n: int) -> dict:
    """Uneven exchanges whose empty blocks must not reach the transport: every message the backend is asked
    to post, by size, under each algorithm; and results exact."""
    be = C10dBackend()
    posted: list[int] = []
    real_post = be.post

    def counting(sends, recvs):  # the data's messages (float); the call checks' fingerprints are int64
        posted.extend(t.numel() for _, t in sends if t.is_floating_point())
        posted.extend(-t.numel() for _, t in recvs if t.is_floating_point())
        return real_post(sends, recvs)

    be.post = counting
    rows = [[(s + 2 * d) % 3 if s != 0 else 0 for d in range(n)] for s in range(n)]  # rank 0 sends nothing
    problems = []
    for algorithm in ("ring", "ring:2"):
        posted.clear()
        chunks = [torch.full((rows[rank][d], 2), 10.0 * rank + d) for d in range(n)]
        got = cf.all_to_all_consume(chunks, lambda t, s: t.clone(), uneven=True, algorithm=algorithm, backend=be)
        for s in range(n):
            if got[s].shape != (rows[s][rank], 2) or not bool((got[s] == 10.0 * s + rank).all()):
                problems.append(f"{algorithm}: block from {s} is {got[s].tolist()}")
        made = cf.produce_all_to_all(lambda d: torch.full((rows[rank][d], 2), 10.0 * rank + d),
                                     input_splits=rows[rank], algorithm=algorithm, backend=be)
        for s in range(n):
            if made[s].shape != (rows[s][rank], 2) or not bool((made[s] == 10.0 * s + rank).all()):
                problems.append(f"{algorithm} produce: block from {s} is {made[s].tolist()}")
        if 0 in posted:
            problems.append(f"{algorithm}: an empty message was posted: {posted}")
        sent = sum(1 for x in posted if x > 0)
        want_sent = 2 * sum(1 for d in range(n) if d != rank and rows[rank][d])  # consume, then produce
        if algorithm == "ring:2":  # a block cut in two: one message per non-empty half
            want_sent = 2 * sum(sum(1 for half in (rows[rank][d] - rows[rank][d] // 2, rows[rank][d] // 2) if half)
                                for d in range(n) if d != rank)
        if sent != want_sent:
            problems.append(f"{algorithm}: {sent} data messages sent, expected {want_sent} ({posted})")
    return {"problems": problems}


def mismatched(rank: int, n: int, what: str) -> str:
    """Rank 1 builds a different layer; every rank must raise, naming the difference."""
    experts, hidden = 2 * n, HIDDEN
    if rank == 1 and what == "experts":
        experts = 4 * n
    if rank == 1 and what == "hidden":
        hidden = HIDDEN + 4
    moe = MoE(hidden, FFN, experts, 2, algorithm="ring")
    try:
        moe(torch.randn(5, hidden))
    except CommfuseError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def compiled(rank: int, n: int) -> dict:
    """torch.compile of the layer: with fullgraph=False the exchanges run at a graph break and the result and
    gradients equal eager's exactly; fullgraph=True fails naming why."""
    import os
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()  # the FX cache does not key on fake kernels
    torch.manual_seed(0)
    moe = MoE(HIDDEN, FFN, 2 * n, 2, algorithm="ring")
    x = torch.randn(6, HIDDEN) + rank
    xe = x.clone().requires_grad_()
    want = moe(xe)
    want.sum().backward()
    eager_grads = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    xc = x.clone().requires_grad_()
    got = torch.compile(moe, backend="aot_eager")(xc)
    got.sum().backward()
    out = {"equal": torch.equal(got, want) and torch.equal(xc.grad, xe.grad)
           and all(torch.equal(p.grad, g) for p, g in zip(moe.parameters(), eager_grads))}
    torch._dynamo.reset()  # else the frames compiled above are reused without tracing again
    try:
        torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
        out["fullgraph"] = "compiled"
    except Exception as e:  # noqa: BLE001 - Dynamo's own error type wraps ours
        out["fullgraph"] = str(e)
    return out


def auto_takes(rank: int, n: int) -> dict:
    """What ``auto`` resolves to for a layer whose ring hop carries ``rows * 2 // n * 64 * 4`` bytes (top-2,
    hidden 64, float32), and whether the layer then still equals the one-process reference."""
    from commfuse.planning.calls import MIN_SLICE_BYTES

    out = {}
    for rows in (MIN_SLICE_BYTES * n // (2 * 64 * 4), 2 * MIN_SLICE_BYTES * n // (2 * 64 * 4)):
        torch.manual_seed(0)
        moe = MoE(64, 32, 2 * n, 2, algorithm="auto")
        x = torch.randn(rows, 64) + 0.1 * rank
        y = moe(x)
        (call,) = moe._calls.values()
        xs = [torch.empty(rows, 64) for _ in range(n)]
        torch.distributed.all_gather(xs, x)
        want = moe_reference(xs[rank], *moe.gather_experts(), 2)
        out[rows] = {"taken": call[0].spec.shown, "reason": call[0].reason, "close": _close(y, want, 1e-5)}
    return out


# -- the routing options (DeepSeek-V3's, as torchtitan 0.3 has them) ----------------------------------------------

#: Each option set: a name, top-k, gating and MoE's keyword options. ``groups`` and ``limited`` are written for
#: the world size n (see ``_routing``); the expert count is 4n.
OPTION_SETS = [
    ("route_scale", 2, "sigmoid", dict(route_scale=2.5)),
    ("router_bias softmax", 2, "softmax", dict(router_bias=True)),
    ("router_bias sigmoid", 2, "sigmoid", dict(router_bias=True)),
    ("expert_bias", 2, "sigmoid", dict(load_balance_coeff=1e-3)),
    ("node-limited, a group a rank", 2, "sigmoid", dict(num_expert_groups="n", num_limited_groups=1)),
    ("node-limited, two groups a rank", 3, "softmax", dict(num_expert_groups="2n", num_limited_groups=2)),
    ("shared experts", 2, "softmax", dict(shared_ffn_size=2 * FFN)),
    ("DeepSeek-V3-like", 3, "sigmoid", dict(route_scale=2.5, router_bias=True, load_balance_coeff=1e-3,
                                            num_expert_groups="2n", num_limited_groups="n",
                                            shared_ffn_size=2 * FFN)),
]


def _routing(options: dict, n: int) -> dict:
    """The option set at world size n ("n" and "2n" read as such)."""
    sizes = {"n": n, "2n": 2 * n}
    return {k: sizes.get(v, v) if isinstance(v, str) else v for k, v in options.items()}


def _whole_layer(n: int, experts: int, options: dict, seed: int = 1) -> dict:
    """Every weight of the layer, the same on every rank: the router's and experts' of :func:`_weights` (expert 0
    and, at 4 ranks, the last rank's experts starved), and what the options add: a router bias, an expert
    bias (random, and -1 on the starved experts so that it never un-starves them), the shared experts."""
    router, w13, w2, starved = _weights(n, experts, starve_rank=n - 1 if n >= 4 else None, starve_expert=0,
                                        seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    whole = {"router": router, "w13": w13, "w2": w2}
    if options.get("router_bias"):
        whole["router_bias"] = 0.5 * torch.randn(experts, generator=g)
    if options.get("load_balance_coeff") is not None:
        bias = 0.05 * torch.randn(experts, generator=g)
        bias[starved] = -1.0
        whole["expert_bias"] = bias
    if options.get("shared_ffn_size") is not None:
        f = options["shared_ffn_size"]
        whole["shared_w13"] = torch.randn(HIDDEN, 2 * f, generator=g) / HIDDEN ** 0.5
        whole["shared_w2"] = torch.randn(f, HIDDEN, generator=g) / f ** 0.5
    return whole, starved


def _route_options(whole: dict, options: dict) -> dict:
    """moe_reference's keywords for the option set and weights."""
    kw = {k: options[k] for k in ("route_scale", "num_expert_groups", "num_limited_groups") if k in options}
    for name in ("router_bias", "expert_bias", "shared_w13", "shared_w2"):
        if name in whole:
            kw[name] = whole[name]
    return kw


def _picked(xs, whole: dict, topk: int, gating: str, kw: dict) -> list:
    """The experts each token of every rank chooses under routing options ``kw`` (moe_reference's), sorted."""
    picked = []
    for x in xs:
        if x.numel():
            _, chosen = route(x, whole["router"], topk, gating, bias=kw.get("router_bias"),
                              expert_bias=kw.get("expert_bias"), route_scale=kw.get("route_scale", 1.0),
                              num_expert_groups=kw.get("num_expert_groups"),
                              num_limited_groups=kw.get("num_limited_groups"))
            picked.extend(map(tuple, chosen.sort(dim=-1).values.tolist()))
    return picked


def _reference_with(xs, whole: dict, topk: int, gating: str, kw: dict):
    """:func:`_reference` with the routing options: outputs and input gradients by rank (each of its own loss),
    and every parameter's gradient of the mean of the ranks' losses (the experts' summed over every rank's
    tokens and the replicated ones' over every rank's loss, each divided by the rank count)."""
    params = {k: v.clone().requires_grad_() for k, v in whole.items() if k != "expert_bias"}
    kw = {k: params.get(k, v) for k, v in kw.items()}
    xr = [x.clone().requires_grad_() for x in xs]
    ys = [moe_reference(x, params["router"], params["w13"], params["w2"], topk, gating, **kw) for x in xr]
    loss = sum(((y * _grad_weights(q, y)).sum() for q, y in enumerate(ys)), torch.zeros(()))
    loss.backward()
    n = len(xs)
    return [y.detach() for y in ys], [x.grad for x in xr], {k: p.grad / n for k, p in params.items()}


def options_match_reference(rank: int, n: int, algorithms: list[str]) -> list[str]:
    """Forward and backward of MoE with each routing option (route_scale, a router bias, an expert bias,
    node-limited routing, shared experts, all of them at once) against the one-process reference, with
    skewed routing (a rank with no tokens, an expert no token picks, at 4 ranks a rank whose experts no token
    picks): outputs exactly where the blocks are whole (within 1e-6 where cut in slices), gradients within
    2e-5 (the input's, the experts', the router's and its bias's, the shared experts')."""
    problems: list[str] = []
    experts = 4 * n
    xs = _tokens(n)
    for name, topk, gating, options in OPTION_SETS:
        options = _routing(options, n)
        whole, starved = _whole_layer(n, experts, options)
        kw = _route_options(whole, options)
        picked = _picked(xs, whole, topk, gating, kw)
        if {e for p in picked for e in p} & set(starved):
            problems.append(f"{name}: the test's routing is not skewed as meant: starved experts were picked")
        # each option that changes the choice must change it here, or the test proves nothing of it
        for option, off in (("expert_bias", ("expert_bias",)),
                            ("num_expert_groups", ("num_expert_groups", "num_limited_groups"))):
            if option in kw:
                without = {k: v for k, v in kw.items() if k not in off}
                if _picked(xs, whole, topk, gating, without) == picked:
                    problems.append(f"{name}: {option} changed no token's choice: the test does not exercise it")
        ys, dxs, grads = _reference_with(xs, whole, topk, gating, kw)
        for algorithm in algorithms:
            where = f"{name} (top-{topk} {gating}) {algorithm}"
            moe = MoE(HIDDEN, FFN, experts, topk, gating=gating, algorithm=algorithm, **options)
            moe.load_experts(**whole)
            x, y = _forward_backward(problems, where, moe, rank, xs[rank], ys[rank])
            lo, hi = moe.expert_range
            checks = [("input", x.grad, dxs[rank])]
            for pname, want in grads.items():
                checks.append((pname, getattr(moe, pname).grad, want[lo:hi] if pname in ("w13", "w2") else want))
            _gradients_and_modes(problems, where, moe, xs[rank], y, checks)
    return problems


#: Hand-computed updates (coefficient 1): the tokens per expert summed over every rank, and
#: ``sign(mean - counts)`` less its mean. 4 experts: mean 1.5, signs -1 1 1 1 (mean 0.5). 8 experts: mean 2,
#: signs -1 1 1 1 1 0 0 -1 (mean 0.25).
HAND_UPDATES = {
    4: ([3, 1, 1, 1], [-1.5, 0.5, 0.5, 0.5]),
    8: ([3, 1, 1, 1, 0, 2, 2, 6], [-1.25, 0.75, 0.75, 0.75, 0.75, -0.25, -0.25, -1.25]),
}


def expert_bias_update(rank: int, n: int) -> list[str]:
    """The load balancing's bookkeeping and update against hand-computed values: each training forward adds
    this rank's tokens per expert (an eval forward none); before ``optimizer.step()`` the hook sums the
    counts over the ranks, adds ``coeff * sign(mean - counts)`` less its mean to the bias (the same on every
    rank) and zeroes the counts; the next forward chooses with the new bias. At 4 ranks, also on a 2 x 2
    (dp, ep) mesh, the counts summed over the data-parallel group as well."""
    problems: list[str] = []
    experts, coeff = 2 * n, 0.25
    options = dict(load_balance_coeff=coeff)
    whole, _ = _whole_layer(n, experts, options, seed=5)
    moe = MoE(HIDDEN, FFN, experts, 2, gating="sigmoid", algorithm="ring", **options).load_experts(**whole)
    x = _tokens(n)[rank]
    kw = _route_options(whole, options)
    _, chosen = route(x, whole["router"], 2, "sigmoid", expert_bias=whole["expert_bias"])
    mine = torch.bincount(chosen.flatten(), minlength=experts).float()
    moe(x)
    moe(x)
    with torch.no_grad():
        moe.eval()
        moe(x)
        moe.train()
    if not torch.equal(moe.tokens_per_expert, 2 * mine):
        problems.append(f"counts after two training forwards and one eval forward: {moe.tokens_per_expert.tolist()}, "
                        f"expected twice {mine.tolist()}")
    # the update, from counts set by hand: rank r holds its share of the global counts
    counts, signs = HAND_UPDATES[experts]
    share = [c // n + (1 if rank < c % n else 0) for c in counts]
    moe.tokens_per_expert.copy_(torch.tensor(share, dtype=torch.float32))
    before = moe.expert_bias.clone()
    opt = torch.optim.SGD(moe.parameters(), lr=0.0)
    handle = moe.register_expert_bias_update(opt)
    opt.step()
    want = before + coeff * torch.tensor(signs)
    if not torch.equal(moe.expert_bias, want):
        problems.append(f"expert bias after the update: {moe.expert_bias.tolist()}, expected {want.tolist()}")
    if moe.tokens_per_expert.abs().sum().item() != 0:
        problems.append(f"the update left counts {moe.tokens_per_expert.tolist()}")
    handle.remove()
    opt.step()  # no hook: nothing changes
    if not torch.equal(moe.expert_bias, want):
        problems.append("the expert bias changed on a step after the hook was removed")
    # the next forward chooses with the new bias (the gate weights stay the unbiased scores)
    kw["expert_bias"] = want
    y = moe(x)
    ref = moe_reference(x, whole["router"], whole["w13"], whole["w2"], 2, "sigmoid", **kw)
    if not torch.equal(y, ref):
        problems.append(f"after the update, forward differs from the reference (max {(y - ref).abs().max():g})")
    if n == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        counts, signs = HAND_UPDATES[4]
        dp_moe = MoE(HIDDEN, FFN, 4, 2, gating="sigmoid", group=mesh["ep"], **options)
        before = dp_moe.expert_bias.clone()
        dp_moe.tokens_per_expert.copy_(torch.tensor([c // 4 + (1 if rank < c % 4 else 0) for c in counts],
                                                    dtype=torch.float32))
        dp_moe.update_expert_bias(dp_group=mesh["dp"])
        if not torch.equal(dp_moe.expert_bias, before + coeff * torch.tensor(signs)):
            problems.append(f"dp x ep: expert bias after the update {dp_moe.expert_bias.tolist()}, expected "
                            f"{(before + coeff * torch.tensor(signs)).tolist()}")
    return problems
