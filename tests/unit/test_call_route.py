"""Tier (a): a first call of a new signature descends once while it plans. ``benchmarks/call_path.py`` traces
the modules a first ``all_gather_matmul`` moves between on torch's ``fake`` group; while it plans (before
its first step into ``runtime.walks``) no module calls into one of a higher layer of ``.importlinter``'s
layers contract, and none calls into a module already on the call stack (a callback: a lambda of the op's
handed to the planner, a table that calls its caller's maker). Running the ring calls the op's compute on
each slice, up the layers by design: not counted here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch.distributed as dist

from commfuse import backends

ROOT = Path(__file__).resolve().parents[2]


def _call_path():
    spec = importlib.util.spec_from_file_location("commfuse_call_path", ROOT / "benchmarks" / "call_path.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_first_call_plans_without_calling_up_or_back():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    call_path = _call_path()
    backends.release()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        route = call_path._two_calls(dist.group.WORLD, False)
    finally:
        backends.release()
        dist.destroy_process_group()
    moves = route["route"]
    modules = [module for _, module in moves]
    assert modules[0] == "ops" and "runtime.walks" in modules, modules  # it planned, then ran
    planning = route["counts"]["planning"]
    assert planning["calls up a layer"] == 0, (planning, moves)
    assert planning["calls back into the stack"] == 0, (planning, moves)
