"""Group churn: process groups made, called once and destroyed without ``commfuse.backends.release()``.

Tier: benchmark (prints figures, asserts nothing). Each cycle is ``new_group``, one
``all_gather_matmul`` on it and torch's ``destroy_process_group(group)``, on gloo ranks. Rank 0 prints,
every ``--every`` cycles, what it holds: file descriptors (``/proc/self/fd``), Python threads
(``threading.active_count()``), native threads (``/proc/self/task``) and resident memory, each counted
just after a destroy. A destroyed group that something still held would add its connections and gloo's
threads to every line; the last line gives the first and last counts side by side.

    python benchmarks/group_churn.py [--cycles 1000] [--every 100] [--world-size 2]

Run it with ``PYTHONPATH`` pointing at another checkout to count that checkout's package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _churn(rank, n, cycles, every):
    import torch
    import torch.distributed as dist

    import commfuse as cf

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "distributed"))
    from _group_release_cases import held

    torch.set_num_threads(1)
    x, w = torch.ones(4, 8), torch.ones(8, 3)
    rows = []
    for i in range(1, cycles + 1):
        group = dist.new_group(list(range(n)))
        cf.all_gather_matmul(x, w, group=group, algorithm="ring")
        dist.destroy_process_group(group)
        if i == 1 or i % every == 0:
            rows.append((i, held()))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=1000)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args()
    import commfuse
    from commfuse.launch import launch

    out = launch(_churn, args.world_size, args.cycles, args.every, timeout=3600)
    print(f"group churn: {args.cycles} x (new_group, all_gather_matmul, destroy_process_group), "
          f"{args.world_size} gloo ranks, commfuse from {Path(commfuse.__file__).parent.parent.name}")
    print(f"{'cycle':>6} {'fds':>6} {'threads':>8} {'tasks':>6} {'RSS MiB':>8}")
    for i, h in out[0]:
        print(f"{i:>6} {h['fds']:>6} {h['threads']:>8} {h['tasks']:>6} {h['rss'] / 2**20:>8.1f}")
    (i0, first), (i1, last) = out[0][0], out[0][-1]
    print(f"first (cycle {i0}) -> last (cycle {i1}): fds {first['fds']} -> {last['fds']}, threads "
          f"{first['threads']} -> {last['threads']}, tasks {first['tasks']} -> {last['tasks']}, RSS "
          f"{first['rss'] / 2**20:.1f} -> {last['rss'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
