"""Tier (b), real gloo ranks: one meaning of ``group=`` (a ProcessGroup or a 1-D DeviceMesh everywhere, a mesh of
more dims refused by name, one rank's failure over a mesh told to every rank), and visible decisions
(``COMMFUSE_LOG=info`` lines once per site and signature, ``commfuse.explain``), every site of a model of
identical layers named by its module path, with or without ``commfuse.explain`` first, in what it took, its
log lines, the errors raised at it and ``commfuse trace analyze``."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _group_and_explain_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "all_gather_consume", "produce_reduce_scatter",
       "all_to_all_consume", "produce_all_to_all")
BUILT = ("ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelAttention", "UlyssesAttention",
         "ShardedLinear", "MoE", "ColwiseParallel", "RowwiseParallel")


@functools.lru_cache(maxsize=None)
def _results(body: str, n: int) -> list:
    return launch(getattr(cases, body), n, timeout=600)


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("op", OPS)
def test_every_op_takes_a_1d_mesh_as_its_group_and_refuses_a_2d_one_by_name(op, n):
    for rank, out in enumerate(_results("group_forms", n)):
        assert out[(op, "mesh")] == ("ok", True), (rank, out[(op, "mesh")])
        kind, message, named = out[(op, "2-D mesh")]
        assert kind == "CommfuseValueError" and named, (rank, kind, message)
        assert "2-D DeviceMesh" in message and "mesh['dp']" in message, (rank, message)
        assert out[(op, "after")] == ("ok", True), (rank, out[(op, "after")])


@pytest.mark.parametrize("name", BUILT)
def test_every_layer_and_style_takes_a_1d_mesh_and_refuses_a_2d_one_by_name(name):
    for rank, out in enumerate(_results("layers_and_styles_refuse_a_2d_mesh", 2)):
        assert out[(name, "mesh")][0] == "ok", (rank, name, out[(name, "mesh")])
        kind, message, named = out[(name, "2-D mesh")]
        assert kind == "CommfuseValueError" and named, (rank, name, kind, message)
        assert "2-D" in message and ("1-D" in message or "mesh['dp']" in message), (rank, name, message)


def test_one_ranks_bad_input_over_a_mesh_is_told_to_every_rank_by_name():
    for rank, (kind, message, named, seconds, after) in enumerate(_results("one_rank_bad_input_with_a_mesh", 3)):
        assert named, (rank, kind, message)
        if rank == 1:
            assert "dtype" in message, message
        else:  # told through the group's board, by name, long before the timeout
            assert "rank 1" in message, (rank, kind, message)
            assert seconds < cases.TIMEOUT / 2, (rank, kind, message, seconds)
        for outcome, right, named_after in after:
            assert (outcome == "ok" and right) or (outcome != "ok" and named_after), (rank, after)


SITES = {  # path -> (kind, algorithm, what the forward's fused ops are)
    "block.w1": ("commfuse.tp.ColwiseParallel", "auto", {"all_gather"}),
    "block.w2": ("commfuse.tp.RowwiseParallel", "auto", {"reduce_scatter"}),
    "odd": ("commfuse.tp.ColwiseParallel", "auto", set()),
    "mlp.fc1": ("commfuse.nn.ColumnParallelLinear", "auto", {"all_gather"}),
    "mlp.fc2": ("commfuse.nn.RowParallelLinear", "auto", {"reduce_scatter"}),
    "attention": ("commfuse.nn.ParallelAttention", "ring:2", {"all_gather", "reduce_scatter"}),
    "ulysses": ("commfuse.nn.UlyssesAttention", "auto", {"all_to_all"}),
    "sharded": ("commfuse.nn.ShardedLinear", "vanilla", {"all_gather"}),
    "moe": ("commfuse.nn.MoE", "auto", {"all_to_all"}),
}


def test_explain_lists_every_site_with_its_group_world_size_and_algorithm_and_what_it_took():
    for rank, out in enumerate(_results("explain_and_log", 2)):
        before = {row[0]: row for row in out["before"]}
        after = {row[0]: row for row in out["after"]}
        assert set(before) == set(SITES) == set(after), (rank, sorted(before), sorted(after))
        for path, (kind, algorithm, collectives) in SITES.items():
            _, got_kind, group, world, got_algorithm, taken, fallbacks = after[path]
            assert (got_kind, world, got_algorithm) == (kind, 2, algorithm), (rank, after[path])
            assert "'tp'" in group and "[0, 1]" in group, (rank, path, group)
            assert before[path][5] == () and before[path][6] == (), (rank, "ran before any forward", before[path])
            assert {c for c, *_ in taken} == collectives, (rank, path, taken)
            for collective, hop, name, why in taken:
                assert why and (hop > 0 or algorithm != "auto"), (rank, path, taken)
                if algorithm != "auto":
                    assert (name, why) == (algorithm, "asked for"), (rank, path, taken)
                else:
                    assert name in ("ring", "ring:2", "vanilla", "bidirectional"), (rank, path, taken)
        assert after["odd"][6] and "DTensor" in after["odd"][6][0], (rank, after["odd"])
        assert all(not after[p][6] for p in SITES if p != "odd"), (rank, after)
        assert "block.w1: commfuse.tp.ColwiseParallel on mesh dim 'tp'" in out["text"], out["text"]


def test_commfuse_log_info_says_once_per_site_and_signature_with_the_rank_in_front():
    for rank, out in enumerate(_results("explain_and_log", 2)):
        lines = out["lines"]
        assert lines and all(line.startswith(f"[commfuse rank {rank}] ") for line in lines), (rank, lines)
        decisions = [line for line in lines if any(f"] {path} (" in line for path in SITES)]
        assert decisions and all(len(line) < 250 for line in decisions), (rank, max(decisions, key=len))
        # two forwards, one line per site and signature: every (site, collective) once, the fallback once
        for path, (kind, algorithm, collectives) in SITES.items():
            for collective in collectives:
                said = [line for line in lines if f"] {path} (" in line and f"): {collective} " in line]
                assert len(said) == 1, (rank, path, collective, said, lines)
                taken = {name for c, _, name, _ in dict((r[0], r) for r in out["after"])[path][5] if c == collective}
                assert f" takes {taken.pop()}: " in said[0], (rank, said)
        fell_back = [line for line in lines if "] odd (" in line]
        assert len(fell_back) == 1 and "DTensor" in fell_back[0], (rank, fell_back)
        assert not any(line.startswith(f"[commfuse rank {rank}] auto:") for line in lines), (rank, lines)


# -- every site by its path: identical layers, reused style objects, with and without explain first ---------------

STACK = {  # path -> (kind, the collectives its forward fuses)
    **{f"layers.{i}.attention": ("commfuse.tp.AttentionParallel", {"all_gather", "reduce_scatter"})
       for i in range(cases.LAYERS)},
    **{f"layers.{i}.feed_forward": ("commfuse.tp.SwiGLUParallel", {"all_gather", "reduce_scatter"})
       for i in range(cases.LAYERS)},
    **{f"mlps.{i}.fc1": ("commfuse.nn.ColumnParallelLinear", {"all_gather"}) for i in range(2)},
    **{f"mlps.{i}.fc2": ("commfuse.nn.RowParallelLinear", {"reduce_scatter"}) for i in range(2)},
}
CASES = [(styles, first) for styles in ("shared", "fresh", "wildcard") for first in (False, True)]


@pytest.mark.parametrize("styles,explain_first", CASES)
def test_explain_lists_every_identical_layer_by_its_path_with_what_it_took(styles, explain_first):
    for rank, out in enumerate(_results("every_site_named", 2)):
        rows = {path: (kind, algorithm, taken, fallbacks)
                for path, kind, algorithm, taken, fallbacks in out[(styles, explain_first)]["rows"]}
        assert set(rows) == set(STACK), (rank, sorted(rows))
        for path, (kind, collectives) in STACK.items():
            got_kind, algorithm, taken, fallbacks = rows[path]
            assert got_kind == kind and algorithm == "auto", (rank, path, rows[path])
            # every layer says what each of its fused collectives took, the first layer (which planned the
            # calls) and the ones after it (whose calls found the plans) alike
            assert {c for c, *_ in taken} == collectives, (rank, path, taken)
            assert all(hop > 0 and name in ("ring", "ring:2", "bidirectional", "vanilla") and why
                       for _, hop, name, why in taken), (rank, path, taken)
            assert not fallbacks, (rank, path, fallbacks)
        for i in range(1, cases.LAYERS):  # identical layers took what the first took
            for sub in ("attention", "feed_forward"):
                assert rows[f"layers.{i}.{sub}"][2] == rows[f"layers.0.{sub}"][2], (rank, i, sub, rows)


@pytest.mark.parametrize("styles,explain_first", CASES)
def test_commfuse_log_names_every_identical_layer_by_its_path_once_per_signature(styles, explain_first):
    for rank, out in enumerate(_results("every_site_named", 2)):
        case = out[(styles, explain_first)]
        lines, rows = case["lines"], {row[0]: row for row in case["rows"]}
        assert lines and all(line.startswith(f"[commfuse rank {rank}] ") for line in lines), (rank, lines)
        for path, (kind, collectives) in STACK.items():
            heading = f"] {path} ({kind.rsplit('.', 1)[-1]}, 2 ranks): "
            for collective in collectives:
                said = [line for line in lines if heading in line and f": {collective} of " in line]
                assert len(said) == 1, (rank, path, collective, said, lines)
                (taken,) = {name for c, _, name, _ in rows[path][3] if c == collective}
                assert f" takes {taken}: " in said[0], (rank, said)
        named = {line.split("] ", 1)[1].split(" (", 1)[0] for line in lines}
        assert named == set(STACK), (rank, sorted(named - set(STACK)), lines)


def test_after_warm_up_the_sites_and_the_fast_path_run_their_plain_code():
    for rank, out in enumerate(_results("every_site_named", 2)):
        assert out["plain"] == (True, []), (rank, out["plain"], out["warm"])


def test_an_error_at_a_site_of_the_middle_layer_names_its_path():
    for rank, out in enumerate(_results("error_in_layer_one", 2)):
        kind, message, notes = out["dtype"]
        assert kind == "CommfuseValueError", (rank, kind, message)
        assert message.startswith("layers.1.attention (AttentionParallel, 2 ranks): "), (rank, message)
        assert "dtype" in message, message
        assert out["dtype after"][0] == "ok", (rank, out["dtype after"])
        kind, message, notes = out["peer"]
        if rank == 1:  # its own error, the rope hook's, keeps its message and gets a note naming the site
            assert kind == "ValueError" and message == "rope hook of block 1 failed on purpose", (kind, message)
            assert any("layers.1.attention (AttentionParallel, 2 ranks)" in note for note in notes), notes
        else:  # told, in block 1's reduce-scatter, by name
            assert kind == "PeerFailedError", (rank, kind, message)
            assert message.startswith("layers.1.attention (AttentionParallel, 2 ranks): "), message
            assert "rank 1" in message and "ValueError" in message, message


def test_trace_analyze_names_the_path_of_the_site_of_the_failed_call(tmp_path):
    out = launch(cases.error_in_layer_one, 2, timeout=600, env={"COMMFUSE_TRACE_DIR": str(tmp_path)})
    assert all(o["dumps"] for o in out), [o["dumps"] for o in out]
    dumps = {}
    for path in tmp_path.glob("commfuse-trace-*.json"):
        data = json.loads(path.read_text())
        dumps.setdefault(data["rank"], []).append(data)
    failed = [c for d in dumps[0] for c in d["calls"] if c["status"] == "failed"]
    assert failed and all(c["site"] == "layers.1.attention" for c in failed), failed
    sites = {c["site"] for ds in dumps.values() for d in ds for c in d["calls"]}
    assert {f"layers.{i}.{s}" for i in range(cases.LAYERS) for s in ("attention", "feed_forward")} <= sites, sites
    done = subprocess.run([sys.executable, "-m", "commfuse", "trace", "analyze", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    verdict = done.stdout.split("\n\n")[0]
    assert "rank 1 never posted" in verdict and " at layers.1.attention " in verdict, done.stdout
