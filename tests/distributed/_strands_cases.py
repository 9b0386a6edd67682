"""Rank bodies of the two-strand tests: a Llama-style block under commfuse's tensor parallelism (sequence
parallel, every collective one of commfuse's fused ops) cut into five stages, run by ``commfuse.strands.run``
and, for reference, as one function with ``loss.backward()`` per micro-batch in turn."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import commfuse.ops as ops
from commfuse import strands
from commfuse.fused.attention import attend

HIDDEN, HEADS, FFN, SEQ, BATCH = 32, 4, 64, 16, 2


def _params(rank: int, n: int) -> dict:
    """This rank's shards of the block's weights, cut from full weights drawn from one seed."""
    g = torch.Generator().manual_seed(7)
    full = {"wqkv": torch.randn(HIDDEN, 3 * HIDDEN, generator=g) / HIDDEN ** 0.5,
            "wo": torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5,
            "w1": torch.randn(HIDDEN, FFN, generator=g) / HIDDEN ** 0.5,
            "w3": torch.randn(HIDDEN, FFN, generator=g) / HIDDEN ** 0.5,
            "w2": torch.randn(FFN, HIDDEN, generator=g) / FFN ** 0.5}
    q, k, v = full["wqkv"].chunk(3, dim=1)
    return {"wqkv": torch.cat([t.chunk(n, dim=1)[rank] for t in (q, k, v)], dim=1),
            "wo": full["wo"].chunk(n, dim=0)[rank], "w1": full["w1"].chunk(n, dim=1)[rank],
            "w3": full["w3"].chunk(n, dim=1)[rank], "w2": full["w2"].chunk(n, dim=0)[rank]}


def _stages(p: dict, algorithm: str, profiled: bool, fail_rank: int | None = None) -> list:
    d = HIDDEN // HEADS

    def qkv(x):
        return ops.all_gather_matmul(x, p["wqkv"], gather_dim=1, algorithm=algorithm), x

    def core(qkv, x):
        b, s = qkv.shape[:2]
        q, k, v = (t.reshape(b, s, -1, d) for t in qkv.chunk(3, dim=-1))
        return attend(q, k, v, causal=True).reshape(b, s, -1), x

    def out(o, x):
        return (x + ops.matmul_reduce_scatter(o, p["wo"], scatter_dim=1, algorithm=algorithm),)

    def up(h):
        a, b = ops.all_gather_matmul(h, [p["w1"], p["w3"]], gather_dim=1, algorithm=algorithm)
        if fail_rank is not None and dist.get_rank() == fail_rank:
            raise ZeroDivisionError(f"injected on rank {fail_rank}")
        return F.silu(a) * b, h

    def down(u, h):
        return h + ops.matmul_reduce_scatter(u, p["w2"], scatter_dim=1, algorithm=algorithm)

    # a made-up profile (seconds) for the searched plan: the core has no transfers, the gathers' are long
    figures = {"gather + QKV": (1.0, 3.0), "attention core": (4.0, 0.0), "out-proj + reduce-scatter": (1.0, 3.0),
               "gather + w1/w3": (2.0, 3.0), "w2 + reduce-scatter": (2.0, 3.0)}
    fns = {"gather + QKV": qkv, "attention core": core, "out-proj + reduce-scatter": out, "gather + w1/w3": up,
           "w2 + reduce-scatter": down}
    return [strands.Stage(name, fn, *(figures[name] if profiled else (None, 0.0))) for name, fn in fns.items()]


def _loss(y, target):
    return (y - target).square().mean()


def _batches(rank: int, n: int, count: int, step: int) -> list:
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(1000 * step + 10 * i)
        x, t = torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(BATCH, SEQ, HIDDEN, generator=g)
        out.append((x.chunk(n, dim=1)[rank].contiguous(), t.chunk(n, dim=1)[rank].contiguous()))
    return out


def _close(what: str, got: torch.Tensor, want: torch.Tensor, problems: list) -> None:
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        problems.append(f"{what}: max |diff| {(got - want).abs().max().item():.3g}")


def strands_match_sequential(rank: int, n: int, plan: str, count: int, algorithm: str) -> list[str]:
    """Three AdamW steps of ``count`` micro-batches: two strands against sequential micro-batches; losses
    and gradients each step, parameters after."""
    torch.set_num_threads(1)
    problems: list[str] = []
    ours = {k: v.clone().requires_grad_() for k, v in _params(rank, n).items()}
    theirs = {k: v.clone().requires_grad_() for k, v in _params(rank, n).items()}
    stages_ours = _stages(ours, algorithm, plan == "searched")
    stages_theirs = _stages(theirs, algorithm, False)
    opt_o, opt_t = torch.optim.AdamW(ours.values(), lr=1e-2), torch.optim.AdamW(theirs.values(), lr=1e-2)
    schedule = strands.order(stages_ours, micro_batches=count, plan=plan)
    if plan != "sequential" and count > 1 and [k for k, _, _ in schedule[: 2 * len(stages_ours)]].count("B") == 0:
        problems.append(f"the order never interleaves a backward with the next forward: {schedule}")
    from commfuse.runtime import loop

    real, fills = loop.run_filler, []

    def counted():  # a stage without transfers run inside another stage's op, while its transfers travel
        fills.append(len(loop.FILLERS))
        real()

    for step in range(3):
        batches = _batches(rank, n, count, step)
        loop.run_filler = counted
        try:
            losses = strands.run(stages_ours, batches, _loss, plan=plan)
        finally:
            loop.run_filler = real
        want = []
        for x, t in batches:  # the reference: the stages as one function, one micro-batch after the other
            h = (x,)
            for stage in stages_theirs:
                h = stage.fn(*h)
                h = h if isinstance(h, tuple) else (h,)
            loss = _loss(h[0], t)
            loss.backward()
            want.append(loss.detach())
        for i, (got, ref) in enumerate(zip(losses, want)):
            _close(f"step {step} micro-batch {i} loss", got, ref, problems)
        for name in ours:
            _close(f"step {step} gradient of {name}", ours[name].grad, theirs[name].grad, problems)
        opt_o.step(), opt_t.step()
        opt_o.zero_grad(), opt_t.zero_grad()
    for name in ours:
        _close(f"parameter {name} after 3 steps", ours[name].detach(), theirs[name].detach(), problems)
    # the searched plan puts the attention core (no transfers) beside a backward stage with transfers, once
    # per pair of micro-batches; without figures nothing is known to be free of transfers, nothing is filled
    want = 3 * (count - 1) if plan == "searched" else 0
    if len(fills) < want or (want == 0 and fills) or loop.FILLERS:
        problems.append(f"{len(fills)} stages filled another's transfers, expected {'at least ' if want else ''}"
                        f"{want}; left over: {loop.FILLERS}")
    return problems


def ranks_disagree_on_the_plan(rank: int, n: int) -> tuple:
    """Rank 1 gives the searched plan, the others alternate: every rank is told, before any stage runs."""
    torch.set_num_threads(1)
    p = {k: v.requires_grad_() for k, v in _params(rank, n).items()}
    try:
        strands.run(_stages(p, "ring", profiled=rank == 1), _batches(rank, n, 2, 0), _loss)
    except Exception as e:  # noqa: BLE001 - reported by name
        return type(e).__name__, str(e)
    return "ok", ""
