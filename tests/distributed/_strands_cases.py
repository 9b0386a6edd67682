"""Rank bodies of the two-strand tests: a Llama-style block under commfuse's tensor parallelism (sequence
parallel, every collective one of commfuse's fused ops) cut into five stages, run by ``commfuse.strands.run``
and, for reference, as one function with ``loss.backward()`` per micro-batch in turn."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commfuse import strands
from commfuse.models.stages import llama_tp_params, llama_tp_stages

HIDDEN, HEADS, FFN, SEQ, BATCH = 32, 4, 64, 16, 2


def _params(rank: int, n: int) -> dict:
    """This rank's shards of the block's weights, cut from full weights drawn from one seed."""
    return llama_tp_params(rank, n, hidden=HIDDEN, ffn=FFN)


# a made-up profile (seconds) for the searched plan: the core has no transfers, the gathers' are long
FIGURES = {"gather + QKV": (1.0, 3.0), "attention core": (4.0, 0.0), "out-proj + reduce-scatter": (1.0, 3.0),
           "gather + w1/w3": (2.0, 3.0), "w2 + reduce-scatter": (2.0, 3.0)}


def _stages(p: dict, algorithm: str, profiled: bool, fail: tuple | None = None) -> list:
    """The block's stages; ``fail`` = (rank, stage name, kind): that rank's stage raises ``ZeroDivisionError``
    after its ops, in its forward (``"F"``), its backward (``"B"``), or as work handed to a wait (``"W"``:
    the stage's first deferred weight gradient)."""
    stages = llama_tp_stages(p, heads=HEADS, algorithm=algorithm, figures=FIGURES if profiled else None)
    if fail is None or dist.get_rank() != fail[0]:
        return stages
    rank, name, kind = fail
    out = []
    for s in stages:
        if s.name == name and kind == "F":
            def fn(*args, _fn=s.fn):
                _fn(*args)
                raise ZeroDivisionError(f"injected on rank {rank} in the forward of {name!r}")
            s = strands.Stage(s.name, fn, s.compute, s.comm)
        elif s.name == name and kind == "B":
            s = strands.Stage(s.name, _raising_backward(s.fn, f"injected on rank {rank} in the backward of "
                                                        f"{name!r}"), s.compute, s.comm)
        out.append(s)
    return out


def _raising_backward(fn, message: str):
    """``fn`` whose outputs' backward raises ``ZeroDivisionError(message)`` before reaching ``fn``'s graph."""

    class Raise(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            raise ZeroDivisionError(message)

    def wrapped(*args):
        out = fn(*args)
        out = out if isinstance(out, tuple) else (out,)
        return tuple(Raise.apply(t) if t.requires_grad else t for t in out)

    return wrapped


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
    if got is None or want is None or got.shape != want.shape:
        problems.append(f"{what}: got {None if got is None else list(got.shape)}, "
                        f"want {None if want is None else list(want.shape)}")
    elif not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        problems.append(f"{what}: max |diff| {(got - want).abs().max().item():.3g}")


def against_sequential(ours: dict, theirs: dict, stages_ours: list, stages_theirs: list, batches_of, loss_fn,
                       plan: str, problems: list, *, label: str = "", after_backward=None) -> list[int]:
    """Three AdamW steps on ``ours`` through ``strands.run(stages_ours, ...)`` and on ``theirs`` through
    ``stages_theirs`` as one function, ``loss.backward()`` per micro-batch in turn (``batches_of(step)``
    gives a step's micro-batches); losses and gradients compared each step, parameters after, into
    ``problems``. ``after_backward(params)`` runs on both before each optimizer step. Returns, for each wait
    that was handed work, how many pieces it ran."""
    from commfuse.runtime import steps

    opt_o, opt_t = torch.optim.AdamW(ours.values(), lr=1e-2), torch.optim.AdamW(theirs.values(), lr=1e-2)
    real, fills = steps.run_filler, []

    def counted(handle=None):  # work without transfers run inside another stage's op, while its transfers travel
        before = len(steps.FILLERS)
        real(handle)
        fills.append(before - len(steps.FILLERS))

    for step in range(3):
        batches = batches_of(step)
        steps.run_filler = counted
        try:
            losses = strands.run(stages_ours, batches, loss_fn, plan=plan)
        finally:
            steps.run_filler = real
        want = []
        for x, t in batches:  # the reference: the stages as one function, one micro-batch after the other
            h = (x,)
            for stage in stages_theirs:
                h = stage.fn(*h)
                h = h if isinstance(h, tuple) else (h,)
            loss = loss_fn(h[0], t)
            loss.backward()
            want.append(loss.detach())
        for i, (got, ref) in enumerate(zip(losses, want)):
            _close(f"{label}step {step} micro-batch {i} loss", got, ref, problems)
        for name in ours:
            _close(f"{label}step {step} gradient of {name}", ours[name].grad, theirs[name].grad, problems)
        if after_backward is not None:
            after_backward(ours), after_backward(theirs)
        opt_o.step(), opt_t.step()
        opt_o.zero_grad(), opt_t.zero_grad()
    for name in ours:
        _close(f"{label}parameter {name} after 3 steps", ours[name].detach(), theirs[name].detach(), problems)
    return fills


def strands_match_sequential(rank: int, n: int, plan: str, count: int, algorithm: str) -> list[str]:
    """Three AdamW steps of ``count`` micro-batches: two strands against sequential micro-batches; losses
    and gradients each step, parameters after."""
    torch.set_num_threads(1)
    problems: list[str] = []
    ours = {k: v.clone().requires_grad_() for k, v in _params(rank, n).items()}
    theirs = {k: v.clone().requires_grad_() for k, v in _params(rank, n).items()}
    stages_ours = _stages(ours, algorithm, plan == "searched")
    stages_theirs = _stages(theirs, algorithm, False)
    schedule = strands.order(stages_ours, micro_batches=count, plan=plan)
    if plan != "sequential" and count > 1 and [k for k, _, _ in schedule[: 2 * len(stages_ours)]].count("B") == 0:
        problems.append(f"the order never interleaves a backward with the next forward: {schedule}")
    from commfuse.runtime import steps

    fills = against_sequential(ours, theirs, stages_ours, stages_theirs, lambda step: _batches(rank, n, count, step),
                               _loss, plan, problems)
    # two strands hand each deferred weight gradient to a later wait (4 GEMMs' worth per backward, 5 weights),
    # and the searched plan the attention core (no transfers) beside a backward stage with transfers, once per
    # pair of micro-batches; the sequential plan defers nothing and hands nothing
    taken = sum(fills)
    if plan == "sequential" and taken:
        problems.append(f"the sequential plan ran {taken} pieces of work inside waits")
    if plan != "sequential" and taken < 3 * (count - 1) + 3:
        problems.append(f"only {taken} pieces of work ran inside waits over 3 steps of {count} micro-batches")
    if steps.FILLERS:
        problems.append(f"work left over for later ops: {steps.FILLERS}")
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


def a_step_refused_on_one_rank(rank: int, n: int) -> dict:
    """A training loop that catches commfuse's errors and skips the step: at step 0 rank 1 hands ``run`` an
    empty list of micro-batches, which it refuses before any stage runs. Every rank must raise at step 0
    (rank 1 its own refusal, the others naming rank 1), and the next step must pair with the next step on every
    rank: its losses and gradients those of sequential micro-batches (before, the peers' order check paired
    with rank 1's next step, and every later step's gradients were another step's)."""
    torch.set_num_threads(1)
    from commfuse.errors import CommfuseError

    problems: list[str] = []
    ours = {k: v.clone().requires_grad_() for k, v in _params(rank, n).items()}
    theirs = {k: v.clone().requires_grad_() for k, v in _params(rank, n).items()}
    stages_ours, stages_theirs = _stages(ours, "ring", False), _stages(theirs, "ring", False)
    try:
        strands.run(stages_ours, [] if rank == 1 else _batches(rank, n, 2, 0), _loss, plan="alternate")
        first = ("ok", "")
    except CommfuseError as e:
        first = (type(e).__name__, str(e))
    for p in ours.values():
        p.grad = None
    against_sequential(ours, theirs, stages_ours, stages_theirs, lambda step: _batches(rank, n, 2, step + 1), _loss,
                       "alternate", problems)
    return {"first": first, "problems": problems}


def one_rank_fails(rank: int, n: int, where: tuple, plan: str) -> dict:
    """``where`` = (stage name, kind) raises on rank 1 only (kind ``"F"`` after the stage's forward ops,
    ``"B"`` before its backward ops, ``"W"`` in the first deferred weight gradient): every rank must raise,
    promptly, naming rank 1. Then the group must still be usable (rank 1 completed the transfers its peers
    had posted in the call they waited in): a plain all-reduce on it sums, and three more steps of two
    strands give sequential micro-batches' losses, gradients and parameters (``"after"``)."""
    import time

    from commfuse.fused import matmul as fused_matmul  # where a deferred weight gradient is added

    torch.set_num_threads(1)
    name, kind = where
    p = {k: v.clone().requires_grad_() for k, v in _params(rank, n).items()}
    batches = _batches(rank, n, 2, 0)
    real = fused_matmul._add_grad
    if kind == "W" and rank == 1:
        def raising(weight, x, dy):
            fused_matmul._add_grad = real
            raise ZeroDivisionError("injected on rank 1 in a deferred weight gradient")
        fused_matmul._add_grad = raising
    stages = _stages(p, "ring", plan == "searched", fail=None if kind == "W" else (1, name, kind))
    out = {}
    t0 = time.perf_counter()
    try:
        strands.run(stages, batches, _loss, plan=plan)
        out["outcome"] = ("ok", "", 0.0)
    except Exception as e:  # noqa: BLE001 - reported by name
        out["outcome"] = (type(e).__name__, str(e), time.perf_counter() - t0)
    finally:
        fused_matmul._add_grad = real
    out["after"] = _after(rank, n, p, plan, all_reduce_first=True)
    return out


def told_and_after(results: list, usable: bool = True) -> list[str]:
    """What is wrong with the ranks' ``one_rank_fails`` outcomes: rank 1 must raise its own error, every other
    rank a ``PeerFailedError`` naming rank 1 and its error, all within 30 s; then, where the call could be
    drained (``usable``), the group must run on correctly, else every rank must be refused by name."""
    problems = []
    for rank, res in enumerate(results):
        kind, message, seconds = res["outcome"]
        if rank == 1 and kind != "ZeroDivisionError":
            problems.append(f"rank 1 raised {kind}, want its own ZeroDivisionError: {message[:300]}")
        if rank != 1 and not (kind == "PeerFailedError" and "rank 1" in message and "injected on rank 1" in message
                              and ("drained" in message) == usable):
            problems.append(f"rank {rank} raised {kind}, want PeerFailedError naming rank 1 (drained: {usable}): "
                            f"{message[:300]}")
        if seconds >= 30:
            problems.append(f"rank {rank} took {seconds:.1f} s to stop")
        kind, message, _ = res["after"]
        if usable and kind != "ok":
            problems.append(f"rank {rank} after the failure: {kind}: {message[:300]}")
        if not usable and (kind == "ok" or "declared dead" not in message):
            problems.append(f"rank {rank} after the failure: {kind}, want it refused (declared dead): {message[:300]}")
    return problems


def forwards_against_sequential(stages: list, inputs: list, plan: str, problems: list, *, label: str = "") -> int:
    """``strands.forward(stages, inputs)`` under ``torch.no_grad()`` against the stages as one function, one
    micro-batch after the other: every micro-batch's output equal, none missing; returns how many stages ran
    inside another's wait."""
    from commfuse.runtime import steps

    real, fills = steps.run_filler, []

    def counted(handle=None):
        before = len(steps.FILLERS)
        real(handle)
        fills.append(before - len(steps.FILLERS))

    with torch.no_grad():
        steps.run_filler = counted
        try:
            got = strands.forward(stages, inputs, plan=plan)
        finally:
            steps.run_filler = real
        for i, x in enumerate(inputs):
            h = (x,)
            for stage in stages:
                h = stage.fn(*h)
                h = h if isinstance(h, tuple) else (h,)
            want = h[0] if len(h) == 1 else h
            mine = got[i] if i < len(got) else None
            if isinstance(want, tuple):
                if not isinstance(mine, tuple) or len(mine) != len(want):
                    problems.append(f"{label}micro-batch {i}: got {type(mine).__name__}, want {len(want)} outputs")
                    continue
                for j, (a, b) in enumerate(zip(mine, want)):
                    _close(f"{label}micro-batch {i} output {j}", a, b, problems)
            else:
                _close(f"{label}micro-batch {i} output", mine if isinstance(mine, torch.Tensor) else None, want,
                       problems)
    if len(got) != len(inputs):
        problems.append(f"{label}{len(got)} outputs for {len(inputs)} micro-batches")
    if steps.FILLERS:
        problems.append(f"{label}work left over for later ops: {steps.FILLERS}")
    return sum(fills)


def forward_only_matches_sequential(rank: int, n: int, plan: str, count: int, algorithm: str) -> list[str]:
    """Two forwards beside each other (``strands.forward``) give every micro-batch's sequential output; the
    searched plan runs the attention core (no transfers) inside a gather's or a reduce-scatter's wait."""
    torch.set_num_threads(1)
    problems: list[str] = []
    p = _params(rank, n)
    stages = _stages(p, algorithm, plan == "searched")
    taken = forwards_against_sequential(stages, [x for x, _ in _batches(rank, n, count, 0)], plan, problems)
    if plan == "searched" and taken < 2 * (count // 2):
        problems.append(f"the searched plan ran {taken} stages inside waits over {count // 2} pairs, expected 2 "
                        "per pair (each micro-batch's attention core)")
    if plan == "sequential" and taken:
        problems.append(f"the sequential plan ran {taken} stages inside waits")
    return problems


def one_rank_fails_forward_only(rank: int, n: int) -> tuple:
    """The attention core raises on rank 1 in ``strands.forward`` (the searched plan runs it inside the other
    micro-batch's gather): every rank must raise, promptly, naming rank 1."""
    import time

    torch.set_num_threads(1)
    stages = _stages(_params(rank, n), "ring", True, fail=(1, "attention core", "F"))
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            strands.forward(stages, [x for x, _ in _batches(rank, n, 2, 0)], plan="searched")
    except Exception as e:  # noqa: BLE001 - reported by name
        return type(e).__name__, str(e), time.perf_counter() - t0
    return "ok", "", time.perf_counter() - t0


# -- one rank that misbehaves in its own code: every rank told by name, the group usable or dead on all -----------


def _misbehaving(stages: list, how: str, rank: int) -> tuple[list, object]:
    """``stages`` and a loss function as rank ``rank`` runs them for ``how``: ``"before-op:<stage>:<call>"``
    (the stage's ``call``-th forward, counted from 0, raises ``ZeroDivisionError`` before its op),
    ``"detached-loss"`` (micro-batch 1's loss comes back detached), ``"non-scalar-loss"`` (micro-batch 1's loss
    is a vector) or ``"none"``."""
    if how.startswith("before-op:"):
        _, name, call = how.split(":")
        return _raising(stages, name, int(call), rank, keep_figures=True), _loss
    calls = [0]

    def loss(y, target):
        calls[0] += 1
        value = _loss(y, target)
        if calls[0] == 2 and how == "detached-loss":
            return value.detach()
        if calls[0] == 2 and how == "non-scalar-loss":
            return (y - target).square().mean(dim=(0, 2))
        return value
    return stages, loss


def one_rank_misbehaves(rank: int, n: int, how: str, plan: str) -> dict:
    """Rank 1 misbehaves as ``how`` says (:func:`_misbehaving`) in ``strands.run``; every rank reports what it
    raised and after how long (``"outcome"``), then runs three more steps of two strands against sequential
    micro-batches (``"after"``: ``"ok"``, ``"wrong"`` or the error it raised)."""
    import time

    torch.set_num_threads(1)
    p = {k: v.clone().requires_grad_() for k, v in _params(rank, n).items()}
    stages, loss = _stages(p, "ring", plan == "searched"), _loss
    if rank == 1:
        stages, loss = _misbehaving(stages, how, rank)
    out = {}
    t0 = time.perf_counter()
    try:
        strands.run(stages, _batches(rank, n, 2, 0), loss, plan=plan)
        out["outcome"] = ("ok", "", time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - reported by name
        out["outcome"] = (type(e).__name__, str(e), time.perf_counter() - t0)
    out["after"] = _after(rank, n, p, plan)
    return out


def _after(rank: int, n: int, p: dict, plan: str, all_reduce_first: bool = False) -> tuple:
    """Three steps of two strands on ``p`` against sequential micro-batches (after a plain ``dist.all_reduce``
    checked, if ``all_reduce_first``): ``("ok" | "wrong", problems, seconds)`` or the error raised."""
    import time

    t0 = time.perf_counter()
    problems: list[str] = []
    try:
        if all_reduce_first:
            total = torch.tensor([float(rank + 1)])
            dist.all_reduce(total)
            if total.item() != n * (n + 1) / 2:
                problems.append(f"all_reduce after the failure gave {total.item()}, want {n * (n + 1) / 2}")
        for t in p.values():
            t.grad = None
        theirs = {k: v.detach().clone().requires_grad_() for k, v in p.items()}
        against_sequential(p, theirs, _stages(p, "ring", plan == "searched"), _stages(theirs, "ring", False),
                           lambda step: _batches(rank, n, 2, 10 + step), _loss, plan, problems,
                           label="after the failure: ")
        return ("ok" if not problems else "wrong", "; ".join(problems[:6]), time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - reported by name
        return (type(e).__name__, str(e), time.perf_counter() - t0)


def _failing_profile(stages: list, how: str, rank: int) -> list:
    """``stages`` as rank ``rank`` profiles them for ``how``: ``"raise:<stage>:<call>"`` (the stage's
    ``call``-th run, counted from 0 over the warm-up and the timed runs, raises before its op)."""
    _, name, call = how.split(":")
    return _raising(stages, name, int(call), rank, keep_figures=False)


def _raising(stages: list, name: str, call: int, rank: int, keep_figures: bool) -> list:
    """``stages`` with stage ``name``'s ``call``-th run (counted from 0) raising ``ZeroDivisionError`` before
    its op; the stages keep their compute and comm figures if ``keep_figures``, else take the defaults."""
    seen = [0]
    out = []
    for s in stages:
        if s.name == name:
            def fn(*args, _fn=s.fn):
                seen[0] += 1
                if seen[0] == call + 1:
                    raise ZeroDivisionError(f"injected on rank {rank} before the op of {name!r}")
                return _fn(*args)
            s = strands.Stage(s.name, fn, s.compute, s.comm) if keep_figures else strands.Stage(s.name, fn)
        out.append(s)
    return out


def one_rank_fails_in_profile(rank: int, n: int, how: str) -> dict:
    """Rank 1 fails in ``strands.profile``: ``"repeats"`` (it passes ``repeats=0``, refused before any timed
    run) or ``"raise:<stage>:<call>"`` (:func:`_failing_profile`). Every rank reports what it raised and after
    how long, then runs three steps of two strands against sequential micro-batches (``"after"``)."""
    import time

    torch.set_num_threads(1)
    p = {k: v.clone().requires_grad_() for k, v in _params(rank, n).items()}
    stages = _stages(p, "ring", False)
    if rank == 1 and how.startswith("raise:"):
        stages = _failing_profile(stages, how, rank)
    out = {}
    t0 = time.perf_counter()
    try:
        strands.profile(stages, _batches(rank, n, 1, 0)[0][0], repeats=0 if rank == 1 and how == "repeats" else 2)
        out["outcome"] = ("ok", "", time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - reported by name
        out["outcome"] = (type(e).__name__, str(e), time.perf_counter() - t0)
    out["after"] = _after(rank, n, p, "alternate")
    return out


def profile_measures_the_transfers(rank: int, n: int) -> dict:
    """``strands.profile`` of the block where the code around the first stage's op takes longer in the
    outside-only runs than in the comm-only ones (as noise can make it: comm-only less outside-only <= 0):
    its ``comm`` must still be above 0, and ``run`` with the profiled figures (the searched plan) must give
    sequential micro-batches' losses and gradients (a stage given comm 0 that calls an op is handed to another
    op's wait, and its op is refused)."""
    import time

    from commfuse.runtime.observe import measuring

    torch.set_num_threads(1)
    p = {k: v.clone().requires_grad_() for k, v in _params(rank, n).items()}
    stages = []
    for s in _stages(p, "ring", False):
        if s.name == "gather + QKV":
            def fn(*args, _fn=s.fn):
                if measuring() == "outside_only":
                    time.sleep(0.05)
                return _fn(*args)
            s = strands.Stage(s.name, fn)
        stages.append(s)
    profiled = strands.profile(stages, _batches(rank, n, 1, 0)[0][0], repeats=2)
    figures = {s.name: (s.compute, s.comm) for s in profiled}
    return {"figures": figures, "after": _after_with(rank, n, p, profiled)}


def _after_with(rank: int, n: int, p: dict, stages: list) -> tuple:
    """Three steps of ``stages`` (figures given: the searched plan) against sequential micro-batches."""
    problems: list[str] = []
    try:
        theirs = {k: v.detach().clone().requires_grad_() for k, v in p.items()}
        against_sequential(p, theirs, stages, _stages(theirs, "ring", False),
                           lambda step: _batches(rank, n, 2, 20 + step), _loss, "searched", problems)
        return ("ok" if not problems else "wrong", "; ".join(problems[:6]))
    except Exception as e:  # noqa: BLE001 - reported by name
        return (type(e).__name__, str(e))
