"""Print how long building a schedule and giving one rank its steps take, up to 4096 ranks.

Design target: one rank's steps for 4096 ranks in well under
50 ms. ``steps(rank)`` rotates the template to the rank's ring position, so it
is O(steps); ``build`` also proves the schedule by symbolic execution
(rotation argument; exhaustively per rank up to 32 ranks).

    python benchmarks/schedule_build.py [--world-sizes 64 512 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

from commfuse.schedule import ALGORITHMS, build


def _time(fn, repeats: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), max(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[64, 512, 4096])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"{'collective':<15} {'algorithm':<14} {'world':>6} {'steps':>6} {'build+validate ms':>18} "
          f"{'steps(rank) ms':>15} {'(max)':>7}")
    worst = 0.0
    for collective, algorithms in ALGORITHMS.items():
        for algorithm in algorithms:
            for n in args.world_sizes:
                t0 = time.perf_counter()
                s = build(collective, n, algorithm=algorithm)
                built = (time.perf_counter() - t0) * 1e3
                rank = n // 3 + 1 if n > 1 else 0  # not rank 0, whose steps are the template itself
                med, mx = _time(lambda: s.steps(rank), args.repeats)
                if n == max(args.world_sizes):
                    worst = max(worst, med)
                print(f"{collective.value:<15} {algorithm.value:<14} {n:>6} {s.num_steps:>6} {built:>18.1f} "
                      f"{med:>15.2f} {mx:>7.2f}")
    print(f"slowest steps(rank) at {max(args.world_sizes)} ranks: {worst:.1f} ms (target: well under 50 ms)")


if __name__ == "__main__":
    main()
