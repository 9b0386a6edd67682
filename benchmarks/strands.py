"""Two strands against one: ``commfuse bench -w strands`` (``commfuse.bench.strands``) under this script's
historical flags.

Tier: benchmark (prints figures, asserts nothing; exits non-zero where a row's losses or gradients differ
from ``ring``'s). Two micro-batches of each block (the Llama block at TP 2, the MoE block at EP 2 where
``commfuse.models.moe_stages`` is installed), forward + backward, rows interleaved per repeat:

- ``vanilla``: micro-batches one after the other, each op its library collective then its GEMM;
- ``ring``: micro-batches one after the other, each op commfuse's ring (today's commfuse);
- ``strands naive``: micro-batch 2's forward stages beside micro-batch 1's backward stages, k with k;
- ``strands searched``: the same, paired and ordered by the plan search over the stages' measured figures
  (``commfuse.strands.profile``: compute-only and comm-only runs of each stage's forward, rank 0's).

Each row is printed with the simulator's prediction, its speed-up over ``ring``, its ratio to the limit
max(compute, comm), its peak memory against ``ring``'s, and the regime (ring's comm-only / compute-only).

Run it on a shaped link (root; the bench re-executes itself in a private network namespace)::

    python benchmarks/strands.py --link-rate 700mbit
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--link-rate", help="shape the ranks' loopback to RATE (tc units; needs root)")
    args = parser.parse_args()
    from commfuse.cli import main as cli

    argv = ["bench", "-w", "strands", "--hidden", str(args.hidden), "--heads", str(args.heads), "--ffn",
            str(args.ffn), "--seq", str(args.seq), "--batch", str(args.batch), "--repeats", str(args.repeats)]
    if args.link_rate:
        argv += ["--link-rate", args.link_rate]
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
