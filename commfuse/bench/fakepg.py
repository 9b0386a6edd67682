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

The order of the algorithms (and of the reference GEMM) is shuffled every
repeat; figures are medians over the repeats.

The CUDA path is UNVERIFIED (written on machines without a GPU); the CPU path
runs in the tests.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time

import torch

from commfuse.bench.config import BenchConfig
from commfuse.bench.report import aligned
from commfuse.errors import CommfuseValueError

#: The op each bare workload runs.
OPS = {"ag_matmul": "all_gather_matmul", "matmul_rs": "matmul_reduce_scatter"}

#: Where the reference GEMM is named in the records.
GEMM = "gemm"

#: The issue's targets on an H100 (fake group, n = 8, bf16, tokens 8192, hidden 8192, ffn 28672): an
#: algorithm's device time per call at most this many times the unsliced GEMM's. Printed, never asserted.
TARGETS = {"ring": 1.25, "vanilla": 1.05}
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
        def _handle(self, works, outputs, inflight, what):
            return base._handle(self, [_Completed(w) for w in works], outputs, inflight, what)

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


def _calls(name: str, config: BenchConfig, n: int, dev: torch.device, backend, gen: torch.Generator):
    """(reference GEMM, {algorithm: call}, {algorithm: what it took}, FLOPs per call, shapes in words) of one
    workload. Every call, the GEMM's included, has run once (plans made, kernels chosen)."""
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
    return gemm, calls, taken, flops, shapes


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
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    results = []
    try:
        backend = _backend(dev)
        gen = torch.Generator().manual_seed(config.seed)
        for name in config.workloads:
            if progress:
                print(f"commfuse bench --fake-pg {n}: {OPS[name]} on {dev}, {len(config.algorithms)} algorithms, "
                      f"{config.warmup} + {config.repeats} batches of {calls} calls", file=sys.stderr, flush=True)
            with torch.no_grad():
                gemm, fns, taken, flops, shapes = _calls(name, config, n, dev, backend, gen)
                items = [(GEMM, gemm)] + list(fns.items())
                device_s = {k: [] for k, _ in items}
                host_s = {k: [] for k, _ in items}
                for rep in range(config.warmup + config.repeats):
                    order = list(items)
                    random.Random(1_000_003 * config.seed + rep).shuffle(order)
                    for key, fn in order:
                        d, h = timed(fn, calls)
                        if rep >= config.warmup:
                            device_s[key].append(d)
                            host_s[key].append(h)
                del gemm, fns, items, order
            results.append({"workload": name, "op": OPS[name], "shapes": shapes, "flops": flops,
                            "algorithms": [GEMM, *config.algorithms], "taken": {GEMM: GEMM, **taken},
                            "device_s": device_s, "host_s": host_s})
    finally:
        from commfuse import backends

        backends.release()
        gc.collect()
        dist.destroy_process_group()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"world_size": n, "device": str(dev), "device_name": name, "calls": calls, "results": results}


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
            })
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
        header = ("algorithm", "device ms/call (p25-p75)", "vs GEMM", "host ms/call", "TFLOP/s")
        body = []
        for r in rows:
            alg = "unsliced GEMM" if r["algorithm"] == GEMM else r["algorithm"]
            if r["algorithm"] == "auto" and r["taken"]:
                alg += f" ({r['taken']})"
            body.append((alg, f"{r['device_ms']:.3f} ({r['device_p25_ms']:.3f}-{r['device_p75_ms']:.3f})",
                         "-" if r["vs_gemm"] is None else f"{r['vs_gemm']:.3f}x", f"{r['host_ms']:.3f}",
                         "-" if r["tflops"] is None else f"{r['tflops']:.2f}"))
        lines.extend(aligned(header, body))
        lines.append("")
    cpu = recs and recs[0]["device"] == "cpu"
    lines.append("Every transfer completes at once without moving data: an op's time is its GEMMs plus commfuse's "
                 "overhead. vs GEMM: device time over")
    lines.append("the unsliced GEMM's (all_gather_matmul: the gathered input @ W; matmul_reduce_scatter: the local "
                 "input @ W). host: time to enqueue a call"
                 + (" (on CPU the ops run on the host: host = device time)." if cpu else
                    " (near the device time: the GPU waited for the host)."))
    return "\n".join(lines)


def targets(recs: list[dict]) -> list[str]:
    """The issue's H100 targets against this run's figures; printed, never asserted."""
    r0 = recs[0] if recs else None
    if r0 is None:
        return []
    setting = {"world_size": r0["world_size"], "dtype": r0["dtype"], "tokens": r0["tokens"], "hidden": r0["hidden"],
               "ffn": r0["ffn"]}
    same = setting == TARGET_SETTING and r0["device"].startswith("cuda")
    lines = [("the issue's targets (an H100, fake group of 8, bfloat16, tokens 8192, hidden 8192, ffn 28672; "
              "printed, never asserted)")
             + ("" if same else "; this run's setting differs: figures only, no verdict") + ":"]
    for alg, bound in TARGETS.items():
        got = [f"{r['op']} {r['vs_gemm']:.3f}x" for r in recs if r["algorithm"] == alg and r["vs_gemm"] is not None]
        if got:
            met = all(r["vs_gemm"] <= bound for r in recs if r["algorithm"] == alg and r["vs_gemm"] is not None)
            verdict = (": met" if met else ": MISSED") if same else ""
            lines.append(f"  {alg} at most {bound:.2f}x the unsliced GEMM: {', '.join(got)}{verdict}")
    return lines
