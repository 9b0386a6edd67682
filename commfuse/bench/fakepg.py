"""``commfuse bench --fake-pg N``: what the fused ops cost besides communication, in one process.

The process initialises torch's ``fake`` process group as rank 0 of ``N``
(``torch.testing._internal.distributed.fake_pg``): every send, receive and
collective completes at once and moves no data. An op's time is then its
(sliced) GEMMs plus commfuse's own overhead (planning look-ups, the
executor, buffer handling, kernel launches), which is what this mode
measures, per algorithm of ``all_gather_matmul`` and
``matmul_reduce_scatter``, against the one unsliced GEMM of the same shapes:

- ``all_gather_matmul``: x (T/N, h) per rank, W (h, ffn/N); the reference is
  the gathered (T, h) @ W;
- ``matmul_reduce_scatter``: x (T, ffn/N), W (ffn/N, h); the reference is
  the local x @ W (the reduce-scatter would follow).

Received data is garbage (the ops run with ``check=False``), so nothing is
compared. Per algorithm and repeat, one batch of ``calls`` calls is timed:

- device time per call: on CUDA a ``torch.cuda.Event`` pair around the batch
  (the device is synchronised before the first and after the second event,
  never inside the ops); on CPU the wall time of the batch;
- host time per call: ``time.perf_counter`` around the enqueueing of the
  batch, before synchronising. On CPU the ops run on the host, so it equals
  the device time; on CUDA, a host time near the device time means the GPU
  waited for the host (the op is launch-bound).

Two more columns, timed the same way in the same shuffled batches:

- **captured** (CUDA only): each call (the reference GEMM's too) captured
  once in a ``torch.cuda.CUDAGraph`` after warm-up, then replayed: the ops'
  GEMMs and stream ordering without their host work (the design target: the
  captured ring at most 1.15x the unsliced GEMM). Elsewhere the column says
  it was not measured and why ("capture needs a CUDA device");
- **compiled** (``--compile [BACKEND]``, any device): ``torch.compile`` with
  ``fullgraph=True`` of a function calling the op (``torch.ops.commfuse``),
  one graph per algorithm, its first call (the compile) timed apart.

The order of the algorithms (and of the reference GEMM) is shuffled every
repeat; figures are medians over the repeats.

The CUDA path is UNVERIFIED (written on machines without a GPU), the capture
above included; the CPU path runs in the tests.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import statistics
import time

import torch

from commfuse.bench.config import BenchConfig
from commfuse.bench.report import aligned
from commfuse.errors import CommfuseValueError, first_line

#: The op each bare workload runs.
OPS = {"ag_matmul": "all_gather_matmul", "matmul_rs": "matmul_reduce_scatter"}

#: Where the reference GEMM is named in the records.
GEMM = "gemm"

#: The project's design targets on an H100 (fake group, n = 8, bf16, tokens 8192, hidden 8192, ffn 28672): an
#: algorithm's device time per call at most this many times the unsliced GEMM's. Printed, never asserted.
TARGETS = {"ring": 1.25, "vanilla": 1.05}
#: The design target for capture in the same setting: the ring captured in a CUDA graph and replayed, at most this
#: many times the unsliced (eager) GEMM, for both ops. Printed, never asserted.
CAPTURED_TARGETS = {"ring": 1.15}
TARGET_SETTING = {"world_size": 8, "dtype": "bfloat16", "tokens": 8192, "hidden": 8192, "ffn": 28672}

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Completed:
    """A fake group's work that says it is complete (it is: the fake group does nothing).

    torch's FakeWork returns at once from ``wait`` but never marks itself
    complete, so ``is_completed()`` stays False; commfuse's stream-ordered path
    hands every step's works to the watchdog, which would keep polling them
    and, after the op timeout, declare the group dead.
    """

    __slots__ = ("work",)

    def __init__(self, work) -> None:
        self.work = work

    def wait(self, *args):
        return self.work.wait(*args)

    def is_completed(self) -> bool:
        return True


def _backend(device: torch.device):
    """The backend object the ops would pick for ``device`` (a plugin's, such as commfuse-cuda's, included),
    made on the fake group, with works that report completion.

    A c10d-based backend keeps its class (its streams, events and capabilities: the overhead measured is
    its own) with one change: the works it hands on are wrapped in :class:`_Completed`.
    """
    from commfuse import backends
    from commfuse.runtime.c10d import C10dBackend

    chosen = backends.get(device=device)  # a new object, not the ops' cached one
    if not isinstance(chosen, C10dBackend):  # not c10d-based: used as it is
        return chosen
    base = type(chosen)

    class FakeGroup(base):
        def _handle(self, works, *rest, **named):  # whatever else the base takes, passed on as it is
            return base._handle(self, [_Completed(w) for w in works], *rest, **named)

    FakeGroup.__name__ = FakeGroup.__qualname__ = f"FakeGroup{base.__name__}"
    chosen.__class__ = FakeGroup
    return chosen


def resolve_device(text: str | None) -> torch.device:
    """``--device`` for this mode: cpu, or cuda (default: cuda when torch sees one, else cpu)."""
    if text is None:
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(text)
    except RuntimeError as e:
        raise CommfuseValueError(f"--device {text!r} is not a device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CommfuseValueError(f"--device {text}: torch sees no CUDA device here (torch {torch.__version__})")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    if dev.type != "cpu":
        raise CommfuseValueError(
            f"--fake-pg times device work with CUDA events or the host clock: --device cpu or cuda, not {text!r}"
        )
    return dev


def _batch_timer(dev: torch.device):
    """``timed(fn, k) -> (device seconds per call, host seconds per call)`` for ``k`` calls of ``fn``."""
    clock = time.perf_counter
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def timed(fn, k: int) -> tuple[float, float]:
            torch.cuda.synchronize(dev)
            start.record()
            t0 = clock()
            for _ in range(k):
                fn()
            t1 = clock()
            end.record()
            torch.cuda.synchronize(dev)
            return start.elapsed_time(end) / 1e3 / k, (t1 - t0) / k

        return timed

    def timed(fn, k: int) -> tuple[float, float]:
        t0 = clock()
        for _ in range(k):
            fn()
        t1 = clock()
        return (t1 - t0) / k, (t1 - t0) / k

    return timed


def _setting_up(config: BenchConfig):
    """What the run sets for its duration: ``COMMFUSE_CHECK=0`` (what arrives on a fake group is garbage, and
    a compiled op takes its check mode from there) and, with ``--compile``, a fresh inductor cache and room for
    one graph per algorithm (``commfuse.bench.compiled``). Returns the function that undoes it."""
    from commfuse.bench.shared import fingerprint_exchange, fresh_inductor_cache, recompile_room

    stack = contextlib.ExitStack()
    stack.enter_context(fingerprint_exchange(False))
    if config.compile_backend is not None:
        stack.enter_context(fresh_inductor_cache(0))
        stack.enter_context(recompile_room(len(config.algorithms)))
    return stack.close


def _calls(name: str, config: BenchConfig, n: int, dev: torch.device, backend, gen: torch.Generator):
    """(reference GEMM, {algorithm: call}, {algorithm: what it took}, FLOPs per call, shapes in words, the op's
    inputs) of one workload. Every call, the GEMM's included, has run once (plans made, kernels chosen)."""
    import commfuse as cf

    s, dtype = config.shape, _DTYPES[config.dtype]
    tokens = s.batch * s.seq

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=dev, dtype=dtype)

    calls, taken = {}, {}
    if name == "ag_matmul":
        x, w = randn(tokens // n, s.hidden), randn(s.hidden, s.ffn // n, scale=1 / math.sqrt(s.hidden))
        full = randn(tokens, s.hidden)

        def gemm():
            return torch.matmul(full, w)

        for alg in config.algorithms:
            said: dict = {}
            cf.all_gather_matmul(x, w, algorithm=alg, check=False, backend=backend, report=said)
            taken[alg] = said.get("algorithm", alg)
            calls[alg] = (lambda alg=alg: cf.all_gather_matmul(x, w, algorithm=alg, check=False, backend=backend))
        flops = 2.0 * tokens * s.hidden * (s.ffn // n)
        shapes = f"({tokens // n}, {s.hidden}) gathered to ({tokens}, {s.hidden}) @ ({s.hidden}, {s.ffn // n})"
    else:
        x, w = randn(tokens, s.ffn // n), randn(s.ffn // n, s.hidden, scale=1 / math.sqrt(s.ffn))

        def gemm():
            return torch.matmul(x, w)

        for alg in config.algorithms:
            said = {}
            cf.matmul_reduce_scatter(x, w, algorithm=alg, check=False, backend=backend, report=said)
            taken[alg] = said.get("algorithm", alg)
            calls[alg] = (lambda alg=alg: cf.matmul_reduce_scatter(x, w, algorithm=alg, check=False,
                                                                     backend=backend))
        flops = 2.0 * tokens * (s.ffn // n) * s.hidden
        shapes = f"({tokens}, {s.ffn // n}) @ ({s.ffn // n}, {s.hidden}) scattered to ({tokens // n}, {s.hidden})"
    gemm()
    return gemm, calls, taken, flops, shapes, (x, w)


def run(config: BenchConfig, calls: int, *, progress: bool = False) -> dict:
    """Time every algorithm of ``config`` on a fake group of ``config.world_size``; the raw figures.

    Initialises the fake group in this process and destroys it before
    returning; refuses to run where a process group already exists.
    """
    import sys

    import torch.distributed as dist

    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise CommfuseValueError(f"--calls must be an integer >= 1, got {calls!r}")
    unknown = [w for w in config.workloads if w not in OPS]
    if unknown:
        raise CommfuseValueError(
            f"--fake-pg times the bare ops only ({', '.join(OPS)}), not {', '.join(unknown)}: pass -w ag_matmul "
            "matmul_rs or drop -w"
        )
    n = config.world_size
    config.check_world(n)
    dev = resolve_device(config.device)
    if not dist.is_available():
        raise CommfuseValueError("--fake-pg needs torch.distributed, which this torch build does not have")
    if dist.is_initialized():
        raise CommfuseValueError("--fake-pg initialises its own (fake) process group, and this process already "
                                 "has one")
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise CommfuseValueError(f"--fake-pg needs torch's fake process group, which this torch lacks ({e})") \
            from None
    if dev.type == "cpu":
        torch.set_num_threads(config.threads)
        torch.set_flush_denormal(True)  # received buffers hold garbage: no denormal slow paths in the GEMMs
    else:
        torch.cuda.set_device(dev)
    timed = _batch_timer(dev)
    restore = _setting_up(config)
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    except BaseException:
        restore()
        raise
    results = []
    try:
        backend = _backend(dev)
        gen = torch.Generator().manual_seed(config.seed)
        if config.compile_backend is not None:
            _serve_compiled_calls(backend, dev)
        for name in config.workloads:
            if progress:
                extra = "".join(f", {what}" for what, on in (("captured", dev.type == "cuda"),
                                                             (f"compiled ({config.compile_backend})",
                                                              config.compile_backend is not None)) if on)
                print(f"commfuse bench --fake-pg {n}: {OPS[name]} on {dev}, {len(config.algorithms)} algorithms "
                      f"eager{extra}, {config.warmup} + {config.repeats} batches of {calls} calls", file=sys.stderr,
                      flush=True)
            with torch.no_grad():
                gemm, fns, taken, flops, shapes, inputs = _calls(name, config, n, dev, backend, gen)
                eager = [(GEMM, gemm)] + list(fns.items())
                items = [("eager", key, fn) for key, fn in eager]
                # captured: every call (the GEMM's too) captured once in a CUDA graph and replayed
                captured_why = {}
                for key, fn in eager:
                    replay, why = _captured(fn, dev, backend, key == GEMM)
                    captured_why[key] = why
                    if replay is not None:
                        items.append(("captured", key, replay))
                # compiled: torch.compile(fullgraph=True) of a function calling the op, one graph per algorithm
                compiled_why, compiled_first = {}, {}
                if config.compile_backend is not None:
                    for key, (fn, first, why) in _compiled(name, inputs, config, dev).items():
                        compiled_why[key], compiled_first[key] = why, first
                        if fn is not None:
                            items.append(("compiled", key, fn))
                times = {kind: {key: [] for key, _ in eager} for kind in KINDS}
                host_s = {key: [] for key, _ in eager}
                for rep in range(config.warmup + config.repeats):
                    order = list(items)
                    random.Random(1_000_003 * config.seed + rep).shuffle(order)
                    for kind, key, fn in order:
                        d, h = timed(fn, calls)
                        if rep >= config.warmup:
                            times[kind][key].append(d)
                            if kind == "eager":
                                host_s[key].append(h)
                del gemm, fns, eager, items, order, inputs
            results.append({"workload": name, "op": OPS[name], "shapes": shapes, "flops": flops,
                            "algorithms": [GEMM, *config.algorithms], "taken": {GEMM: GEMM, **taken},
                            "device_s": times["eager"], "host_s": host_s,
                            "captured_s": times["captured"], "captured_why": captured_why,
                            "compiled_s": times["compiled"], "compiled_why": compiled_why,
                            "compiled_first_s": compiled_first})
            gc.collect()  # the captured graphs (and their memory pools) go with their replay functions
    finally:
        from commfuse import backends

        backends.release()
        gc.collect()
        dist.destroy_process_group()
        restore()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"world_size": n, "device": str(dev), "device_name": name, "calls": calls, "results": results,
            "compile_backend": config.compile_backend, "torch": torch.__version__}


#: The ways each call is timed: as it is, replayed from a CUDA graph, compiled.
KINDS = ("eager", "captured", "compiled")

#: Why the captured column is empty off CUDA.
CAPTURE_NEEDS_CUDA = "capture needs a CUDA device"


def _captured(fn, dev: torch.device, backend, plain: bool):
    """(``replay``, "") with ``replay`` a graph's replay that stands for one ``fn()``, or (None, why not).

    UNVERIFIED on a GPU: written and tested on machines without one (on CPU this says only why it does not
    measure). The path, kept plain: a few warm-up calls on a side stream (torch.cuda.graph's docs), then one call
    captured with ``torch.cuda.graph`` while commfuse's watchdog holds its device polls (a query from its thread
    would invalidate a global-mode capture; ``Watchdog.paused``), then one replay. The op calls are the eager
    ones, ``check=False`` (nothing to check on a fake group, and a checked call cannot be captured), on the fake
    group's backend (its works report completion, and a captured step is never watched anyway). Outputs and
    buffers of the capture live in the graph's private memory pool, which goes with the graph.
    """
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None, f"{CAPTURE_NEEDS_CUDA} (this run: {dev})"
    caps = getattr(backend, "capabilities", None)
    if not plain and getattr(caps, "capturable", None) is False:
        return None, (f"the backend {type(backend).__name__} does not declare Capabilities.capturable (commfuse-cuda "
                      "does: pip install ./backends/cuda)")
    try:
        from commfuse.runtime.watchdog import watchdog

        paused = getattr(watchdog(), "paused", None)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with paused() if paused is not None else contextlib.nullcontext(), torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize(dev)
    except Exception as e:  # noqa: BLE001 - reported in the table, the other columns still measured
        with contextlib.suppress(Exception):  # the capture's own error is the one to report
            torch.cuda.synchronize(dev)
        return None, f"capture failed: {first_line(e, None, named=True)}"[:300]
    return graph.replay, ""


def _serve_compiled_calls(backend, dev: torch.device) -> None:
    """Have the compiled ops (which take no ``backend``: they resolve the group's, ``commfuse.backends.resolve``)
    run on ``backend``, the fake group's, whose works report completion; without it, on CUDA, the watchdog would
    poll torch's fake works, which never do, until the op timeout. Forgotten by ``backends.release()``."""
    from commfuse import backends

    backends.adopt(backend, device=dev)


def _compiled(name: str, inputs, config: BenchConfig, dev: torch.device) -> dict:
    """{algorithm: (call, seconds of its first call (the compile), why not)} of ``torch.compile(fullgraph=True)``
    of a function calling the op (``commfuse.bench.workloads``), inputs as the eager calls'. The fingerprint
    check is off (``COMMFUSE_CHECK=0``, set for the whole run: a compiled op takes no ``check``)."""
    from commfuse.bench import workloads

    fn = torch.compile(workloads._agmm if name == "ag_matmul" else workloads._mmrs, fullgraph=True,
                       backend=config.compile_backend)
    x, w = inputs
    out = {}
    for alg in config.algorithms:
        def call(alg=alg):
            return fn(x, w, alg)

        try:
            t0 = time.perf_counter()
            call()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            out[alg] = (call, time.perf_counter() - t0, "")
        except Exception as e:  # noqa: BLE001 - reported in the table
            out[alg] = (None, None, f"did not compile: {first_line(e, None, named=True)}"[:300])
    return out


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def records(run_result: dict, config: BenchConfig) -> list[dict]:
    """One record per (workload, algorithm), the reference GEMM first as algorithm ``gemm``."""
    out = []
    s = config.shape
    for res in run_result["results"]:
        gemm_ms = 1e3 * statistics.median(res["device_s"][GEMM])
        for alg in res["algorithms"]:
            dev = [1e3 * x for x in res["device_s"][alg]]
            host = [1e3 * x for x in res["host_s"][alg]]
            med = statistics.median(dev)
            p25, p75 = _quartiles(dev)
            out.append({
                "mode": "fake_pg",
                "workload": res["workload"],
                "op": res["op"],
                "algorithm": alg,
                "taken": res["taken"][alg],
                "world_size": run_result["world_size"],
                "device": run_result["device"],
                "device_name": run_result["device_name"],
                "dtype": config.dtype,
                "tokens": s.batch * s.seq,
                "hidden": s.hidden,
                "ffn": s.ffn,
                "shapes": res["shapes"],
                "calls": run_result["calls"],
                "repeats": len(dev),
                "device_ms": round(med, 4),
                "device_p25_ms": round(p25, 4),
                "device_p75_ms": round(p75, 4),
                "host_ms": round(statistics.median(host), 4),
                "gemm_ms": round(gemm_ms, 4),
                "vs_gemm": round(med / gemm_ms, 4) if gemm_ms > 0 else None,
                "tflops": round(res["flops"] / (med / 1e3) / 1e12, 4) if med > 0 else None,
                **_other_kinds(res, alg, med, gemm_ms, run_result.get("compile_backend")),
            })
    return out


#: What a compiled column says when ``--compile`` was not given, and for the reference GEMM.
COMPILE_NOT_ASKED = "not asked: add --compile [BACKEND]"
REFERENCE_EAGER = "the reference GEMM runs eager only"


def _other_kinds(res: dict, alg: str, eager_ms: float, gemm_ms: float, compile_backend: str | None) -> dict:
    """The captured and compiled figures of one record: ms per call (medians), over the unsliced (eager) GEMM's
    and over the eager call's, and why a figure is missing (None where it was measured)."""
    out: dict = {"compile_backend": compile_backend}
    for kind in ("captured", "compiled"):
        times = [1e3 * x for x in res.get(f"{kind}_s", {}).get(alg, [])]
        why = res.get(f"{kind}_why", {}).get(alg, "")
        if kind == "compiled" and compile_backend is None:
            why = COMPILE_NOT_ASKED
        elif kind == "compiled" and alg == GEMM:
            why = REFERENCE_EAGER
        elif not times and not why:
            why = "not measured"
        med = statistics.median(times) if times else None
        out[f"{kind}_ms"] = None if med is None else round(med, 4)
        out[f"{kind}_vs_gemm"] = round(med / gemm_ms, 4) if med is not None and gemm_ms > 0 else None
        out[f"{kind}_vs_eager"] = round(med / eager_ms, 4) if med is not None and eager_ms > 0 else None
        out[f"{kind}_not_measured"] = None if times else why
    first = res.get("compiled_first_s", {}).get(alg)
    out["compiled_first_call_s"] = None if first is None else round(first, 3)
    return out


def table(recs: list[dict]) -> str:
    """The human-readable table, one block per op."""
    lines = []
    by: dict[str, list[dict]] = {}
    for r in recs:
        by.setdefault(r["workload"], []).append(r)
    for rows in by.values():
        r0 = rows[0]
        lines.append(
            f"{r0['op']}: fake group, rank 0 of {r0['world_size']}, {r0['device']}"
            + ("" if r0["device_name"] == r0["device"] else f" ({r0['device_name']})") + ", "
            f"{r0['dtype']}; tokens {r0['tokens']}, hidden {r0['hidden']}, ffn {r0['ffn']}: per rank "
            f"{r0['shapes']}; medians of {r0['repeats']} batches of {r0['calls']} calls"
        )
        compiled = r0.get("compile_backend") is not None
        header = ("algorithm", "device ms/call (p25-p75)", "vs GEMM", "host ms/call", "TFLOP/s",
                  "captured ms/call (vs GEMM)") + (("compiled ms/call (vs GEMM)", "first compiled call s")
                                                   if compiled else ())
        body = []
        for r in rows:
            alg = "unsliced GEMM" if r["algorithm"] == GEMM else r["algorithm"]
            if r["algorithm"] == "auto" and r["taken"]:
                alg += f" ({r['taken']})"
            row = (alg, f"{r['device_ms']:.3f} ({r['device_p25_ms']:.3f}-{r['device_p75_ms']:.3f})",
                   "-" if r["vs_gemm"] is None else f"{r['vs_gemm']:.3f}x", f"{r['host_ms']:.3f}",
                   "-" if r["tflops"] is None else f"{r['tflops']:.2f}", _cell(r, "captured"))
            if compiled:
                first = r.get("compiled_first_call_s")
                row += (_cell(r, "compiled"), "-" if first is None else f"{first:.2f}")
            body.append(row)
        lines.extend(aligned(header, body))
        for kind in ("captured",) + (("compiled",) if compiled else ()):
            whys = dict.fromkeys(r[f"{kind}_not_measured"] for r in rows if r.get(f"{kind}_not_measured"))
            whys.pop(REFERENCE_EAGER, None)
            for why in whys:
                who = [("unsliced GEMM" if r["algorithm"] == GEMM else r["algorithm"]) for r in rows
                       if r.get(f"{kind}_not_measured") == why]
                whom = "" if len(who) == len(rows) else f" ({', '.join(who)})"
                lines.append(f"  {kind}: not measured{whom}: {why}")
        lines.append("")
    cpu = recs and recs[0]["device"] == "cpu"
    lines.append("Every transfer completes at once without moving data: an op's time is its GEMMs plus commfuse's "
                 "overhead. vs GEMM: device time over")
    lines.append("the unsliced GEMM's (all_gather_matmul: the gathered input @ W; matmul_reduce_scatter: the local "
                 "input @ W). host: time to enqueue a call"
                 + (" (on CPU the ops run on the host: host = device time)." if cpu else
                    " (near the device time: the GPU waited for the host)."))
    lines.append("captured: the same call captured once in a torch.cuda.CUDAGraph after warm-up, then replayed (CUDA "
                 "only); compiled (--compile): torch.compile(fullgraph=True)")
    lines.append("of a function calling the op, one graph per algorithm, its first call (the compile) apart. Every "
                 "column over the one eager unsliced GEMM; all interleaved.")
    return "\n".join(lines)


def _cell(r: dict, kind: str) -> str:
    if r.get(f"{kind}_not_measured") == REFERENCE_EAGER:
        return "-"
    if r.get(f"{kind}_ms") is None:
        return "not measured"
    return f"{r[f'{kind}_ms']:.3f} ({r[f'{kind}_vs_gemm']:.3f}x)" if r[f"{kind}_vs_gemm"] is not None \
        else f"{r[f'{kind}_ms']:.3f}"


def targets(recs: list[dict]) -> list[str]:
    """The project's H100 design targets against this run's figures; printed, never asserted."""
    r0 = recs[0] if recs else None
    if r0 is None:
        return []
    setting = {"world_size": r0["world_size"], "dtype": r0["dtype"], "tokens": r0["tokens"], "hidden": r0["hidden"],
               "ffn": r0["ffn"]}
    same = setting == TARGET_SETTING and r0["device"].startswith("cuda")
    lines = [("the project's design targets (an H100, fake group of 8, bfloat16, tokens 8192, hidden 8192, ffn 28672; "
              "printed, never asserted)")
             + ("" if same else "; this run's setting differs: figures only, no verdict") + ":"]
    for alg, bound in TARGETS.items():
        got = [f"{r['op']} {r['vs_gemm']:.3f}x" for r in recs if r["algorithm"] == alg and r["vs_gemm"] is not None]
        if got:
            met = all(r["vs_gemm"] <= bound for r in recs if r["algorithm"] == alg and r["vs_gemm"] is not None)
            verdict = (": met" if met else ": MISSED") if same else ""
            lines.append(f"  {alg} at most {bound:.2f}x the unsliced GEMM: {', '.join(got)}{verdict}")
    for alg, bound in CAPTURED_TARGETS.items():
        rows = [r for r in recs if r["algorithm"] == alg]
        if not rows:
            continue
        got = [f"{r['op']} {r['captured_vs_gemm']:.3f}x" for r in rows if r.get("captured_vs_gemm") is not None]
        missing = [r for r in rows if r.get("captured_vs_gemm") is None]
        whys = dict.fromkeys(r["captured_not_measured"] for r in missing)
        if missing and not got and len(whys) == 1:
            said = f"not measured: {next(iter(whys))}"
        else:
            said = ", ".join(got + [f"{r['op']} not measured: {r['captured_not_measured']}" for r in missing])
        verdict = ""
        if same and got and not missing:
            verdict = ": met" if all(r["captured_vs_gemm"] <= bound for r in rows) else ": MISSED"
        lines.append(f"  {alg} captured in a CUDA graph at most {bound:.2f}x the unsliced GEMM: {said}{verdict}")
    return lines
