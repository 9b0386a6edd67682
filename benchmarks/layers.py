"""Forward+backward time of the TPSP MLP per algorithm on 2 ranks, and peak memory of ShardedLinear vs nn.Linear.

    python benchmarks/layers.py [--repeats 10] [--tokens 2048] [--hidden 1024]

Time: ParallelMLP (column-parallel up, GELU, row-parallel down) forward and
backward, every algorithm interleaved repeat by repeat, median over repeats,
with the speed-up over vanilla. Memory: one forward+backward of a 4096 x 4096
fp32 layer in a fresh group per variant; the figure is the growth of
each rank's peak resident memory (``ru_maxrss``) from before the layer is
built to after the backward, so it counts parameters, gradients and every
transient buffer; 2, 4 and 8 ranks (the saving grows with the group: a
reduce-scatter needs about three shard-sized buffers in flight whatever N).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

ALGORITHMS = ["vanilla", "sliced:2", "sliced:4", "ring", "bidirectional", "auto"]


def _mlp(rank, n, repeats, tokens, hidden):
    import torch
    import torch.distributed as dist

    from commfuse.nn import ParallelMLP

    torch.manual_seed(0)
    mlp = ParallelMLP(hidden, 4 * hidden)
    x = torch.randn(1, tokens // n, hidden, requires_grad=True)
    times = {a: [] for a in ALGORITHMS}

    def step(alg):
        mlp.algorithm = alg
        out = mlp(x)
        out.sum().backward()
        return out

    ref = step("vanilla").detach()
    for alg in ALGORITHMS:
        assert torch.allclose(step(alg).detach(), ref, rtol=1e-4, atol=1e-4), alg
    for _ in range(repeats):
        for alg in ALGORITHMS:
            dist.barrier()
            t0 = time.perf_counter()
            step(alg)
            times[alg].append(time.perf_counter() - t0)
    return times


def _memory(rank, n, variant, size):
    import torch
    from torch import nn

    from commfuse.nn import ShardedLinear

    torch.manual_seed(0)
    x = torch.randn(256, size)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if variant != "replicated":
        layer = ShardedLinear(size, size, algorithm=variant)
    else:
        layer = nn.Linear(size, size)
    layer(x).sum().backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (after - before) / 1024  # MiB (ru_maxrss is in KiB on Linux)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tokens", type=int, default=2048, help="sequence length (all ranks together)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--memory-size", type=int, default=4096)
    args = p.parse_args()
    from commfuse.launch import launch

    times = launch(_mlp, 2, args.repeats, args.tokens, args.hidden, timeout=3600)[0]
    print(f"ParallelMLP forward+backward, 2 gloo ranks (plain loopback), tokens {args.tokens}, hidden {args.hidden}, "
          f"ffn {4 * args.hidden}; median (min-max) ms over {args.repeats} interleaved repeats, rank 0")
    van = statistics.median(times["vanilla"])
    for alg in ALGORITHMS:
        ms = [1e3 * t for t in times[alg]]
        print(f"  {alg:<14} {statistics.median(ms):8.1f} ({min(ms):.1f}-{max(ms):.1f})   "
              f"{van / statistics.median(times[alg]):.2f}x vs vanilla")
    size = args.memory_size
    full = size * size * 4 / 2**20
    print(f"peak memory growth for one forward+backward of a {size}x{size} fp32 layer (weight {full:.0f} MiB, "
          f"so weight + gradient = {2 * full:.0f} MiB replicated), per rank (max over ranks):")
    for n in (2, 4, 8):
        cells = []
        for variant in ("replicated", "ring", "vanilla"):
            mib = max(launch(_memory, n, variant, size, timeout=600))
            label = "nn.Linear" if variant == "replicated" else f"ShardedLinear {variant}"
            cells.append(f"{label} +{mib:.0f} MiB")
        print(f"  {n} ranks: " + "; ".join(cells))


if __name__ == "__main__":
    main()
