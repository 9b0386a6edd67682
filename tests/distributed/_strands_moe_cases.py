"""Rank bodies of the MoE two-strand tests: an MoE block under expert parallelism cut into five stages
(``commfuse.models.moe_stages``: the dispatch and the combine each their own differentiable, overlapped
exchange), run by ``commfuse.strands.run`` against the same stages as one function per micro-batch, and
against ``commfuse.nn.moe.moe_reference`` on one process holding every expert and every rank's tokens."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _strands_cases import _close, against_sequential  # the stages-against-sequential loop, shared

from commfuse import strands
from commfuse.fused import moe as fused_moe
from commfuse.models.moe_stages import MOE_STAGES, REPLICATED, moe_ep_params, moe_ep_stages
from commfuse.nn import moe
from commfuse.runtime import steps

HIDDEN, FFN, HEADS, TOPK, SEQ, BATCH = 32, 32, 4, 2, 16, 2

# a made-up profile (seconds) for the searched plan: only the dispatch and the combine have transfers
FIGURES = {"attention": (2.0, 0.0), "router": (0.5, 0.0), "dispatch + experts": (1.0, 3.0), "combine": (1.0, 3.0),
           "shared experts": (2.0, 0.0)}


def _params(rank: int, n: int) -> dict:
    return {k: v.requires_grad_() for k, v in moe_ep_params(rank, n, hidden=HIDDEN, ffn=FFN, experts=2 * n).items()}


def _loss(y, target):
    return (y - target).square().mean()


def _whole_batch(n: int, i: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's tokens and targets of micro-batch ``i``: rank r's are batch rows r*BATCH .. (r+1)*BATCH."""
    g = torch.Generator().manual_seed(1000 * step + 10 * i)
    return torch.randn(n * BATCH, SEQ, HIDDEN, generator=g), torch.randn(n * BATCH, SEQ, HIDDEN, generator=g)


def _batches(rank: int, n: int, count: int, step: int) -> list:
    return [tuple(t.chunk(n)[rank].clone() for t in _whole_batch(n, i, step)) for i in range(count)]


def _average_replicated(params: dict, n: int) -> None:
    """The replicated weights' gradients averaged over the ranks, as DDP does (the experts' are already)."""
    if n == 1:
        return
    for name in REPLICATED:
        dist.all_reduce(params[name].grad)
        params[name].grad.div_(n)


def _match(rank: int, n: int, plan: str, count: int, algorithm: str) -> list[str]:
    problems: list[str] = []
    ours, theirs = _params(rank, n), _params(rank, n)
    stages_ours = moe_ep_stages(ours, heads=HEADS, topk=TOPK, algorithm=algorithm,
                                figures=FIGURES if plan == "searched" else None)
    stages_theirs = moe_ep_stages(theirs, heads=HEADS, topk=TOPK, algorithm=algorithm)
    if [s.name for s in stages_ours] != list(MOE_STAGES):
        problems.append(f"stages {[s.name for s in stages_ours]}, expected {list(MOE_STAGES)}")
    fills = against_sequential(ours, theirs, stages_ours, stages_theirs, lambda step: _batches(rank, n, count, step),
                               _loss, plan, problems, label=f"{plan} ",
                               after_backward=lambda params: _average_replicated(params, n))
    # searched: attention, router, router, attention (no transfers) each beside a stage with transfers, per pair
    # of micro-batches; without figures nothing is known to be free of transfers, nothing is filled
    expected = 3 * 4 * (count - 1) if plan == "searched" else 0
    if len(fills) != expected or steps.FILLERS:
        problems.append(f"{plan}: {len(fills)} stages filled another's transfers, expected {expected}; "
                        f"left over: {steps.FILLERS}")
    return problems


def strands_match_sequential(rank: int, n: int, plans: list[str], count: int, algorithm: str) -> list[str]:
    """For each plan, three AdamW steps of ``count`` micro-batches: two strands against sequential
    micro-batches; losses and gradients each step, parameters after."""
    torch.set_num_threads(1)
    return [p for plan in plans for p in _match(rank, n, plan, count, algorithm)]


def _reference_block(x: torch.Tensor, w: dict) -> torch.Tensor:
    """The block on one process with every expert: attention by torch's SDPA, the MoE by ``moe_reference``."""
    b, s, _ = x.shape
    q, k, v = ((x @ w["wqkv"]).chunk(3, dim=-1))
    q, k, v = (t.reshape(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, HIDDEN)
    h = x + o @ w["wo"]
    return h + moe.moe_reference(h, w["router"], w["w13"], w["w2"], TOPK, shared_w13=w["shared_w13"],
                                 shared_w2=w["shared_w2"])


def against_reference(rank: int, n: int, algorithm: str, plan: str) -> list[str]:
    """Two micro-batches through the stages as two strands against ``moe_reference`` on one process: outputs,
    losses, input gradients and every weight gradient (the replicated ones averaged over the ranks); the
    problems found. ``n`` 1: a single process without torch.distributed."""
    problems: list[str] = []
    count = 2
    ours = _params(rank, n)
    stages = moe_ep_stages(ours, heads=HEADS, topk=TOPK, algorithm=algorithm,
                           figures=FIGURES if plan == "searched" else None)
    batches = [(x.requires_grad_(), t) for x, t in _batches(rank, n, count, 0)]
    outputs = []

    def loss_fn(y, t):
        outputs.append(y.detach())
        return _loss(y, t)

    losses = strands.run(stages, batches, loss_fn, plan=plan)
    _average_replicated(ours, n)
    # one process: every expert, every rank's tokens; the loss the mean of the ranks' (each its tokens' mean)
    whole = {k: v.requires_grad_() for k, v in moe_ep_params(0, 1, hidden=HIDDEN, ffn=FFN, experts=2 * n).items()}
    local = 2  # experts per rank
    for i in range(count):
        x, t = _whole_batch(n, i, 0)
        x.requires_grad_()
        y = _reference_block(x, whole)
        _close(f"micro-batch {i}: output", outputs[i], y.detach().chunk(n)[rank], problems)
        _close(f"micro-batch {i}: loss", losses[i], _loss(y.chunk(n)[rank], t.chunk(n)[rank]).detach(), problems)
        _loss(y, t).backward()
        # this rank's loss is 1/n of the mean's: its input gradient n times the mean's
        _close(f"micro-batch {i}: input gradient", batches[i][0].grad, n * x.grad.chunk(n)[rank], problems)
    for name in REPLICATED:
        _close(f"gradient of {name}", ours[name].grad, whole[name].grad, problems)
    for name in ("w13", "w2"):
        _close(f"gradient of {name}", ours[name].grad, whole[name].grad[rank * local:(rank + 1) * local], problems)
    return problems


def matches_reference(rank: int, n: int, algorithm: str, plan: str) -> list[str]:
    """:func:`against_reference` on a rank of one thread."""
    torch.set_num_threads(1)
    return against_reference(rank, n, algorithm, plan)


def wrong_dispatch_backward_is_caught(rank: int, n: int, mutant: str) -> list[str]:
    """The reference comparison with the dispatch half's backward made wrong on purpose: ``dgrad`` (its input
    gradient 1% too large) or ``wgrad`` (``w13``'s gradient not divided by the world size): its problems."""
    torch.set_num_threads(1)
    real = fused_moe._DispatchExperts.backward

    def wrong(ctx, dacts, dcounts):
        dxs, dw13, *rest = real(ctx, dacts, dcounts)
        if mutant == "dgrad":
            return (dxs * 1.01, dw13, *rest)
        return (dxs, dw13 * n, *rest)

    fused_moe._DispatchExperts.backward = staticmethod(wrong)
    try:
        return against_reference(rank, n, "ring", "alternate")
    finally:
        fused_moe._DispatchExperts.backward = staticmethod(real)


def forward_only_matches_sequential(rank: int, n: int, plan: str, count: int, algorithm: str) -> list[str]:
    """The MoE block's forwards as two strands (``strands.forward``) give every micro-batch's sequential
    output; the searched plan runs stages without transfers inside the dispatch's and combine's waits."""
    from _strands_cases import forwards_against_sequential

    torch.set_num_threads(1)
    problems: list[str] = []
    stages = moe_ep_stages(_params(rank, n), heads=HEADS, topk=TOPK, algorithm=algorithm,
                           figures=FIGURES if plan == "searched" else None)
    taken = forwards_against_sequential(stages, [x for x, _ in _batches(rank, n, count, 0)], plan, problems)
    if plan == "searched" and taken < 2 * (count // 2):
        problems.append(f"the searched plan ran {taken} stages inside waits over {count // 2} pairs")
    return problems


def one_rank_fails(rank: int, n: int, stage: str, plan: str) -> dict:
    """The forward of ``stage`` raises on rank 1 only, after it ran, in the second run (every call's signature
    checked in the first): every rank raises, naming rank 1; then the group is usable (rank 1
    served the call its peers waited in, the dispatch's or the combine's exchange, whose messages skip the
    empty ones), and three steps of two strands give sequential micro-batches' results (``"after"``)."""
    import time

    torch.set_num_threads(1)
    p = _params(rank, n)
    stages = moe_ep_stages(p, heads=HEADS, topk=TOPK, algorithm="ring", figures=FIGURES if plan == "searched" else None)
    if rank == 1:
        k = [s.name for s in stages].index(stage)
        calls = [0]

        def failing(*args, _fn=stages[k].fn):
            out = _fn(*args)
            calls[0] += 1
            if calls[0] == 3:  # the second run's first micro-batch: every call's signature checked before
                raise ZeroDivisionError(f"injected on rank 1 in the forward of {stage!r}")
            return out
        stages[k] = strands.Stage(stages[k].name, failing, stages[k].compute, stages[k].comm)
    out = {}
    strands.run(stages, _batches(rank, n, 2, 0), _loss, plan=plan)  # every call checked: the peers' next is
    t0 = time.perf_counter()                                           # in its data steps, empty messages skipped
    try:
        strands.run(stages, _batches(rank, n, 2, 1), _loss, plan=plan)
        out["outcome"] = ("ok", "", 0.0)
    except Exception as e:  # noqa: BLE001 - reported by name
        out["outcome"] = (type(e).__name__, str(e), time.perf_counter() - t0)
    t0 = time.perf_counter()
    problems: list[str] = []
    try:
        for t in p.values():
            t.grad = None
        theirs = {k: v.detach().clone().requires_grad_() for k, v in p.items()}
        fresh = moe_ep_stages(p, heads=HEADS, topk=TOPK, algorithm="ring",
                              figures=FIGURES if plan == "searched" else None)
        against_sequential(p, theirs, fresh, moe_ep_stages(theirs, heads=HEADS, topk=TOPK, algorithm="ring"),
                           lambda step: _batches(rank, n, 2, 10 + step), _loss, plan, problems,
                           label="after the failure: ", after_backward=lambda params: _average_replicated(params, n))
        out["after"] = ("ok" if not problems else "wrong", "; ".join(problems[:6]), time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - reported by name
        out["after"] = (type(e).__name__, str(e), time.perf_counter() - t0)
    return out
