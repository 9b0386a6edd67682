"""What every rank runs: correctness against vanilla, the interleaved timing loop, one traced iteration.

Timing. Every timed run starts behind a barrier (and a device synchronise
off-CPU) and ends with a synchronise; each rank times its own run, and the
figure of an iteration is the largest over ranks (the slowest rank decides
the step time). One repeat runs every algorithm in three modes (normal,
``compute_only``, ``comm_only``); the order of algorithms and of modes is
shuffled anew every repeat so that a drift in the machine's load, or what
the previous run left behind, falls on all of them alike.

Outside time. Layer workloads do work outside the fused ops (activations,
attention cores, weight-gradient GEMMs); it runs in all three modes, so
``comm_only`` is not pure communication there. Where the backend's waits
block the host (gloo on CPU) the executor's own events tell the time spent
inside fused ops; in the ``compute_only`` run the rest of the wall time is
the *outside* time, which the report subtracts. Off-CPU host spans say
nothing about device time, and outside time is left unknown.
"""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

from commfuse.bench.config import WORKLOADS, BenchConfig, applies
from commfuse.bench.progress import Progress
from commfuse.bench.shared import fingerprint_exchange, gather_objects, load_average, run_info
from commfuse.bench.workloads import compare, make
from commfuse.errors import CommfuseValueError, first_line
from commfuse.runtime import measure, record_events

MODES = ("normal", "compute_only", "comm_only")


def _auxiliary(label: str) -> bool:
    """Whether an executor call of ``label`` is one a layer makes besides its fused ops (MoE's count exchange,
    auto's token count, a replicated parameter's gradient all-reduce), which the ``taken`` column leaves out."""
    return label.endswith(".sizes") or label == "moe.tokens" or label.startswith("replicated_grad.")

def shuffled(items: list, seed: int, rep: int) -> list:
    """``items`` in the order of repeat ``rep``: a permutation drawn anew every repeat, the same on every rank.

    A rotation (the order this replaced) keeps every algorithm behind the same
    neighbour in all repeats; what one run leaves behind (gloo's threads, socket
    buffers, caches) then always falls on the same next one. On tiny sizes that
    gave two runs of one schedule medians 10% apart.
    """
    out = list(items)
    random.Random(1_000_003 * seed + rep).shuffle(out)
    return out


def units(config: BenchConfig) -> int:
    """Progress units of a whole run: one per timed or checked iteration."""
    total = 0
    for w in config.workloads:
        if w == "strands":  # rows of its own
            from commfuse.bench import strands
            from commfuse.bench.workloads import STRAND_BLOCKS

            total += strands.units(config, len(STRAND_BLOCKS))
            continue
        if WORKLOADS[w].rows:  # rows of its own (ring_attention)
            total += _rows_module(w).units(config)
            continue
        algs = [a for a in config.algorithms if applies(w, a)]
        total += len(algs) * (1 + len(MODES) * (config.warmup + config.repeats) + (1 if config.trace else 0)) + 1
    return total


def _rows_module(workload: str):
    """The module that times a workload with rows of its own: ``units(config)`` and ``run_workload(...)``."""
    if workload == "strands":
        from commfuse.bench import strands

        return strands
    from commfuse.bench import ring_attention

    return ring_attention


def _executor_seconds(events: list[dict]) -> float:
    """Seconds spent inside the fused ops' steps: each step from its post to its end, which is its wait's end
    when it overlaps (post, compute, wait) and its compute's end under ``serial`` (post, wait, compute)."""
    return sum(max(e["wait"][1], e["compute"][1]) - e["post"][0] for e in events)


def _relative(events: list[dict], t_ref: float) -> list[dict]:
    out = []
    for e in events:
        out.append({
            "label": e.get("label", ""),
            "schedule": e.get("algorithm", ""),
            "step": e["step"],
            "post": [e["post"][0] - t_ref, e["post"][1] - t_ref],
            "compute": [e["compute"][0] - t_ref, e["compute"][1] - t_ref],
            "wait": [e["wait"][0] - t_ref, e["wait"][1] - t_ref],
            "sends": [list(s) for s in e.get("sends", [])],
            "recvs": [list(r) for r in e.get("recvs", [])],
            "collectives": list(e.get("collectives", [])),
            **({"computes": e["computes"]} if "computes" in e else {}),
        })
    return out


def run_rank(rank: int, world_size: int, config: BenchConfig, device: str, progress: bool) -> dict:
    """Run every workload of ``config`` on this rank; rank 0's result holds everything (traces gathered).

    With ``config.compile_backend`` (``--compile``) the run times eager against compiled instead
    (:func:`commfuse.bench.compiled.run_rank`)."""
    if config.compile_backend is not None:
        from commfuse.bench import compiled

        return compiled.run_rank(rank, world_size, config, device, progress)
    dev = torch.device(device)
    host_blocking = dev.type == "cpu"
    if host_blocking:
        torch.set_flush_denormal(True)  # garbage in compute_only/comm_only buffers must not hit denormal slow paths

    def sync() -> None:
        if not host_blocking:
            torch.accelerator.synchronize(dev)

    clock = time.perf_counter
    load_before = load_average()
    bar = Progress(units(config), enabled=progress and rank == 0)
    results = []
    for name in config.workloads:
        if WORKLOADS[name].rows:  # rows of its own instead of the algorithms
            workload = make(name, config, rank, world_size, dev)
            results += _rows_module(name).run_workload(workload, config, dev, bar, sync)
            del workload
            continue
        algs = [a for a in config.algorithms if applies(name, a)]
        bar.note(f"commfuse bench: {name} on {world_size} ranks, {len(algs)} algorithms, "
                 f"{config.repeats} repeats x {len(MODES)} modes")
        workload = make(name, config, rank, world_size, dev)
        bar.advance(f"{name}: set up")

        # correctness (and a first warm-up): every algorithm against vanilla, checked calls; a workload with a
        # one-process reference (moe) checks every algorithm, vanilla included, against that instead
        reference = getattr(workload, "reference", None)
        ref = reference() if reference is not None else workload.run("vanilla")
        routing = None
        if hasattr(workload, "routing"):  # rows each rank's tokens send to each rank (moe)
            routing = gather_objects(workload.routing(), world_size, dev)
        ok, err, taken = [], [], []
        for alg in algs:
            with record_events() as events, fingerprint_exchange(True):
                got = workload.run(alg)
            sync()
            good, worst = compare(got, ref)
            ok.append(1.0 if good else 0.0)
            err.append(worst)
            seen = sorted({(e["label"], e["algorithm"]) for e in events})
            if any(not _auxiliary(l) for l, _ in seen):  # the small exchanges a layer makes besides its fused ops
                seen = [(l, a) for l, a in seen if not _auxiliary(l)]
            schedules = sorted({a for _, a in seen})
            taken.append(",".join(schedules) if len(schedules) <= 1 else ",".join(f"{l}:{a}" for l, a in seen))
            bar.advance(f"{name} {alg}: checked")
        del ref, got

        # which measure modes this workload survives (a layer may not run with its compute removed)
        # (a side-by-side workload's vanilla is another library's plan, which they cannot take apart: its other
        # algorithms are probed, and its vanilla runs in the normal mode only)
        whole = getattr(workload, "measures_vanilla", True)
        probe = "vanilla" if whole else next((a for a in algs if a != "vanilla"), None)
        usable, why = [True], [""]
        for mode in MODES[1:]:
            try:
                if probe is None:
                    raise CommfuseValueError(f"{name}: only its vanilla was asked for, which {mode} cannot take apart")
                with measure(mode), fingerprint_exchange(config.fingerprint):
                    workload.run(probe)
                sync()
                usable.append(True)
                why.append("")
            except Exception as e:  # noqa: BLE001 - reported in the table; every rank fails alike
                usable.append(False)
                why.append(first_line(e, 200, named=True))
        agreed = torch.tensor([1.0 if u else 0.0 for u in usable], dtype=torch.float64)
        if dev.type != "cpu":
            agreed = agreed.to(dev)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        usable = [v >= 1.0 for v in agreed.cpu().tolist()]
        dist.barrier()
        modes = [m for m in range(len(MODES)) if usable[m]]

        # the timed loop
        reps, warm = config.repeats, config.warmup
        wall = torch.full((reps, len(algs), len(MODES)), float("nan"), dtype=torch.float64)
        outside = torch.full((reps, len(algs)), float("nan"), dtype=torch.float64)
        with fingerprint_exchange(config.fingerprint):
            for rep in range(warm + reps):
                for i in shuffled(list(range(len(algs))), config.seed, rep):
                    for m in shuffled(modes, config.seed + 1, rep):
                        mode = MODES[m]
                        if m and not whole and algs[i] == "vanilla":  # left NaN: reported as not measured
                            bar.advance()
                            continue
                        dist.barrier()
                        sync()
                        with measure(None if mode == "normal" else mode), record_events() as events:
                            t0 = clock()
                            workload.run(algs[i])
                            sync()
                            t1 = clock()
                        if rep >= warm:
                            wall[rep - warm, i, m] = t1 - t0
                            if mode == "compute_only":
                                outside[rep - warm, i] = (t1 - t0) - _executor_seconds(events)
                        bar.advance(f"{name} {algs[i]} {mode} ({min(rep + 1, warm + reps)}/{warm + reps})")
                    bar.advance(n=len(MODES) - len(modes))
        flags = torch.tensor(ok + err, dtype=torch.float64)
        if dev.type != "cpu":
            wall, outside, flags = wall.to(dev), outside.to(dev), flags.to(dev)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(outside, op=dist.ReduceOp.MAX)
        ok_t, err_t = flags[: len(algs)].clone(), flags[len(algs):].clone()
        dist.all_reduce(ok_t, op=dist.ReduceOp.MIN)
        dist.all_reduce(err_t, op=dist.ReduceOp.MAX)

        # one traced iteration per algorithm, times relative to the barrier every rank leaves together
        traces = {}
        if config.trace:
            for alg in algs:
                dist.barrier()
                sync()
                t_ref = clock()
                with record_events() as events, fingerprint_exchange(config.fingerprint):
                    workload.run(alg)
                    sync()
                end = clock() - t_ref
                traces[alg] = {"rank": rank, "end": end, "events": _relative(events, t_ref)}
                bar.advance(f"{name} {alg}: traced")
            gathered = gather_objects(traces, world_size, dev)
            traces = {alg: [g[alg] for g in gathered] for alg in algs}
        results.append({
            "workload": name,
            "algorithms": algs,
            "wall_s": wall.cpu().tolist(),
            "outside_s": outside.cpu().tolist() if host_blocking else None,
            "correct": [v >= 1.0 for v in ok_t.cpu().tolist()],
            "max_rel_error": err_t.cpu().tolist(),
            "taken": taken,
            "unusable_modes": {MODES[m]: why[m] or "failed on another rank" for m in range(len(MODES))
                               if not usable[m]},
            "traces": traces,
            **({"routing": routing} if routing is not None else {}),
        })
        del workload
    return {**run_info(load_before, world_size, dev), "results": results}


def release_backends() -> None:
    """Drop the ops' cached backends, plans (and their buffer pools) before the process group goes.

    The cache in ``commfuse.backends`` keeps the group's backend alive past
    ``destroy_process_group``; torn down at interpreter exit instead, gloo
    aborted the process now and then ("terminate called without an active
    exception", exit status -6 under torchrun).
    """
    import gc

    from commfuse import backends

    backends.release()
    gc.collect()


def launched(rank: int, world_size: int, config: BenchConfig, progress: bool) -> dict | None:
    """Entry point of a rank started by :func:`commfuse.launch.launch` (gloo on CPU)."""
    try:
        out = run_rank(rank, world_size, config, config.device or "cpu", progress)
    finally:
        release_backends()  # the launcher destroys the process group next
    return out if rank == 0 else None
