"""Soak: 2000 iterations each of all_gather_matmul and matmul_reduce_scatter; memory must stop growing.

Prints, every 250 iterations on rank 0, the resident memory (from
/proc/self/statm), the number of live torch tensors and of live transfer
handles (``commfuse.runtime.c10d._Handle``; a leaked handle would keep its
buffers alive) as the garbage collector sees them. After the warm-up the
figures must stay flat; the last line says whether they did.

    python benchmarks/soak.py [--iterations 2000] [--algorithm ring]
"""

from __future__ import annotations

import argparse
import gc
import os


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _soak(rank, n, iterations, algorithm, every):
    import torch

    import commfuse as cf
    from commfuse.runtime.c10d import _Handle

    a = torch.randn(128, 256)
    b = torch.randn(256, 256)
    big = torch.randn(128 * n, 256)
    rows = []
    for i in range(1, iterations + 1):
        cf.all_gather_matmul(a, b, algorithm=algorithm)
        cf.matmul_reduce_scatter(big, b, algorithm=algorithm)
        if i % every == 0 or i == 1:
            rss = _rss_mib()  # read before the census below allocates its own lists
            gc.collect()
            objects = gc.get_objects()
            tensors = sum(1 for o in objects if isinstance(o, torch.Tensor))
            handles = sum(1 for o in objects if isinstance(o, _Handle))
            del objects
            rows.append((i, rss, tensors, handles))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--algorithm", default="ring")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--every", type=int, default=250)
    args = p.parse_args()
    from commfuse.launch import launch

    out = launch(_soak, args.world_size, args.iterations, args.algorithm, args.every, timeout=3600)
    print(f"soak: {args.iterations} x (all_gather_matmul + matmul_reduce_scatter), algorithm {args.algorithm}, "
          f"{args.world_size} gloo ranks")
    for rank, rows in enumerate(out):
        print(f"rank {rank}: {'iteration':>9} {'RSS MiB':>9} {'live tensors':>13} {'live handles':>13}")
        for i, rss, tensors, handles in rows:
            print(f"rank {rank}: {i:>9} {rss:>9.1f} {tensors:>13} {handles:>13}")
        warm = [r for r in rows if r[0] >= args.iterations // 4]
        rss_growth = warm[-1][1] - warm[0][1]
        tensor_growth = warm[-1][2] - warm[0][2]
        flat = rss_growth < 2.0 and tensor_growth <= 0 and warm[-1][3] == 0
        print(f"rank {rank}: after warm-up (iteration {warm[0][0]} -> {warm[-1][0]}): RSS {rss_growth:+.1f} MiB, "
              f"live tensors {tensor_growth:+d}, live handles at the end {warm[-1][3]} -> "
              f"{'flat' if flat else 'GROWING'}")


if __name__ == "__main__":
    main()
