"""How many commfuse source files and functions one eager ring call passes through, and which, on torch's
``fake`` group and on real gloo ranks.

Tier: benchmark (prints figures, asserts nothing). On the ``fake`` process group this one process is rank 0 of
N (transfers complete at once, nothing is checked); on gloo, ``--world-size`` ranks run the same calls and rank
0 reports (its waits are real, and a signature's first call checks its fingerprint with the peers). In each, a
warm-up call of another shape finds the backend first; then cProfile records two calls of
``all_gather_matmul(x, w, group=g, algorithm="ring")``: the first call of a new signature (which plans it) and
a repeated call (which finds its entry in the planning table). A file counts when any function defined in it
ran during the call; a function counts once however often it ran.

    python benchmarks/call_path.py [--world-size 2] [--show]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from pathlib import Path

import torch
import torch.distributed as dist


def _route(profile: cProfile.Profile, root: Path) -> tuple[list[str], list[str]]:
    """The commfuse files and functions (``file:function``) that ran under ``profile``."""
    stats = pstats.Stats(profile)
    files, functions = set(), set()
    for filename, _line, name in stats.stats:  # type: ignore[attr-defined]
        path = Path(filename)
        if path.is_absolute() and root in path.parents:
            where = str(path.relative_to(root.parent))
            files.add(where)
            functions.add(f"{where}:{name}")
    return sorted(files), sorted(functions)


def _profiled(call) -> cProfile.Profile:
    profile = cProfile.Profile()
    profile.enable()
    call()
    profile.disable()
    return profile


def _two_calls(group, check) -> dict:
    """The first and the repeated call's files and functions, after a warm-up of another shape."""
    import commfuse
    from commfuse import ops

    root = Path(commfuse.__file__).resolve().parent
    warm_x, warm_w = torch.randn(4, 8), torch.randn(8, 8)
    ops.all_gather_matmul(warm_x, warm_w, group=group, algorithm="ring", check=check)  # finds the backend
    x, w = torch.randn(6, 16), torch.randn(16, 8)
    first = _route(_profiled(lambda: ops.all_gather_matmul(x, w, group=group, algorithm="ring", check=check)), root)
    again = _route(_profiled(lambda: ops.all_gather_matmul(x, w, group=group, algorithm="ring", check=check)), root)
    return {"first": first, "repeated": again}


def _gloo(rank: int, n: int) -> dict:
    torch.set_num_threads(1)
    return _two_calls(dist.group.WORLD, None)


def _print(where: str, route: dict, show: bool) -> None:
    print(f"{where}, after a warm-up call of another shape: files, functions")
    for name in ("first", "repeated"):
        files, functions = route[name]
        label = "first call of a new signature" if name == "first" else "repeated call"
        print(f"  {label + ':':31s}{len(files):3d} files, {len(functions):4d} functions")
    if show:
        for name in ("first", "repeated"):
            print(f"  {name} call:", *route[name][0], sep="\n    ")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--show", action="store_true", help="list the files")
    args = parser.parse_args(argv)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import commfuse
    from commfuse.launch import launch

    torch.set_num_threads(1)
    print("commfuse source files and functions one eager ring all_gather_matmul passes through")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:  # check=False: the fake group moves no data, so the ranks cannot compare fingerprints
        _print(f"fake group, rank 0 of {args.world_size}", _two_calls(dist.group.WORLD, False), args.show)
    finally:
        commfuse.backends.release()
        dist.destroy_process_group()
    _print(f"gloo, rank 0 of {args.world_size}", launch(_gloo, args.world_size)[0], args.show)


if __name__ == "__main__":
    main()
