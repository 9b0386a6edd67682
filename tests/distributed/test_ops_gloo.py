"""Tier (b), real gloo ranks: the fused ops equal the single-process reference and torch's collectives.

Each world size (2, 3, 4) runs the whole op x algorithm x dtype x dim matrix
in one launch; the pytest cases then read their own entry.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _ops_cases  # noqa: E402

import commfuse as cf  # noqa: E402
from commfuse.errors import CommfuseError  # noqa: E402
from commfuse.launch import launch  # noqa: E402

WORLD_SIZES = (2, 3, 4)


@functools.lru_cache(maxsize=None)
def _battery(body: str, n: int) -> list[dict]:
    return launch(getattr(_ops_cases, body), n, timeout=600)


def _names() -> list[str]:
    names = []
    for alg in _ops_cases.ALGORITHMS:
        for dname in _ops_cases.DTYPES:
            for tier in ("tol", "exact"):
                for dim in (0, 1, -1):
                    names += [f"ag-{alg}-{dname}-{tier}-dim{dim}", f"rs-{alg}-{dname}-{tier}-dim{dim}"]
                names += [f"consume-{alg}-{dname}-{tier}", f"produce-{alg}-{dname}-{tier}", f"a2a-{alg}-{dname}-{tier}"]
    return names + ["rs-avg"]


def _assert_all_ranks(results: list[dict], name: str) -> None:
    errors = {r: res.get(name, "case did not run") for r, res in enumerate(results) if res.get(name, "missing")}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("name", _names())
def test_op_matrix(n, name):
    _assert_all_ranks(_battery("matrix", n), name)


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("name", ["empty", "noncontiguous", "uneven", "profiler_spans", "wrong_chunk_count", "subgroups"])
def test_edge_cases(n, name):
    _assert_all_ranks(_battery("edges", n), name)


@pytest.mark.parametrize("n", [3, 4])
def test_half_precision_contraction_gather_sums_in_float32(n):
    results = launch(_ops_cases.half_contraction, n, timeout=300)
    names = {f"{d}-{a}" for d in ("fp16", "bf16") for a in ("ring", "bidirectional", "sliced:2", "vanilla", "auto")}
    assert all(set(res) == names for res in results), results
    for name in sorted(names):
        _assert_all_ranks(results, name)


@pytest.mark.parametrize("n", [3, 4])
def test_half_precision_reduce_scatter_sums_in_float32(n):
    results = launch(_ops_cases.half_scatter, n, timeout=600)
    names = {f"{d}-{a}-{p}" for d in _ops_cases.HALF_PARTIALS for a in _ops_cases.HALF_SCATTER_ALGORITHMS
             for p in ("forward", "backward", "sharded", "ulysses", "moe")
             if a != "bidirectional" or p not in ("ulysses", "moe")}
    assert all(set(res) == names for res in results), results
    for name in sorted(names):
        _assert_all_ranks(results, name)


def test_world_size_one_process_group():
    assert launch(_ops_cases.world_one, 1, timeout=120) == ["ok"]


def test_without_process_group_ops_are_local():
    A, B = torch.randn(4, 8), torch.randn(8, 3)
    assert torch.equal(cf.all_gather_matmul(A, B), A @ B)
    assert torch.equal(cf.matmul_reduce_scatter(A, B, algorithm="ring"), A @ B)


@pytest.mark.parametrize("n", [3, 4])
def test_mismatched_shapes_fail_on_every_rank_within_the_timeout(n):
    out = launch(_ops_cases.mismatch, n, "shape", timeout=120)
    for rank, (kind, message, seconds) in enumerate(out):
        # the ranks beside the disagreement raise MismatchError; the others time out, or see the
        # connection to a rank that has already given up close (CommunicationError)
        assert kind in ("MismatchError", "CommfuseTimeoutError", "CommunicationError"), (rank, kind, message)
        assert seconds < 4 * 3, (rank, seconds)
        assert f"rank {rank}" in message
    # the neighbours of rank 0 see both sides of the disagreement
    for rank in (1, n - 1):
        kind, message, _ = out[rank]
        assert kind == "MismatchError"
        # rank 0 gathers 8 rows per shard, the others 4: both gathered shapes are shown
        assert f"float32[{8 * n}, 16]" in message and f"float32[{4 * n}, 16]" in message, message


def test_mismatched_algorithms_fail_on_every_rank():
    out = launch(_ops_cases.mismatch, 3, "algorithm", timeout=120)
    for rank, (kind, message, seconds) in enumerate(out):
        assert kind == "MismatchError", (rank, kind, message)
        assert "algorithm ring" in message and "algorithm vanilla" in message


def test_absent_peer_times_out_naming_rank_step_and_peer():
    out = launch(_ops_cases.mismatch, 3, "absent", timeout=120)
    kind, message, seconds = out[0]
    assert kind == "CommfuseTimeoutError", out[0]
    assert 2.5 < seconds < 10, seconds
    assert "rank 0 timed out after 3 s in step 0" in message and "rank 1" in message
    assert 'build("all_gather", 3, algorithm="ring")' in message


@pytest.mark.parametrize(
    "call,text",
    [
        (lambda: cf.all_gather_matmul(torch.randn(4, 8), torch.randn(8, 3), gather_dim=2), "gather_dim=2 is out of range"),
        (lambda: cf.all_gather_matmul(torch.randn(4, 8), torch.randn(7, 3)), "b has 7 rows but the gathered a has K = 8"),
        (lambda: cf.all_gather_matmul(torch.randn(4, 8), torch.randn(8, 3, 1)), "b must be 2-D"),
        (lambda: cf.all_gather_matmul(torch.randn(4, 8), torch.randn(8, 3, dtype=torch.float64)), "b has dtype torch.float64"),
        (lambda: cf.all_gather_matmul([1, 2], torch.randn(8, 3)), "a_shard must be a torch.Tensor, got list"),
        (lambda: cf.all_gather_matmul(torch.randn(4, 8), torch.randn(8, 3), algorithm="tree"), "unknown algorithm 'tree'"),
        (lambda: cf.matmul_reduce_scatter(torch.randn(4, 8), torch.randn(8, 3), reduce_op="max"), "reduce_op must be 'sum' or 'avg', got 'max'"),
        (lambda: cf.matmul_reduce_scatter(torch.randn(4, 8), torch.randn(8, 3), scatter_dim=-3), "scatter_dim=-3 is out of range"),
        (lambda: cf.all_to_all_consume([torch.zeros(2), torch.zeros(3)], print), "chunks has 2 tensors but the world size is 1"),
        (lambda: cf.all_to_all_consume([torch.zeros(2)], print, algorithm="bidirectional"), "'bidirectional' is not defined for all_to_all"),
    ],
)
def test_bad_arguments_raise_errors_naming_them(call, text):
    with pytest.raises(CommfuseError, match=text.replace("(", "\\(").replace(")", "\\)").replace("[", "\\[")):
        call()


def test_timeout_argument_and_environment(monkeypatch):
    from commfuse.runtime.groups import DEFAULT_TIMEOUT_S, resolve_timeout

    assert resolve_timeout(None) == DEFAULT_TIMEOUT_S
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "7.5")
    assert resolve_timeout(None) == 7.5
    assert resolve_timeout(2) == 2.0
    with pytest.raises(CommfuseError, match="timeout must be a positive number of seconds, got -1"):
        resolve_timeout(-1)
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "soon")
    with pytest.raises(CommfuseError, match="COMMFUSE_TIMEOUT_S must be a number of seconds, got 'soon'"):
        resolve_timeout(None)


def test_repeated_calls_walk_without_a_program_and_stay_right():
    expected = {f"{op} {alg} dim {dim}": [4, True] for op, alg, dim in (
        ("all_gather_matmul", "vanilla", 0), ("matmul_reduce_scatter", "vanilla", 0), ("all_gather_matmul", "ring", 0),
        ("all_gather_matmul", "ring:2", 0), ("matmul_reduce_scatter", "ring", 0),
        ("matmul_reduce_scatter", "ring:2", 0), ("matmul_reduce_scatter", "ring", 1))}
    for rank, got in enumerate(launch(_ops_cases.repeated_without_program, 3, timeout=120)):
        # the first call of each signature is planned and checked through the program; the 4 after walk without one
        assert got == expected, (rank, got)
