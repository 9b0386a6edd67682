"""How many commfuse source files and functions one eager ring call passes through, and which, on torch's
``fake`` group and on real gloo ranks.

Tier: benchmark (prints figures, asserts nothing). On the ``fake`` process group this one process is rank 0 of
N (transfers complete at once, nothing is checked); on gloo, ``--world-size`` ranks run the same calls and rank
0 reports (its waits are real, and a signature's first call checks its fingerprint with the peers). In each, a
warm-up call of another shape finds the backend first; then cProfile records two calls of
``all_gather_matmul(x, w, group=g, algorithm="ring")``: the first call of a new signature (which plans it) and
a repeated call (which finds its entry in the planning table). A file counts when any function defined in it
ran during the call; a function counts once however often it ran.

The first call's route: the modules in the order the call stays in them (a stay ends when a call or a return
moves to another commfuse module; calls into torch do not end it), and three counts that say whether it
descends once:
- ``returns to a module left``: stays in a module the route had already stayed in and left by a call (a return
  to the caller is not counted: coming back up the stack is how a descent ends);
- ``calls up a layer``: calls from a module into one of a higher layer of ``.importlinter``'s layers contract
  (a callback: the runtime running the op's compute on a slice, say);
- ``calls back into the stack``: calls into a module that is already on the call stack below another module.

    python benchmarks/call_path.py [--world-size 2] [--show] [--route]
"""

from __future__ import annotations

import argparse
import configparser
import cProfile
import pstats
import sys
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


def _layers(root: Path) -> list[list[str]]:
    """``.importlinter``'s layers contract, top first: each layer's module names (``commfuse.`` dropped)."""
    parser = configparser.ConfigParser()
    parser.read(root.parent / ".importlinter")
    lines = parser["importlinter:contract:layers"]["layers"].split("\n")
    return [[m.strip().removeprefix("commfuse.") for m in line.replace(":", "|").split("|")]
            for line in lines if line.strip()]


def _layer_of(module: str, layers: list[list[str]]) -> int:
    """The index (0 = top) of ``module``'s layer: the layer of its longest listed prefix."""
    best, index = -1, len(layers)
    for i, names in enumerate(layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, index = len(name), i
    return index


def _traced_route(call, root: Path) -> list[tuple[str, str]]:
    """The commfuse modules ``call`` moves between, as (how, module) per change: how is "call" or "return"."""
    moves: list[tuple[str, str]] = []
    names: dict[str, str | None] = {}

    def module_of(frame) -> str | None:
        filename = frame.f_code.co_filename
        name = names.get(filename, "")
        if name == "":
            path = Path(filename)
            name = None
            if path.is_absolute() and root in path.parents:
                name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            names[filename] = name
        return name

    def profile(frame, event, _arg):
        if event == "call":
            where = module_of(frame)
        elif event == "return" and frame.f_back is not None:
            where = module_of(frame.f_back)
        else:
            return
        if where is not None and (not moves or moves[-1][1] != where):
            moves.append((event, where))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return moves


def _route_counts(moves: list[tuple[str, str]], layers) -> dict:
    """The route's stays and how often it bounced (see the module docstring), counted apart while it plans
    (before its first call into ``runtime.walks``) and while the ring runs (where the runtime calls the op's
    compute on each slice: calls up a layer by design)."""
    kinds = ("returns to a module left", "calls up a layer", "calls back into the stack")
    counts = {phase: dict.fromkeys(kinds, 0) for phase in ("planning", "running")}
    left, stack, phase = set(), [], "planning"
    for i, (how, module) in enumerate(moves):
        before = moves[i - 1][1] if i else None
        if how == "call":
            if module == "runtime.walks":
                phase = "running"
            if before is not None:
                left.add(before)
                if _layer_of(module, layers) < _layer_of(before, layers):
                    counts[phase]["calls up a layer"] += 1
            if module in stack:
                counts[phase]["calls back into the stack"] += 1
            if module in left:
                counts[phase]["returns to a module left"] += 1
            stack.append(module)
        else:
            while stack and stack[-1] != module:
                stack.pop()
    counts["stays"] = len(moves)
    counts["modules"] = len({m for _, m in moves})
    return counts


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
    y = torch.randn(10, 16)  # another new signature, for the route
    moves = _traced_route(lambda: ops.all_gather_matmul(y, w, group=group, algorithm="ring", check=check), root)
    return {"first": first, "repeated": again, "route": moves, "counts": _route_counts(moves, _layers(root))}


def _gloo(rank: int, n: int) -> dict:
    torch.set_num_threads(1)
    return _two_calls(dist.group.WORLD, None)


def _print(where: str, route: dict, show: bool, show_route: bool = False) -> None:
    print(f"{where}, after a warm-up call of another shape: files, functions")
    for name in ("first", "repeated"):
        files, functions = route[name]
        label = "first call of a new signature" if name == "first" else "repeated call"
        print(f"  {label + ':':31s}{len(files):3d} files, {len(functions):4d} functions")
    counts = route["counts"]
    print(f"  first call's route: {counts['stays']} stays in {counts['modules']} modules")
    for phase in ("planning", "running"):
        print(f"    {phase + ':':10s}" + ", ".join(f"{k} {v}" for k, v in counts[phase].items()))
    if show:
        for name in ("first", "repeated"):
            print(f"  {name} call:", *route[name][0], sep="\n    ")
    if show_route:
        print("  first call's route (-> a call, <- a return):")
        line = "    "
        for how, module in route["route"]:
            step = ("-> " if how == "call" else "<- ") + module + "  "
            if len(line) + len(step) > 116:
                print(line.rstrip())
                line = "    "
            line += step
        print(line.rstrip())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--show", action="store_true", help="list the files")
    parser.add_argument("--route", action="store_true", help="print the first call's route, module by module")
    args = parser.parse_args(argv)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import commfuse
    from commfuse.launch import launch

    torch.set_num_threads(1)
    print("commfuse source files and functions one eager ring all_gather_matmul passes through")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:  # check=False: the fake group moves no data, so the ranks cannot compare fingerprints
        _print(f"fake group, rank 0 of {args.world_size}", _two_calls(dist.group.WORLD, False), args.show,
               args.route)
    finally:
        commfuse.backends.release()
        dist.destroy_process_group()
    _print(f"gloo, rank 0 of {args.world_size}", launch(_gloo, args.world_size)[0], args.show, args.route)


if __name__ == "__main__":
    main()
