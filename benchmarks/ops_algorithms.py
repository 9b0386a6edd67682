"""Median time of every algorithm for all_gather_matmul and matmul_reduce_scatter, and the executor's per-step overhead.

Runs 2 gloo ranks on this machine (plain loopback unless you shape it), one
thread each, and interleaves the algorithms repeat by repeat so that drift in
the machine's load hits them all alike. The per-step overhead is the time of
a ring op on tiny tensors minus the time of the same transfers posted and
waited directly with torch.distributed, divided by the number of steps
(target: under 100 us per step).

    python benchmarks/ops_algorithms.py [--repeats 15] [--world-size 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

ALGORITHMS = ["vanilla", "sliced:2", "sliced:4", "ring", "bidirectional", "auto"]
SIZES = {  # name: (tokens per rank M, K, N)
    "small": (64, 256, 256),
    "medium": (512, 1024, 1024),
    "large": (1024, 2048, 2048),
}


def _bench(rank, n, repeats, sizes):
    import torch
    import torch.distributed as dist

    import commfuse as cf

    results = {}
    for size, (m, k, cols) in sizes.items():
        g = torch.Generator().manual_seed(rank)
        shard = torch.randn(m, k, generator=g)
        w_ag = torch.randn(k, cols, generator=g)
        a_rs = torch.randn(m * n, k, generator=g)
        w_rs = torch.randn(k, cols, generator=g)
        ops = {
            "all_gather_matmul": lambda alg: cf.all_gather_matmul(shard, w_ag, algorithm=alg),
            "matmul_reduce_scatter": lambda alg: cf.matmul_reduce_scatter(a_rs, w_rs, algorithm=alg),
        }
        for op, fn in ops.items():
            times = {alg: [] for alg in ALGORITHMS}
            ref = fn("vanilla")
            for alg in ALGORITHMS:  # warm-up, and a correctness check against vanilla
                out = fn(alg)
                assert torch.allclose(out, ref, rtol=1e-4, atol=1e-3), (op, size, alg)
            for _ in range(repeats):
                for alg in ALGORITHMS:
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn(alg)
                    times[alg].append(time.perf_counter() - t0)
            results[(op, size)] = times
    # Executor overhead on tiny tensors. (1) software only: the same op in compute_only mode with
    # ring:m for several m (n*m steps each); the slope of time over steps is the per-step cost, the
    # intercept the per-call cost. (2) with real transfers: a ring op against the same transfers
    # posted and waited directly.
    from commfuse.runtime import measure

    tiny, w = torch.randn(4, 4), torch.randn(4, 4)
    soft = {}
    for m in (1, 4, 16):
        def op(m=m):
            cf.all_gather_matmul(tiny, w, algorithm=f"ring:{m}", check=False)
        with measure("compute_only"):
            for _ in range(50):
                op()
            ts = []
            for _ in range(400):
                t0 = time.perf_counter()
                op()
                ts.append(time.perf_counter() - t0)
        soft[n * m] = statistics.median(ts)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    bufs = [torch.empty(4, 4) for _ in range(2)]

    def raw():  # the same steps written by hand: post, compute while in flight, wait
        for k in range(n - 1):
            ops = [dist.P2POp(dist.isend, tiny, group_peer=nxt), dist.P2POp(dist.irecv, bufs[k % 2], group_peer=prv)]
            works = dist.batch_isend_irecv(ops)
            tiny @ w
            for work in works:
                work.wait()
        tiny @ w

    def fused():
        cf.all_gather_matmul(tiny, w, algorithm="ring", check=False)

    over = {"raw": [], "fused": [], "soft": soft}
    for _ in range(20):
        raw(), fused()
    for _ in range(300):
        for name, fn in (("raw", raw), ("fused", fused)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            over[name].append(time.perf_counter() - t0)
    steps = n
    return results, over, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = p.parse_args()
    from commfuse.launch import launch

    out = launch(_bench, args.world_size, args.repeats, {s: SIZES[s] for s in args.sizes}, timeout=1800)
    results, over, steps = out[0]
    print(f"{args.world_size} gloo ranks, plain loopback, 1 thread each; median (min-max) ms over {args.repeats} "
          "interleaved repeats, rank 0")
    print(f"{'op':<22} {'size (M,K,N)':<20} " + " ".join(f"{a:>18}" for a in ALGORITHMS))
    for (op, size), times in results.items():
        cells = []
        for alg in ALGORITHMS:
            ms = [1e3 * t for t in times[alg]]
            cells.append(f"{statistics.median(ms):7.2f} ({min(ms):5.1f}-{max(ms):5.1f})")
        m, k, n = SIZES[size]
        print(f"{op:<22} {size + ' ' + str((m, k, n)):<20} " + " ".join(f"{c:>18}" for c in cells))
    for (op, size), times in results.items():
        van = statistics.median(times["vanilla"])
        ratios = ", ".join(f"{a} {van / statistics.median(times[a]):.2f}x" for a in ALGORITHMS[1:])
        print(f"speed-up over vanilla, {op} {size}: {ratios}")
    soft = over["soft"]
    xs = sorted(soft)
    slope = (soft[xs[-1]] - soft[xs[0]]) / (xs[-1] - xs[0])
    intercept = soft[xs[0]] - slope * xs[0]
    print("executor overhead, tiny 4x4 tensors, transfers removed (compute_only): "
          + ", ".join(f"{k} steps {1e6 * v:.0f} us" for k, v in sorted(soft.items()))
          + f" -> {1e6 * slope:.0f} us per step (target < 100 us) + {1e6 * intercept:.0f} us per call")
    raw, fused = statistics.median(over["raw"]), statistics.median(over["fused"])
    print(f"with real transfers ({steps} steps, {steps - 1} transfer): ring op {1e6 * fused:.0f} us vs the same "
          f"transfers and matmuls posted directly {1e6 * raw:.0f} us: {1e6 * (fused - raw) / steps:.0f} us per step")


if __name__ == "__main__":
    main()
