"""Host cost of a repeated forward of modules that are commfuse sites: styled ``nn.Linear`` layers, a stack of
identical Llama blocks under commfuse's block styles, and ``commfuse.nn`` layers.

Tier: benchmark (prints figures, asserts nothing). torch's ``fake`` process group makes this one process
rank 0 of N (every transfer completes at once, no data moves) and the sizes are tiny, so what is timed is
the Python and dispatch of each forward on the host: the sites' own entry and exit (``commfuse.runtime.sites``)
among them. Each figure is the median over ``--rounds`` rounds of the mean over ``--calls`` forwards under
``no_grad``, after warm-up forwards of every module (so every site has named itself and watched a forward,
and the sites and the fused ops' fast path run their plain code again: the last column says whether they
did before the timing). Columns:

- ``styled linears``: ``ColwiseParallel`` (input ``Shard(1)``) then ``RowwiseParallel`` (output ``Shard(1)``)
  on two ``nn.Linear``: two sites, two fused calls;
- ``4 llama blocks``: four ``commfuse.models.llama`` blocks under ``commfuse_plan()`` (one plan applied to each
  block), called from the model's forward: eight sites, sixteen fused calls;
- ``ParallelMLP x2``: two ``commfuse.nn.ParallelMLP``: four sites, four fused calls;
- ``linears, idle``: the styled linears again while one more styled ``nn.Linear`` exists that never runs: a
  site due to watch that never does, so every site checks at each forward whether it is due.

Then the Python calls cProfile counts in one forward of each (the same from run to run of one tree, so two
trees' code is compared without the machine's noise), and a site's entry and exit on its own (``with
at_site(site): pass``, the plain methods, and the watching ones with the site not due).

Compare code versions by running it on each, alternating (``PYTHONPATH`` pointing at the other tree)::

    python benchmarks/site_overhead.py [--world-sizes 2 8] [--rounds 15] [--calls 100]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from _timing import per_call


class _Blocks(nn.Module):
    def __init__(self, count: int) -> None:
        from commfuse.models.llama import Block

        super().__init__()
        self.layers = nn.ModuleList(Block(dim=64, n_heads=8, n_kv_heads=8, ffn=128) for _ in range(count))

    def forward(self, x, cache):
        for layer in self.layers:
            x = layer(x, cache)
        return x


def _plain() -> str:
    """Whether the sites and the fast path run their plain code ("yes"), or some site is due to watch."""
    from commfuse import ops
    from commfuse.planning import table
    from commfuse.runtime import sites

    door = sites.at_site
    plain = getattr(door, "_enter", door.__enter__) is door.__enter__ and ops._planned is table.get
    return "yes" if plain else "no"


def _python_calls(fn) -> int:
    """The Python and C calls cProfile counts in one call of ``fn``."""
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return pstats.Stats(profile).total_calls


def _entry_and_exit(rounds: int, times: int = 20000) -> None:
    """``with at_site(site): pass``, the plain methods and (where the tree has them) the watching ones with the
    site not due: what a site's forward pays for being one, besides the forward's own code."""
    from commfuse.runtime import sites

    module = nn.Linear(2, 2)
    try:
        site = sites.Site("bench", None, None, 2, "bench", module)
    except TypeError:  # a tree whose sites take no module
        site = sites.Site("bench", None, None, 2, "bench")
    door = sites.at_site
    with door(site):  # its first forward: it watches, then nothing is due
        pass

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(times):
            with door(site):
                pass
        return (time.perf_counter() - t0) / times * 1e9

    kinds = {"plain": [], "watching, not due": []} if hasattr(sites, "_arm") else {"plain": []}
    for r in range(rounds):
        for kind in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
            if kind == "watching, not due":
                sites._arm()
            kinds[kind].append(timed())
            if kind == "watching, not due":
                with sites._lock:
                    sites._disarm()
    print(f"\na site's entry and exit (with at_site(site): pass), ns, median of {rounds} rounds of {times}: "
          + ", ".join(f"{kind} {statistics.median(v):.0f}" for kind, v in kinds.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # the ops' fingerprint exchange off: the fake group's peers return no fingerprint
    os.environ["COMMFUSE_CHECK"] = "0"

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from commfuse.models.llama import commfuse_plan, rope_cache
    from commfuse.nn import ParallelMLP
    from commfuse.tp import ColwiseParallel, RowwiseParallel

    print(f"host us per forward (no_grad), fake process group, rank 0 of N, median of {args.rounds} rounds x "
          f"{args.calls} forwards")
    print(f"{'N':>3}  {'styled linears':>14}  {'4 llama blocks':>14}  {'ParallelMLP x2':>14}  {'linears, idle':>14}"
          f"  {'plain code':>10}")
    counts = []
    for n in args.world_sizes:
        dist.init_process_group("fake", rank=0, world_size=n, store=FakeStore())
        try:
            tp = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
            torch.manual_seed(0)
            linears = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
            parallelize_module(linears, tp, {"0": ColwiseParallel(input_layouts=Shard(1)),
                                             "1": RowwiseParallel(output_layouts=Shard(1))})
            blocks = _Blocks(4)
            plan = commfuse_plan()
            for block in blocks.layers:
                parallelize_module(block, tp, plan)
            mlps = nn.Sequential(ParallelMLP(64, 128, group=tp), ParallelMLP(64, 128, group=tp))
            x = torch.randn(2, 2, 64)  # this rank's sequence shard: 2 rows of 2N
            cache = rope_cache(8, 2 * n)

            def run(fn):
                def once():
                    with torch.no_grad():
                        fn()
                return once

            rows = [run(lambda: linears(x)), run(lambda: blocks(x, cache)), run(lambda: mlps(x))]
            for _ in range(3):  # every site runs (each names itself and watches what was planned) before timing
                for fn in rows:
                    fn()
            plain = _plain()
            counts.append((n, [_python_calls(fn) for fn in rows]))
            row = [per_call(fn, args.calls, args.rounds, warmup=5) for fn in rows]
            # one more site that never runs: the others check, at each forward, whether they are due
            idle = parallelize_module(nn.Linear(64, 128), tp, ColwiseParallel(input_layouts=Shard(1)))
            row.append(per_call(rows[0], args.calls, args.rounds, warmup=5))
            del idle, linears, blocks, block, mlps
            gc.collect()  # the modules hold their sites in reference cycles: the next world size starts clean
            print(f"{n:>3}  " + "  ".join(f"{1e6 * v:>14.1f}" for v in row) + f"  {plain:>10}")
        finally:
            dist.destroy_process_group()
    print("\nPython calls per forward (cProfile; the same on every run of one tree):")
    for n, row in counts:
        print(f"{n:>3}  " + "  ".join(f"{v:>14d}" for v in row))
    _entry_and_exit(args.rounds)


if __name__ == "__main__":
    main()
