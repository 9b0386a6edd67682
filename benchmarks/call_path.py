"""How many commfuse source files one eager ring call passes through, and which.

Tier: benchmark (prints figures, asserts nothing). torch's ``fake`` process group makes this one process rank 0
of N (transfers complete at once). A warm-up call of another shape finds the backend first; then cProfile
records two calls of ``all_gather_matmul(x, w, group=g, algorithm="ring", check=False)``: the first call of a new
signature (which plans it) and a repeated call (which finds its entry in the planning table). A file counts
when any function defined in it ran during the call.

    python benchmarks/call_path.py [--world-size 2] [--show]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from pathlib import Path

import torch
import torch.distributed as dist


def _files(profile: cProfile.Profile, root: Path) -> list[str]:
    stats = pstats.Stats(profile)
    found = set()
    for filename, _line, _name in stats.stats:  # type: ignore[attr-defined]
        path = Path(filename)
        if path.is_absolute() and root in path.parents:
            found.add(str(path.relative_to(root.parent)))
    return sorted(found)


def _profiled(call) -> cProfile.Profile:
    profile = cProfile.Profile()
    profile.enable()
    call()
    profile.disable()
    return profile


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--show", action="store_true", help="list the files")
    args = parser.parse_args(argv)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import commfuse
    from commfuse import ops

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:
        group = dist.group.WORLD
        root = Path(commfuse.__file__).resolve().parent
        warm_x, warm_w = torch.randn(4, 8), torch.randn(8, 8)
        # check=False: the fake group moves no data, so the ranks cannot compare fingerprints
        ops.all_gather_matmul(warm_x, warm_w, group=group, algorithm="ring", check=False)  # finds the backend
        x, w = torch.randn(6, 16), torch.randn(16, 8)
        first = _files(_profiled(lambda: ops.all_gather_matmul(x, w, group=group, algorithm="ring", check=False)), root)
        again = _files(_profiled(lambda: ops.all_gather_matmul(x, w, group=group, algorithm="ring", check=False)), root)
        print(f"commfuse source files one eager ring all_gather_matmul passes through (fake group, rank 0 of "
              f"{args.world_size}, after a warm-up call of another shape):")
        print(f"  first call of a new signature: {len(first)}")
        print(f"  repeated call:                 {len(again)}")
        if args.show:
            print("first call:", *first, sep="\n    ")
            print("repeated call:", *again, sep="\n    ")
    finally:
        commfuse.backends.release()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
