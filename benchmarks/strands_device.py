"""Two strands (``commfuse.strands``) checked on a device, for one device run; runnable on any backend.

Tier: device check (prints a PASS/FAIL line per check with its figures; exits non-zero where a correctness
check failed on this rank). Two ranks under torchrun. On CPU the ranks use gloo and CPU tensors; with CUDA
(``torch.cuda.is_available()``, or ``--device cuda``) NCCL and CUDA tensors, TF32 off. Two NCCL ranks may
share one GPU when each has its own ``NCCL_HOSTID`` (``hostid.sh``: a per-rank wrapper that sets one from
``LOCAL_RANK`` and keeps NCCL on sockets over loopback)::

    torchrun --standalone --nproc-per-node 2 benchmarks/strands_device.py                        # CPU, gloo
    torchrun --standalone --nproc-per-node 2 --no-python bash hostid.sh python3 benchmarks/strands_device.py

The checks, in the order they run (the failure check last: it leaves the group dead):

1. ``llama fp32 <plan>``: the Llama TP block (``commfuse.models.stages.llama_tp_stages``) through
   ``strands.run`` with plans ``alternate`` and ``searched`` (made-up stage figures under which the search
   hands the attention core to a wait) against the same stages run one micro-batch after the other:
   losses and every gradient each step within rtol 1e-4 and atol 1e-5, the parameters after ``--steps``
   AdamW steps (lr 1e-2) within rtol 1e-4 and atol 1e-4. AdamW divides each gradient element by its own
   magnitude, so an element that nearly cancels turns a rounding difference into a larger step difference
   (8e-6 seen on CPU with gradients within 6e-8). The work run inside the ops' waits (deferred weight
   gradients, the attention core) is counted per wait: a stream-ordered backend never polls, so each wait
   takes one piece.
2. ``llama bf16 <plan>``: one step of the same under ``torch.autocast`` to bfloat16, losses and gradients
   within rtol 2e-2 and an atol of 2e-2 times the reference's largest magnitude (a near-zero entry is held
   to its tensor's scale, not to itself). bfloat16 keeps 8 significant bits, a relative rounding step of
   2^-8 (3.9e-3); 2e-2 is about five such steps, room for the two runs adding partial results in another
   order. Under autocast the ops cast the weights, and a cast weight (not a leaf) has its gradient computed
   in the ring, never deferred: only the searched plan's attention core runs inside a wait.
3. ``moe fp32 <plan>``: the MoE EP block (``commfuse.models.moe_stages.moe_ep_stages``), as 1 (the
   replicated weights' gradients averaged over the ranks, as DDP does, before each step).
4. ``llama forward <plan>``: ``strands.forward`` against the stages' forwards one micro-batch after the other.
5. ``timing`` (informational, never failed): median ms per ``strands.run`` of plans sequential, alternate
   and searched, each started together behind a barrier, the device drained before and after; and the host's
   share of it (the Python call returning, before the drain) against the drain. Two ranks on one GPU
   time-slice it: these are not overlap figures.
6. ``device backend alone``: one step of 1 on a group made with the device's own backend alone
   (``new_group(backend="nccl")`` on CUDA: the kind ``init_process_group("nccl")`` and ``commfuse bench``
   make). The world group of the other checks is ``cpu:gloo,cuda:nccl`` on CUDA (what
   ``init_process_group()`` gives there; ``--pg-backend`` changes it): it takes CPU tensors too, as
   ``strands.run``'s check that the ranks hold one order (an all-gather of CPU tensors) needs.
7. ``one rank fails``: the attention core's forward raises on rank 1 from its second call on (micro-batch 1,
   which the searched plan runs inside a wait of micro-batch 0's backward); every rank must stop within
   30 s naming rank 1 (rank 1 its own ZeroDivisionError; a peer PeerFailedError or GroupDeadError, or
   commfuse's watchdog ending it with an error naming rank 1), and a second ``strands.run`` must be refused
   at once (the group declared dead). Runs last.

A check that raises prints its traceback and the next check runs. Each check has a hard timeout
(``--check-timeout``): past it the rank prints the check's FAIL line, the summary and its stacks, and exits 124.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import os
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from commfuse import strands
from commfuse.models.moe_stages import REPLICATED, moe_ep_params, moe_ep_stages
from commfuse.models.stages import llama_tp_params, llama_tp_stages
from commfuse.runtime import steps as runtime_steps

# made-up forward figures (compute, comm) in seconds for the searched plan: the stages without transfers
# (attention core; MoE's attention, router and shared experts) are long enough to be handed to a wait
LLAMA_FIGURES = {"gather + QKV": (1.0, 3.0), "attention core": (4.0, 0.0), "out-proj + reduce-scatter": (1.0, 3.0),
                 "gather + w1/w3": (2.0, 3.0), "w2 + reduce-scatter": (2.0, 3.0)}
MOE_FIGURES = {"attention": (2.0, 0.0), "router": (0.5, 0.0), "dispatch + experts": (1.0, 3.0), "combine": (1.0, 3.0),
               "shared experts": (2.0, 0.0)}

FP32 = ("fp32", 1e-4, 1e-5, False)  # (name, rtol, atol, atol relative to the reference's largest magnitude)
BF16 = ("bf16", 2e-2, 2e-2, True)
# parameters after AdamW: a gradient element that nearly cancels turns a rounding difference into a visible
# difference of its step (AdamW divides by the element's own magnitude), so they are held to 1% of the
# learning rate (1e-2) absolute
AFTER_ADAMW = ("fp32 after AdamW", 1e-4, 1e-4, False)


@dataclass
class Shapes:
    hidden: int
    heads: int
    ffn: int
    seq: int  # Llama: the whole sequence, sharded along dim 1; MoE: each rank's own
    batch: int  # Llama: every rank's; MoE: each rank's own rows
    moe_hidden: int
    moe_ffn: int
    experts_per_rank: int = 2
    topk: int = 2


FULL = Shapes(hidden=256, heads=4, ffn=1024, seq=256, batch=2, moe_hidden=256, moe_ffn=512)
SMALL = Shapes(hidden=64, heads=4, ffn=128, seq=32, batch=2, moe_hidden=32, moe_ffn=32)


@dataclass
class Context:
    rank: int
    n: int
    dev: torch.device
    shapes: Shapes
    args: argparse.Namespace
    results: list = field(default_factory=list)  # (label, verdict: True/False/None for informational, figures)

    def sync(self) -> None:
        if self.dev.type != "cpu":
            torch.accelerator.synchronize(self.dev)


# -- output ---------------------------------------------------------------------------------------------------

def _say(ctx: Context, text: str) -> None:
    prefix = f"[rank {ctx.rank}] "
    sys.stdout.write(prefix + text.replace("\n", "\n" + prefix) + "\n")  # one write: ranks share the terminal
    sys.stdout.flush()


def _summary(ctx: Context) -> None:
    failed = [label for label, ok, _ in ctx.results if ok is False]
    passed = sum(1 for _, ok, _ in ctx.results if ok)
    _say(ctx, f"SUMMARY: {passed} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))


class _Deadline:
    """A hard timeout for one check: past ``seconds`` the rank prints the check's FAIL line, the summary and
    its stacks, and exits 124 (a thread does it, so a host blocked in a C++ call is ended too); faulthandler
    ends it 15 s later should that thread not get to run."""

    def __init__(self, ctx: Context, label: str, seconds: float) -> None:
        self.ctx, self.label, self.seconds = ctx, label, seconds

    def _expire(self) -> None:
        ctx = self.ctx
        ctx.results.append((self.label, False, "hard timeout"))
        _say(ctx, f"FAIL {self.label}: no result after {self.seconds:g} s (hard timeout); stacks follow, exit 124")
        _summary(ctx)
        faulthandler.dump_traceback(all_threads=True)
        sys.stdout.flush()
        os._exit(124)

    def __enter__(self) -> None:
        self.timer = threading.Timer(self.seconds, self._expire)
        self.timer.daemon = True
        self.timer.start()
        faulthandler.dump_traceback_later(self.seconds + 15, exit=True)

    def __exit__(self, *exc) -> None:
        self.timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def _check(ctx: Context, label: str, body, *args, informational: bool = False) -> None:
    """Run ``body(ctx, *args) -> (problems, figures)`` under the hard timeout; print its PASS/FAIL line (INFO for
    an informational check), or its traceback where it raised."""
    t0 = time.perf_counter()
    with _Deadline(ctx, label, ctx.args.check_timeout):
        try:
            problems, figures = body(ctx, *args)
        except Exception as e:  # noqa: BLE001 - printed, and the next check runs
            took = time.perf_counter() - t0
            ctx.results.append((label, None if informational else False, f"raised {type(e).__name__}"))
            _say(ctx, f"{'INFO' if informational else 'FAIL'} {label}: raised {type(e).__name__} after {took:.1f} s: "
                      f"{e}\n{traceback.format_exc().rstrip()}")
            return
    took = time.perf_counter() - t0
    ok = None if informational else not problems
    ctx.results.append((label, ok, figures))
    verdict = "INFO" if informational else ("PASS" if ok else "FAIL")
    _say(ctx, f"{verdict} {label} ({took:.1f} s): {figures}")
    for p in problems[:12]:
        _say(ctx, f"    {p}")
    if len(problems) > 12:
        _say(ctx, f"    ... {len(problems) - 12} more")


# -- comparing ------------------------------------------------------------------------------------------------

class _Worst:
    """The largest difference seen per kind of value (loss, gradient, parameter, output), and the problems."""

    def __init__(self, tol: tuple) -> None:
        self.tol = tol
        self.diff: dict[str, float] = {}
        self.problems: list[str] = []

    def close(self, kind: str, what: str, got, want, tol: tuple | None = None) -> None:
        name, rtol, atol, scaled = tol or self.tol
        if got is None or want is None or got.shape != want.shape:
            self.problems.append(f"{what}: got {None if got is None else list(got.shape)}, "
                                 f"want {None if want is None else list(want.shape)}")
            return
        got, want = got.detach().double(), want.detach().double()
        scale = want.abs().max().item() if want.numel() else 0.0
        diff = (got - want).abs().max().item() if want.numel() else 0.0
        shown = diff / scale if scaled and scale > 0 else diff
        self.diff[kind] = max(self.diff.get(kind, 0.0), shown)
        if not torch.allclose(got, want, rtol=rtol, atol=atol * scale if scaled else atol):
            self.problems.append(f"{what}: max |diff| {diff:.3g} (largest |reference| {scale:.3g}; {name} "
                                 f"rtol {rtol:g}, atol {atol:g}{' x that' if scaled else ''})")

    def figures(self) -> str:
        name, _, _, scaled = self.tol
        what = "max |diff| / max |reference|" if scaled else "max |diff|"
        return f"{name}, {what}: " + ", ".join(f"{k} {v:.2g}" for k, v in self.diff.items())


class _Fillers:
    """Counts the work ``commfuse.runtime.runtime_steps.run_filler`` runs inside the ops' waits: per wait handed work,
    how many pieces it ran. ``inside``: whether the host is in such a wait now."""

    def __init__(self) -> None:
        self.per_wait: list[int] = []
        self.inside = False

    def __enter__(self) -> "_Fillers":
        real = self.real = runtime_steps.run_filler

        def counted(handle=None):
            before, self.inside = len(runtime_steps.FILLERS), True
            try:
                real(handle)
            finally:
                self.inside = False
                self.per_wait.append(before - len(runtime_steps.FILLERS))

        runtime_steps.run_filler = counted
        return self

    def __exit__(self, *exc) -> None:
        runtime_steps.run_filler = self.real

    def figures(self) -> str:
        most = max(self.per_wait, default=0)
        return f"{sum(self.per_wait)} pieces of work ran in {len(self.per_wait)} waits (at most {most} in one)"


def _loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (y - target).square().mean()


def _one_after_another(stages: list, x: torch.Tensor) -> tuple:
    """The stages' forward as one function, on one micro-batch: the last stage's outputs."""
    h = (x,)
    for stage in stages:
        h = stage.fn(*h)
        h = h if isinstance(h, tuple) else (h,)
    return h


def _against_sequential(ctx: Context, ours: dict, theirs: dict, stages_ours: list, stages_theirs: list,
                        batches_of, plan: str, steps: int, tol: tuple, *, autocast: bool = False,
                        after_backward=None, group=None, fills_expected: bool = False) -> tuple[list[str], str]:
    """``steps`` steps of ``strands.run(stages_ours, ...)`` against ``stages_theirs`` as one function,
    ``loss.backward()`` per micro-batch in turn: losses and every gradient compared each step, the parameters
    after AdamW steps (only where ``steps`` > 1). ``after_backward(params)`` runs on both before each step.
    ``fills_expected``: some work must have run inside a wait."""
    worst = _Worst(tol)
    optimizers = [torch.optim.AdamW(ours.values(), lr=1e-2), torch.optim.AdamW(theirs.values(), lr=1e-2)]
    fills = _Fillers()
    for step in range(steps):
        batches = batches_of(step)
        with torch.autocast(ctx.dev.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            with fills:
                losses = strands.run(stages_ours, batches, _loss, plan=plan, group=group)
            want = []
            for x, t in batches:
                loss = _loss(_one_after_another(stages_theirs, x)[0], t)
                loss.backward()
                want.append(loss.detach())
        for i, (got, ref) in enumerate(zip(losses, want)):
            worst.close("loss", f"step {step} micro-batch {i} loss", got, ref)
        for name in ours:
            worst.close("grad", f"step {step} gradient of {name}", ours[name].grad, theirs[name].grad)
        if after_backward is not None:
            after_backward(ours), after_backward(theirs)
        for opt in optimizers:
            opt.step(), opt.zero_grad()
    if steps > 1:
        for name in ours:
            worst.close("param", f"parameter {name} after {steps} steps", ours[name], theirs[name], AFTER_ADAMW)
    problems = worst.problems
    if runtime_steps.FILLERS:
        problems.append(f"work left over for later ops: {len(runtime_steps.FILLERS)} pieces")
    if fills_expected and not fills.per_wait:
        problems.append("no work ran inside any wait")
    return problems, f"{worst.figures()}; {fills.figures()}"


# -- the blocks -----------------------------------------------------------------------------------------------

def _llama_params(ctx: Context, dtype=torch.float32) -> dict:
    s = ctx.shapes
    return {k: v.to(ctx.dev).requires_grad_() for k, v in
            llama_tp_params(ctx.rank, ctx.n, hidden=s.hidden, ffn=s.ffn, dtype=dtype).items()}


def _llama_stages(ctx: Context, params: dict, searched: bool, group=None) -> list:
    return llama_tp_stages(params, heads=ctx.shapes.heads, group=group, figures=LLAMA_FIGURES if searched else None)


def _llama_batches(ctx: Context, step: int) -> list:
    """Each micro-batch's (inputs, target), this rank's shard along the sequence (dim 1)."""
    s, out = ctx.shapes, []
    for i in range(ctx.args.micro_batches):
        g = torch.Generator().manual_seed(1000 * step + 10 * i)
        x, t = (torch.randn(s.batch, s.seq, s.hidden, generator=g) for _ in range(2))
        out.append(tuple(v.chunk(ctx.n, dim=1)[ctx.rank].contiguous().to(ctx.dev) for v in (x, t)))
    return out


def llama_against_sequential(ctx: Context, plan: str, tol: tuple, steps: int, group=None) -> tuple[list, str]:
    ours, theirs = _llama_params(ctx), _llama_params(ctx)
    return _against_sequential(ctx, ours, theirs, _llama_stages(ctx, ours, plan == "searched", group),
                               _llama_stages(ctx, theirs, False, group), lambda step: _llama_batches(ctx, step),
                               plan, steps, tol, autocast=tol is BF16, group=group,
                               # deferred weight gradients; under autocast the ops cast the weights, and a
                               # cast weight (not a leaf) is never deferred: only the searched plan's stage
                               fills_expected=tol is FP32 or plan == "searched")


def moe_against_sequential(ctx: Context, plan: str) -> tuple[list, str]:
    s = ctx.shapes

    def params() -> dict:
        return {k: v.to(ctx.dev).requires_grad_() for k, v in
                moe_ep_params(ctx.rank, ctx.n, hidden=s.moe_hidden, ffn=s.moe_ffn,
                              experts=s.experts_per_rank * ctx.n).items()}

    def stages(p: dict, searched: bool) -> list:
        return moe_ep_stages(p, heads=s.heads, topk=s.topk, figures=MOE_FIGURES if searched else None)

    def batches(step: int) -> list:  # this rank's own rows
        out = []
        for i in range(ctx.args.micro_batches):
            g = torch.Generator().manual_seed(1000 * step + 10 * i + ctx.rank)
            out.append(tuple(torch.randn(s.batch, s.seq, s.moe_hidden, generator=g).to(ctx.dev) for _ in range(2)))
        return out

    def average_replicated(p: dict) -> None:
        for name in REPLICATED:
            dist.all_reduce(p[name].grad)
            p[name].grad.div_(ctx.n)

    ours, theirs = params(), params()
    return _against_sequential(ctx, ours, theirs, stages(ours, plan == "searched"), stages(theirs, False), batches,
                               plan, ctx.args.steps, FP32, after_backward=average_replicated,
                               fills_expected=plan == "searched")  # its exchanges defer no weight gradient


def forward_against_sequential(ctx: Context, plan: str) -> tuple[list, str]:
    stages = _llama_stages(ctx, _llama_params(ctx), plan == "searched")
    inputs = [x for x, _ in _llama_batches(ctx, 0)]
    worst = _Worst(FP32)
    with torch.no_grad(), _Fillers() as fills:
        got = strands.forward(stages, inputs, plan=plan)
    with torch.no_grad():
        for i, x in enumerate(inputs):
            want = _one_after_another(stages, x)
            mine = got[i] if i < len(got) else None
            worst.close("output", f"micro-batch {i} output", mine if isinstance(mine, torch.Tensor) else None, want[0])
    problems = worst.problems
    if len(got) != len(inputs):
        problems.append(f"{len(got)} outputs for {len(inputs)} micro-batches")
    if plan == "searched" and not fills.per_wait:
        problems.append("the searched plan ran no stage inside a wait")
    return problems, f"{worst.figures()}; {fills.figures()}"


# -- timing ---------------------------------------------------------------------------------------------------

def timing(ctx: Context) -> tuple[list, str]:
    """Median ms per strands.run of each plan (rows interleaved per repeat), and its host and drain shares."""
    from commfuse.bench.shared import fingerprint_exchange

    params = _llama_params(ctx)
    plans = ("sequential", "alternate", "searched")
    stages = {plan: _llama_stages(ctx, params, plan == "searched") for plan in plans}
    batches = _llama_batches(ctx, 0)
    wall = {plan: [] for plan in plans}
    host = {plan: [] for plan in plans}
    drain = {plan: [] for plan in plans}
    with fingerprint_exchange(False):  # the ops' safety round trip, off as commfuse bench times them
        for rep in range(ctx.args.warmup + ctx.args.repeats):
            for plan in plans:
                for p in params.values():
                    p.grad = None
                ctx.sync()
                dist.barrier()
                t0 = time.perf_counter()
                strands.run(stages[plan], batches, _loss, plan=plan)
                t1 = time.perf_counter()
                ctx.sync()
                t2 = time.perf_counter()
                if rep >= ctx.args.warmup:
                    wall[plan].append(t2 - t0), host[plan].append(t1 - t0), drain[plan].append(t2 - t1)

    def ms(values: list) -> str:
        return f"{1e3 * statistics.median(values):.2f}"

    s = ctx.shapes
    rows = [f"{plan} {ms(wall[plan])} ms (host {ms(host[plan])} + drain {ms(drain[plan])})" for plan in plans]
    return [], (f"two ranks time-slice one device; not an overlap figure. Llama b={s.batch} s={s.seq} h={s.hidden} "
                f"ffn={s.ffn}, {ctx.args.micro_batches} micro-batches, median of {ctx.args.repeats} after "
                f"{ctx.args.warmup} warm-up: " + "; ".join(rows))


# -- the other group, and the failure -------------------------------------------------------------------------

def device_backend_alone(ctx: Context) -> tuple[list, str]:
    backend = dist.get_default_backend_for_device(ctx.dev)
    group = dist.new_group(backend=backend)
    problems, figures = llama_against_sequential(ctx, "alternate", FP32, 1, group=group)
    return problems, f"new_group(backend={backend!r}): {figures}"


def one_rank_fails(ctx: Context) -> tuple[list, str]:
    """The attention core's forward raises on rank 1 from its second call on: every rank must stop within
    30 s naming rank 1; a second run must then run on gloo (the call the peers waited in was drained) and be
    refused at once on a stream-ordered group (NCCL: declared dead)."""
    from commfuse.runtime.watchdog import watchdog

    params = _llama_params(ctx)
    stages = _llama_stages(ctx, params, True)
    calls, where, outcome = [0], [], []
    fills = _Fillers()
    if ctx.rank == 1:
        def failing(*args, _fn=stages[1].fn):
            calls[0] += 1
            out = _fn(*args)
            if calls[0] >= 2:
                where.append("inside a wait" if fills.inside else "outside any wait")
                raise ZeroDivisionError(f"injected on rank 1 in the forward of 'attention core' (call {calls[0]})")
            return out
        stages[1] = strands.Stage(stages[1].name, failing, stages[1].compute, stages[1].comm)
    t0 = time.perf_counter()

    def ended(error: BaseException) -> None:  # commfuse's watchdog ends this rank (exit 75): say so first
        took = time.perf_counter() - t0
        named = "rank 1" in str(error)
        if ctx.rank == 1:  # its own error must have come out of strands.run first
            ok = bool(outcome) and outcome[0] == "ZeroDivisionError"
        else:  # a stream-ordered rank's host may have run ahead (its run returned): the watchdog names rank 1
            ok = named and took < 30
        ctx.results.append(("one rank fails", ok, "ended by commfuse's watchdog"))
        _say(ctx, f"{'PASS' if ok else 'FAIL'} one rank fails: ended by commfuse's watchdog {took:.1f} s after "
                  f"the run began (outcome so far: {outcome[0] if outcome else 'none'}; the error names rank 1: "
                  f"{named}): {type(error).__name__}: {error}")
        _summary(ctx)

    watchdog().on_fatal.append(ended)
    with fills:
        try:
            strands.run(stages, _llama_batches(ctx, 0), _loss, plan="searched")
            outcome += ["ok", "", time.perf_counter() - t0]
        except Exception as e:  # noqa: BLE001 - the outcome checked
            outcome += [type(e).__name__, str(e), time.perf_counter() - t0]
    kind, message, took = outcome
    _say(ctx, f"one rank fails: strands.run {'returned' if kind == 'ok' else 'raised ' + kind} after {took:.2f} s"
              + (f" (rank 1 raised {where[0]})" if where else "") + (f": {message}" if message else ""))
    if kind == "ok":  # the host ran ahead (stream-ordered): does the device's queue drain, or what ends it?
        t1 = time.perf_counter()
        ctx.sync()
        _say(ctx, f"one rank fails: the device drained {time.perf_counter() - t1:.2f} s later")
    problems = []
    if ctx.rank == 1 and kind != "ZeroDivisionError":
        problems.append(f"rank 1's run: {kind}, want its own ZeroDivisionError")
    # a stream-ordered rank's host may run ahead of its device and return: its watchdog then names rank 1
    stream_ordered = ctx.dev.type != "cpu"
    if ctx.rank != 1 and not (stream_ordered and kind == "ok") and (
            kind not in ("PeerFailedError", "GroupDeadError") or "rank 1" not in message):
        problems.append(f"{kind}, want PeerFailedError or GroupDeadError naming rank 1")
    if took >= 30:
        problems.append(f"took {took:.1f} s to stop, want under 30 s")
    t1 = time.perf_counter()
    try:
        strands.run(_llama_stages(ctx, params, True), _llama_batches(ctx, 0), _loss, plan="searched")
        after = ("ok", "")
    except Exception as e:  # noqa: BLE001 - the outcome checked
        after = (type(e).__name__, " ".join(line.strip() for line in str(e).splitlines()[:2]))
    after_took = time.perf_counter() - t1
    if ctx.dev.type == "cpu":  # gloo: rank 1 served the call its peers waited in, so the group is usable
        if after[0] != "ok":
            problems.append(f"a second run: {after[0]} after {after_took:.2f} s, want it to run (the call drained)")
    # a stream-ordered group cannot be drained: refused with the class of the error that ended it
    elif after[0] == "ok" or after_took >= 5:  # refused: the group declared dead, or its peer already gone
        problems.append(f"a second run: {after[0]} after {after_took:.2f} s, want it refused at once (the group "
                        "declared dead)")
    return problems, (f"this rank's run: {kind} after {took:.2f} s; a second run: {after[0]} after "
                      f"{after_took:.2f} s: {after[1]}")


def _leave_together(ctx: Context, seconds: float = 45.0) -> None:
    """Wait (at most ``seconds``) until every rank is here, on torchrun's store: torchrun ends the other ranks
    as soon as one exits non-zero, and the dead group can no longer hold a barrier."""
    if "MASTER_ADDR" not in os.environ:
        return
    key = "commfuse/strands_device/finished"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=seconds))
        store.add(key, 1)
        deadline = time.monotonic() + seconds
        while store.add(key, 0) < ctx.n and time.monotonic() < deadline:
            time.sleep(0.1)
    except Exception as e:  # noqa: BLE001 - leaving anyway
        _say(ctx, f"(could not wait for the other ranks: {type(e).__name__}: {e})")


# -- main -----------------------------------------------------------------------------------------------------

def _setup(args: argparse.Namespace) -> Context:
    dev_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dev_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        index = local % torch.cuda.device_count()
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
    else:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
    backend = args.pg_backend or ("cpu:gloo,cuda:nccl" if dev_type == "cuda" else "gloo")
    kwargs = {"device_id": dev} if dev_type == "cuda" else {}
    dist.init_process_group(backend, **kwargs)
    small = args.small if args.small is not None else dev_type == "cpu"
    return Context(dist.get_rank(), dist.get_world_size(), dev, SMALL if small else FULL, args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where available")
    parser.add_argument("--pg-backend", help="the world group's backend (default: gloo on CPU, cpu:gloo,cuda:nccl "
                                             "on CUDA)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", default=None, help="small shapes (the default on CPU)")
    size.add_argument("--full", dest="small", action="store_false", help="the full shapes (the default on CUDA)")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="AdamW steps of the fp32 checks")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--check-timeout", type=float, default=60.0, help="seconds; a check past it ends the rank")
    args = parser.parse_args(argv)
    ctx = _setup(args)
    s = ctx.shapes
    _say(ctx, f"torch {torch.__version__}, device {ctx.dev}"
              + (f" ({torch.cuda.get_device_name(ctx.dev)}, nccl {'.'.join(map(str, torch.cuda.nccl.version()))})"
                 if ctx.dev.type == "cuda" else "")
              + f", group {dist.get_backend_config()} of {ctx.n}; Llama b={s.batch} s={s.seq} h={s.hidden} "
              f"ffn={s.ffn} heads={s.heads}; MoE b={s.batch}/rank s={s.seq} h={s.moe_hidden} ffn={s.moe_ffn} "
              f"experts={s.experts_per_rank * ctx.n} top-{s.topk}; {args.micro_batches} micro-batches")
    for plan in ("alternate", "searched"):
        _check(ctx, f"llama fp32 {plan}", llama_against_sequential, plan, FP32, args.steps)
    for plan in ("alternate", "searched"):
        _check(ctx, f"llama bf16 {plan}", llama_against_sequential, plan, BF16, 1)
    for plan in ("alternate", "searched"):
        _check(ctx, f"moe fp32 {plan}", moe_against_sequential, plan)
    for plan in ("alternate", "searched"):
        _check(ctx, f"llama forward {plan}", forward_against_sequential, plan)
    _check(ctx, "timing", timing, informational=True)
    _check(ctx, "device backend alone", device_backend_alone)
    _check(ctx, "one rank fails", one_rank_fails)  # last: the group is dead after it
    _summary(ctx)
    _leave_together(ctx)
    sys.stdout.flush()
    sys.stderr.flush()
    # no destroy_process_group: the failure check left the group dead (aborted on a stream-ordered backend)
    os._exit(1 if any(ok is False for _, ok, _ in ctx.results) else 0)


if __name__ == "__main__":
    sys.exit(main())
