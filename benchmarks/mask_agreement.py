"""Per-call wall time of the ranks' comparison of document lengths, on real gloo ranks.

Tier: benchmark (prints figures, asserts nothing). ``host_overhead.py`` and
``call_instructions.py`` run on torch's ``fake`` group, whose exchanges carry
nothing, so the digest exchange that ``commfuse.ring_attention`` makes on every
call with ``document_lengths`` (``commfuse.planning.agreement.agree_shared``) is
skipped there; this times it where it runs. Rows, per rank (median over
``--blocks`` alternating blocks of ``--calls`` calls, tiny tensors: causal, 2
heads, 4 positions a rank):

- ``plain``: ``ring_attention`` without documents;
- ``documents``: with two documents, the ranks' lengths compared (their digest
  rides the K/V ring's transfers on gloo; an exchange of its own in a checkout
  from before that);
- ``documents unchecked``: the same on a second group of the same ranks whose
  calls were planned under ``COMMFUSE_CHECK=0``, which compares nothing: the
  difference to ``documents`` is what the comparison costs;
- ``exchange alone``: ``agree_shared`` by itself (one all-gather of 16 bytes a
  rank through commfuse);
- ``torch all_gather 16 B``: torch's own all-gather of 16 bytes a rank, the
  floor of one exchange on this transport.

    python benchmarks/mask_agreement.py [--world-size 2] [--blocks 25] [--calls 20]
        [--positions 4] [--heads 2] [--head-dim 8]

Run it with ``PYTHONPATH`` pointing at another checkout to time that checkout
(one without ``agree_shared`` prints no ``exchange alone`` row).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _body(rank: int, n: int, blocks: int, calls: int, positions: int = 4, heads: int = 2,
          head_dim: int = 8) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import commfuse as cf

    torch.set_num_threads(1)
    q, kv = torch.randn(1, positions, heads, head_dim), torch.randn(1, positions, heads, head_dim)
    half = positions * n // 2
    docs = [half, positions * n - half]
    unchecked = dist.new_group(list(range(n)))
    rows = {"plain": lambda: cf.ring_attention(q, kv, kv, algorithm="ring"),
            "documents": lambda: cf.ring_attention(q, kv, kv, algorithm="ring", document_lengths=docs),
            "documents unchecked": lambda: cf.ring_attention(q, kv, kv, algorithm="ring", document_lengths=docs,
                                                             group=unchecked)}
    before = os.environ.get("COMMFUSE_CHECK")
    os.environ["COMMFUSE_CHECK"] = "0"  # the second group's plans are made (and kept) without the comparison
    try:
        rows["documents unchecked"]()
    finally:
        if before is None:
            del os.environ["COMMFUSE_CHECK"]
        else:
            os.environ["COMMFUSE_CHECK"] = before
    try:
        from commfuse.planning.agreement import agree_shared
    except ImportError:  # a checkout from before the comparison
        pass
    else:
        rows["exchange alone"] = lambda: agree_shared(None, "the benchmark's digest", 1, list, label="benchmark")
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out, mine = torch.zeros(2 * n, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    rows["torch all_gather 16 B"] = lambda: gather(out, mine)
    for fn in rows.values():
        for _ in range(calls):
            fn()
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(blocks):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=25)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--positions", type=int, default=4, help="positions a rank (default 4: tiny)")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=8)
    args = parser.parse_args(argv)
    from commfuse.launch import launch

    print(f"us per call, {args.world_size} gloo ranks, (1, {args.positions}, {args.heads}, {args.head_dim}) a rank, "
          f"median of {args.blocks} blocks x {args.calls} calls")
    for rank, res in enumerate(launch(_body, args.world_size, args.blocks, args.calls, args.positions, args.heads,
                                      args.head_dim)):
        print(f"  rank {rank}: " + ", ".join(f"{name} {us:.1f}" for name, us in res.items()))
        print(f"  rank {rank}: documents / documents unchecked = {res['documents'] / res['documents unchecked']:.3f}")


if __name__ == "__main__":
    main()
