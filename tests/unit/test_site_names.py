"""Tier (a), one process each (torch's fake process group, rank 0 of 4, in a subprocess so that its group never
meets the test process's; transfers complete at once): every site is named by its module path without
``commfuse.explain`` (the metrics' keys, the log lines, an error raised at it), with the names torch's wrappers
add left out; a new signature makes identical layers say what they took for it too, and the sites and the fast
path then run their plain code again; ``commfuse trace analyze`` names each call's site and finds the first
call at which two ranks ran different sites of one signature; ``commfuse.explain`` finds every
``commfuse.nn`` layer before it runs (in the test process: world size 1)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from commfuse.runtime.recorder import FORMAT
from commfuse.traces import Group, render

PRELUDE = textwrap.dedent("""
    import json, logging, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import commfuse as cf
    from commfuse import metrics, ops
    from commfuse.planning import table
    from commfuse.runtime import sites
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)

    class Stack(nn.Module):  # three identical ParallelMLPs (two sites each), called from the model's forward
        def __init__(self):
            super().__init__()
            self.mlps = nn.ModuleList(cf.nn.ParallelMLP(8, 16, algorithm="ring") for _ in range(3))

        def forward(self, x):
            for mlp in self.mlps:
                x = mlp(x)
            return x

    def plain():
        door = sites.at_site
        return door.__enter__ is door._enter and door.__exit__ is door._exit and ops._planned is table.get

    def taken(model):
        return {s.path: sorted(hop for _, hop, _, _ in s.taken) for s in cf.explain(model)}
""")

PATHS = [f"mlps.{i}.{fc}" for i in range(3) for fc in ("fc1", "fc2")]


def _run(body: str, tmp_path, env=None) -> dict:
    import os

    full = dict(os.environ, COMMFUSE_TRACE_DIR=str(tmp_path / "traces"), COMMFUSE_CHECK="0", **(env or {}))
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=120, env=full)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_metrics_and_the_log_name_each_identical_layer_by_its_path_without_explain(tmp_path):
    out = _run("""
        lines = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logging.getLogger("commfuse").addHandler(handler)
        logging.getLogger("commfuse").setLevel(logging.INFO)
        model = Stack()
        for _ in range(3):
            model(torch.randn(2, 4, 8))  # (batch, sequence shard, features)
        print(json.dumps({"snap": metrics.snapshot(), "lines": lines}))
    """, tmp_path)
    calls = {k.split("/")[2]: v for k, v in out["snap"].items() if k.endswith("/calls")}
    assert calls == {path: 3 for path in PATHS}, out["snap"]  # one set of keys per layer, by its path
    said = [line.split(" (", 1)[0] for line in out["lines"]]
    assert sorted(said) == sorted(PATHS), out["lines"]  # each site's one signature, said once, by its path


def test_a_new_signature_is_said_by_every_identical_layer_and_the_plain_code_comes_back(tmp_path):
    out = _run("""
        model = Stack()
        for _ in range(2):
            model(torch.randn(2, 4, 8))
        first = taken(model), plain()
        for _ in range(2):
            model(torch.randn(2, 6, 8))  # a longer sequence: new hop sizes, planned by the first layer
        print(json.dumps({"first": first, "second": (taken(model), plain())}))
    """, tmp_path)
    (first, plain_first), (second, plain_second) = out["first"], out["second"]
    assert plain_first and plain_second, out
    assert set(first) == set(PATHS) and all(len(hops) == 1 for hops in first.values()), first
    assert all(second[p] == second["mlps.0." + p.rsplit(".", 1)[1]] for p in PATHS), second
    assert all(len(hops) == 2 for hops in second.values()), second  # every layer: both signatures


def test_an_error_at_a_site_begins_with_its_path_and_a_users_own_gets_a_note(tmp_path):
    out = _run("""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module
        from commfuse.models.llama import Block, apply_rope, commfuse_plan, rope_cache
        from commfuse.tp import AttentionParallel

        errors = {}
        model = Stack()
        model(torch.randn(2, 4, 8))
        model.mlps[1].register_forward_pre_hook(lambda m, args: (args[0].double(),))  # fc1 refuses it
        try:
            model(torch.randn(2, 4, 8))
        except Exception as e:
            errors["ours"] = (type(e).__name__, str(e))

        def rope(q, k, cache):
            raise RuntimeError("the rope hook of the user's")

        tp = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        blocks = nn.ModuleDict({"first": Block(n_kv_heads=4), "second": Block(n_kv_heads=4)})
        parallelize_module(blocks["first"], tp, commfuse_plan())
        parallelize_module(blocks["second"], tp, dict(commfuse_plan(), attention=AttentionParallel(head_dim=8,
                                                                                                   rope=rope)))
        parent = nn.Module()
        parent.blocks = blocks
        parent.forward = lambda x, cache: blocks["second"](blocks["first"](x, cache), cache)
        try:
            parent(torch.randn(2, 2, 32), rope_cache(8, 8))
        except Exception as e:
            errors["user"] = (type(e).__name__, str(e), getattr(e, "__notes__", []))
        print(json.dumps(errors))
    """, tmp_path)
    kind, message = out["ours"]
    assert kind == "CommfuseValueError" and message.startswith("mlps.1.fc1 (ColumnParallelLinear, 4 ranks): "), out
    assert "dtype" in message, message
    kind, message, notes = out["user"]
    assert (kind, message) == ("RuntimeError", "the rope hook of the user's"), out
    assert notes == ["commfuse: raised in the forward of blocks.second.attention (AttentionParallel, 4 ranks)"], notes


def test_the_names_torchs_wrappers_add_are_left_out_of_the_paths(tmp_path):
    out = _run("""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        model = Stack()
        model.mlps[1] = checkpoint_wrapper(model.mlps[1])
        model(torch.randn(2, 4, 8))  # named at the first forward, without explain
        named = sorted(s.path for s in (model.mlps[i].fc1.__dict__["_commfuse_site"] for i in (0, 2)))
        wrapped = model.mlps[1]._checkpoint_wrapped_module.fc2.__dict__["_commfuse_site"].path
        compiled = torch.compile(model)  # not run: its module tree is what explain walks
        print(json.dumps({"named": named, "wrapped": wrapped, "explained": [s.path for s in cf.explain(compiled)]}))
    """, tmp_path)
    assert out["named"] == ["mlps.0.fc1", "mlps.2.fc1"] and out["wrapped"] == "mlps.1.fc2", out
    assert out["explained"] == PATHS, out


def _dump(rank: int, calls: list[dict]) -> dict:
    return {"format": FORMAT, "group": "0", "rank": rank, "world_size": 2, "reason": "on demand",
            "written_ns": 10_000, "calls": calls}


def _call(seq: int, site: str | None, status: str = "ok", waiting=None) -> dict:
    return {"seq": seq, "lane": "MainThread", "op": "all_gather_matmul", "algorithm": "ring", "digest": 7,
            "site": site, "status": status, "error": None, "start_ns": 1000 * seq,
            "end_ns": 1000 * seq + 500 if status == "ok" else None, "waiting": waiting, "steps": []}


def test_trace_analyze_names_each_calls_site_and_a_rank_a_layer_behind():
    # rank 1 skipped layers.1's call: its call #1 is at layers.2, with the same op and signature as rank 0's
    ranks = {0: ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp"], 1: ["layers.0.mlp", "layers.2.mlp"]}
    dumps = [_dump(r, [_call(seq, site) for seq, site in enumerate(sites)]) for r, sites in ranks.items()]
    dumps[0]["calls"][2].update(status="in progress", end_ns=None,
                                waiting={"step": 0, "since_ns": 2100, "waits_for": [1]})
    group = Group("0", dumps)
    assert group.disagree == ("MainThread", 1), group.verdict
    text = render([group])
    assert ("rank 0 called all_gather_matmul (ring, signature digest 7) at layers.1.mlp; rank 1 called "
            "all_gather_matmul (ring, signature digest 7) at layers.2.mlp") in text, text
    assert "call #2 (all_gather_matmul, ring) at layers.2.mlp" in text, text


def test_explain_lists_every_commfuse_nn_layer_before_any_forward():
    # found by the method their class runs as a site, not by a list of classes: RingAttention included
    import torch
    from torch import nn

    import commfuse as cf

    model = nn.ModuleDict({"ring": cf.nn.RingAttention(16, 2), "fc": cf.nn.ColumnParallelLinear(16, 16),
                           "mlp": cf.nn.ParallelMLP(16, 32), "plain": nn.Linear(16, 16)})
    found = {s.path: (s.kind, s.taken) for s in cf.explain(model)}
    assert found == {"ring": ("commfuse.nn.RingAttention", ()), "fc": ("commfuse.nn.ColumnParallelLinear", ()),
                     "mlp.fc1": ("commfuse.nn.ColumnParallelLinear", ()),
                     "mlp.fc2": ("commfuse.nn.RowParallelLinear", ())}, found
    model["mlp"](torch.randn(2, 4, 16))  # one process: world size 1, nothing to communicate
    taken = {s.path: s.taken for s in cf.explain(model)}
    nothing = ("nothing (world size 1)", "world size 1: nothing to communicate")
    assert taken["mlp.fc1"] == (("all_gather", 2 * 4 * 16 * 4, *nothing),), taken  # the whole input: one shard


def test_explain_tells_a_site_that_ran_with_nothing_to_fuse_from_one_that_never_ran(tmp_path):
    # a column-parallel linear given a replicated input has no collective in its forward: once it has run, explain
    # says so, instead of "nothing yet", which it says of a site whose forward has not run
    out = _run("""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module
        from commfuse.tp import ColwiseParallel
        mesh = init_device_mesh("cpu", (4,))
        ran, idle = nn.Linear(8, 16), nn.Linear(8, 16)
        parallelize_module(ran, mesh, ColwiseParallel())  # input_layouts Replicate(): nothing to communicate
        parallelize_module(idle, mesh, ColwiseParallel())
        ran(torch.randn(2, 4, 8))
        print(json.dumps({"ran": str(cf.explain(ran)), "idle": str(cf.explain(idle))}))
    """, tmp_path)
    assert "took: nothing to communicate in its forward (its input was replicated" in out["ran"], out["ran"]
    assert "took: nothing yet (no forward has run in eager mode)" in out["idle"], out["idle"]
