"""How long a failure on one rank takes to reach every rank, and what each rank is told.

Tier: benchmark (prints figures, asserts nothing). Runs the one-rank cases of
``tests/distributed/test_one_rank_gloo.py`` (the same rank-side bodies, in
``tests/distributed/_one_rank_cases.py``) on real gloo ranks and prints, per
case: the ranks, the longest time any rank's failing call took to end (the
peers of the failing rank: "told after"), what the failing rank raised, and
what a told peer raised (its first line). Every op runs with a 30 s
timeout; a peer told through the group's board ends in about the grace
period (``COMMFUSE_GRACE_S``, 0.5 s), and before the board it waited out
the timeout, or hung, or returned a wrong result.

    python benchmarks/one_rank_failures.py [--cases NAME ...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
import _one_rank_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402



def _failing(out):
    """Per rank: (kind, first line, seconds) of the failing call, from a body's result."""
    rows = []
    for o in out:
        first = o[0] if isinstance(o, tuple) and isinstance(o[0], tuple) else o
        kind, message, seconds = first[0], str(first[1]), first[2]
        rows.append((kind, message.strip().splitlines()[0] if message.strip() else "", seconds))
    return rows


def _cases(tmp: Path):
    bad = tmp / "broken.toml"  # a shipped profile with a latency no link has
    shipped = (Path(__file__).resolve().parents[1] / "commfuse" / "sim" / "profiles" / "h100-sxm.toml").read_text()
    bad.write_text(re.sub(r"(?m)^latency = .*$", "latency = 1e308", shipped))
    return {
        "producer raises mid-ring (produce_reduce_scatter, ring)":
            (cases.producer_raises, 3, ("produce_reduce_scatter", "ring", "later"), {}),
        "producer raises mid-ring (produce_all_to_all, ring)":
            (cases.producer_raises, 3, ("produce_all_to_all", "ring", "later"), {}),
        "producer raises on its first partial (produce_reduce_scatter, ring)":
            (cases.producer_raises, 3, ("produce_reduce_scatter", "ring", "first"), {}),
        "producer raises mid-call (produce_reduce_scatter, vanilla)":
            (cases.producer_raises, 3, ("produce_reduce_scatter", "vanilla", "later"), {}),
        "consumer raises on its own shard (all_gather_consume, ring)":
            (cases.consumer_raises, 3, ("ring", "own"), {}),
        "consumer raises after its transfers (all_gather_consume, ring)":
            (cases.consumer_raises, 3, ("ring", "last"), {}),
        "an expert raises mid-dispatch (MoE, ring)": (cases.expert_raises, 2, ("ring",), {}),
        "attention raises mid-ring (ParallelAttention)": (cases.attention_raises, 3, (), {}),
        "auto's policy fails (a broken profile on one rank)": (cases.broken_profile, 3, (str(bad),), {}),
        "a new signature after 20 matching calls": (cases.new_signature_later, 2, (20,), {}),
        "a straggler 8 s late, 3 s timeout": (cases.straggler, 3, (8.0, 3.0), {}),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="*", help="substrings of the case names to run (default: all)")
    p.add_argument("--repeats", type=int, default=3, help="runs per case; the median is printed (default 3)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        table = _cases(Path(tmp))
        for name, (body, n, extra, env) in table.items():
            if args.cases and not any(c in name for c in args.cases):
                continue
            told, last = [], None
            for _ in range(args.repeats):
                rows = _failing(launch(body, n, *extra, env=env, timeout=300, allow_failures=True))
                peers = [r for rank, r in enumerate(rows) if rank != 1]
                told.append(max(seconds for _, _, seconds in peers))
                last = rows
            print(f"{name}\n  {n} ranks; every rank's failing call ended within {statistics.median(told):.2f} s "
                  f"(median of {args.repeats}; runs: {', '.join(f'{t:.2f}' for t in told)})")
            for rank, (kind, line, seconds) in enumerate(last):
                print(f"  rank {rank}: {kind} after {seconds:.2f} s: {line[:220]}")
        kind, latency = launch(cases.interrupted, 2, 1.0, 8.0, timeout=120)[0]
        print(f"Ctrl-C during a wait (the peer 8 s late)\n  rank 0: {kind} {latency:.3f} s after SIGINT")
        counts = launch(cases.two_threads, 3, 30, timeout=600)
        print("two threads sharing a group, 30 calls each, 3 ranks\n  "
              + "; ".join(f"rank {r}: {c['right']} right, {c['wrong']} wrong, {c['named']} named errors"
                          for r, c in enumerate(counts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
