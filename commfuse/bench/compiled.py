"""``commfuse bench --compile [BACKEND]``: each workload eager against ``torch.compile(..., fullgraph=True)``.

What every rank runs, per workload (the ``commfuse.nn`` layers ``mlp``,
``attention`` and ``fsdp_linear``, forward + backward; the bare ops
``ag_matmul`` and ``matmul_rs`` through a compiled function that calls the
op) and per algorithm:

1. one eager run, with the ops' fingerprint check: the reference;
2. the first compiled run (dynamo's trace, AOTAutograd, the backend's
   compile of forward and backward, then the step itself), timed on its own
   as the **first compiled step**: what compiling costs, never part of the
   step times; its result is compared with the eager one (within the dtype's
   tolerance, as every algorithm is compared with vanilla's elsewhere);
3. ``--warmup`` untimed and ``--repeats`` timed repeats, in each of which the
   eager and the compiled step of every algorithm run once, in an order
   shuffled anew every repeat (the same on every rank): the same process
   group, module, parameters, inputs and output gradient for both.

Every timed run starts behind a barrier (and a device synchronise off-CPU)
and ends with a synchronise; an iteration's figure is the slowest rank's, as
in ``runner``. There are no ``compute_only``/``comm_only`` runs here.

A layer is compiled once (``torch.compile`` of the module itself); switching
its ``algorithm`` switches between the graphs dynamo keeps for each (it
guards on the attribute), so the compiled step includes the guard check, as
it would in a training loop. Inductor compiles into a fresh cache directory
per rank (``TORCHINDUCTOR_CACHE_DIR``, removed afterwards): its FX-graph
cache does not key on a custom op's fake kernel, so a cache from another
commfuse version could hand back stale code, and a warm cache would make the
first-step figure a load, not a compile.
"""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

from commfuse.bench.config import BenchConfig, applies
from commfuse.bench.progress import Progress
from commfuse.bench.shared import (
    fingerprint_exchange,
    fresh_inductor_cache,
    gather_objects,
    load_average,
    recompile_room,
    run_info,
)
from commfuse.bench.workloads import compare, make
from commfuse.errors import first_line

#: The two kinds of step timed side by side.
KINDS = ("eager", "compiled")


def units(config: BenchConfig) -> int:
    """Progress units of a whole ``--compile`` run."""
    total = 0
    for w in config.workloads:
        algs = [a for a in config.algorithms if applies(w, a)]
        total += len(algs) * (2 + len(KINDS) * (config.warmup + config.repeats)) + 1
    return total


def run_rank(rank: int, world_size: int, config: BenchConfig, device: str, progress: bool) -> dict:
    """Time every workload of ``config`` eager and compiled on this rank; rank 0's result holds the figures."""
    dev = torch.device(device)
    host_blocking = dev.type == "cpu"
    if host_blocking:
        torch.set_flush_denormal(True)

    def sync() -> None:
        if not host_blocking:
            torch.accelerator.synchronize(dev)

    def agreed(values: list[float], op) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if not host_blocking:
            t = t.to(dev)
        dist.all_reduce(t, op=op)
        return t.cpu().tolist()

    clock = time.perf_counter
    backend = config.compile_backend or "inductor"
    load_before = load_average()
    bar = Progress(units(config), enabled=progress and rank == 0)
    results = []
    with fresh_inductor_cache(rank), recompile_room(len(config.algorithms)):
        for name in config.workloads:
            algs = [a for a in config.algorithms if applies(name, a)]
            bar.note(f"commfuse bench --compile {backend}: {name} on {world_size} ranks, {len(algs)} algorithm(s), "
                     f"eager and compiled, {config.repeats} repeats")
            workload = make(name, config, rank, world_size, dev)
            workload.compile(backend)
            bar.advance(f"{name}: set up")

            # the eager reference (checked calls) and the first compiled step of every algorithm, timed apart
            first = [float("nan")] * len(algs)
            ok, err, failed = [], [], []
            for i, alg in enumerate(algs):
                with fingerprint_exchange(True):
                    ref = workload.run(alg)
                sync()
                bar.advance(f"{name} {alg}: eager reference")
                dist.barrier()
                sync()
                try:
                    with fingerprint_exchange(config.fingerprint):
                        t0 = clock()
                        got = workload.run(alg, compiled=True)
                        sync()
                        first[i] = clock() - t0
                    good, worst = compare(got, ref)
                    why = ""
                except Exception as e:  # noqa: BLE001 - reported in the table; a graph break fails every rank alike
                    good, worst, why = False, float("inf"), first_line(e, 300, named=True)
                ok.append(1.0 if good else 0.0)
                err.append(worst)
                failed.append(why)
                bar.advance(f"{name} {alg}: compiled")
            del ref
            broken = agreed([1.0 if why else 0.0 for why in failed], dist.ReduceOp.MAX)
            ok = agreed(ok, dist.ReduceOp.MIN)
            err = agreed(err, dist.ReduceOp.MAX)
            first = agreed(first, dist.ReduceOp.MAX)
            dist.barrier()

            # the timed loop: eager and compiled of every algorithm interleaved, shuffled every repeat
            items = [(i, k) for i in range(len(algs)) for k in range(len(KINDS)) if not (k == 1 and broken[i])]
            reps, warm = config.repeats, config.warmup
            wall = torch.full((reps, len(algs), len(KINDS)), float("nan"), dtype=torch.float64)
            with fingerprint_exchange(config.fingerprint):
                for rep in range(warm + reps):
                    for i, k in random.Random(1_000_003 * config.seed + rep).sample(items, len(items)):
                        dist.barrier()
                        sync()
                        t0 = clock()
                        workload.run(algs[i], compiled=k == 1)
                        sync()
                        t1 = clock()
                        if rep >= warm:
                            wall[rep - warm, i, k] = t1 - t0
                        bar.advance(f"{name} {algs[i]} {KINDS[k]} ({rep + 1}/{warm + reps})")
                    bar.advance(n=len(algs) * len(KINDS) - len(items))
            if not host_blocking:
                wall = wall.to(dev)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            # every rank's reason, so that rank 0 can name one that only another rank saw
            reasons = gather_objects(failed, world_size, dev)
            why = [next((r[i] for r in reasons if r[i]), "") for i in range(len(algs))]
            results.append({
                "workload": name,
                "algorithms": algs,
                "wall_s": wall.cpu().tolist(),  # [repeat][algorithm][eager, compiled]
                "first_compiled_s": first,
                "correct": [v >= 1.0 for v in ok],
                "max_rel_error": err,
                "compile_error": [w or ("failed on another rank" if b else "") for w, b in zip(why, broken)],
            })
            del workload
    return {
        "mode": "compile",
        "compile_backend": backend,
        "torch": torch.__version__,
        **run_info(load_before, world_size, dev),
        "results": results,
    }
