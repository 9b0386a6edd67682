"""Tier (b), real gloo ranks: the gathers commfuse makes on a user's group outside its ops go through its
call numbering and timeout, and one rank's failure before them is named on every rank.

``gather_dim`` (what ``to_linear``, ``gather_experts`` and ``to_linears`` gather parameters with) stays an
exact copy for uneven splits in float32, bfloat16 and int64; a rank whose piece is not its share, or whose
dtype differs, is named on every rank before anything is gathered, and the group works after; a rank that
never gathers leaves its peers a commfuse timeout, not the process group's. ``commfuse.graphs``: a rank whose
capture fails makes every rank raise (its peers naming it and its error) and none replay; ``failed_ranks``
lists it on every rank, and a rank that never comes is a commfuse timeout. On 2 and 3 ranks, with
``COMMFUSE_TIMEOUT_S`` at 4 s.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _numbered_gathers_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402

TIMEOUT_S = 4


@functools.lru_cache(maxsize=None)
def _results(body: str, name: str, n: int) -> list[dict]:
    return launch(getattr(cases, body), n, name, timeout=60, env={"COMMFUSE_TIMEOUT_S": str(TIMEOUT_S)})


def _has(text: str, words, where: str) -> None:
    missing = [w for w in words if w not in text]
    assert not missing, f"{where}: the error does not say {missing}:\n{text}"


def _after(results: list[dict]) -> None:
    for rank, got in enumerate(results):
        assert got["seconds"] < TIMEOUT_S, f"rank {rank} took {got['seconds']:.1f} s: it waited out the timeout"
        assert got["after"] is None, f"rank {rank}: {got['after']}"


@pytest.mark.parametrize("n", (2, 3))
def test_gather_dim_is_an_exact_copy_of_uneven_shards(n):
    for rank, got in enumerate(_results("gather_case", "exact", n)):
        assert got["message"] == "", f"rank {rank}: {got['message']}"
        assert got["after"] is None, f"rank {rank}: {got['after']}"


@pytest.mark.parametrize("n", (2, 3))
def test_gather_dim_names_a_rank_whose_piece_is_not_its_share(n):
    results = _results("gather_case", "wrong size", n)
    last, sizes = results[-1], results[0]["sizes"]
    assert last["kind"] == "CommfuseValueError", f"rank {n - 1}: {last['kind']}: {last['message']}"
    _has(last["message"], [f"rank {n - 1}: gathering 'proj.weight'", f"has {sizes[-1] - 1} along dim 0",
                           f"gives rank {n - 1} {sizes[-1]}"], f"rank {n - 1}")
    for rank, got in enumerate(results[:-1]):
        assert got["kind"] == "PeerFailedError", f"rank {rank}: {got['kind']}: {got['message']}"
        _has(got["message"], [f"rank {n - 1} refused it", "CommfuseValueError", f"has {sizes[-1] - 1} along dim 0",
                              "no rank gathers it"], f"rank {rank}")
    _after(results)


@pytest.mark.parametrize("n", (2, 3))
def test_gather_dim_names_a_rank_that_gathers_another_dtype(n):
    results = _results("gather_case", "other dtype", n)
    for rank, got in enumerate(results):
        assert got["kind"] == "MismatchError", f"rank {rank}: {got['kind']}: {got['message']}"
        _has(got["message"], ["gathering 'proj.weight'", "dtype: 'float32' on rank 0", f"'float64' on rank {n - 1}"],
             f"rank {rank}")
    _after(results)


@pytest.mark.parametrize("n", (2, 3))
def test_gather_dim_without_one_rank_is_a_commfuse_timeout(n):
    results = _results("gather_case", "skips", n)
    assert results[-1]["kind"] == "skipped"
    for rank, got in enumerate(results[:-1]):
        assert got["kind"] in ("CommfuseTimeoutError", "PeerFailedError"), \
            f"rank {rank}: {got['kind']}: {got['message']}"
        _has(got["message"], ["nn.gather_dim"], f"rank {rank}")


@pytest.mark.parametrize("n", (2, 3))
def test_a_failed_capture_is_named_on_every_rank_and_none_replays(n):
    results = _results("graphs_case", "capture fails", n)
    last = results[-1]
    assert last["kind"] == "RuntimeError", f"rank {n - 1}: {last['kind']}: {last['message']}"
    _has(last["message"], [cases.REFUSAL, "every rank of the group was told"], f"rank {n - 1}")
    for rank, got in enumerate(results[:-1]):
        assert got["kind"] == "PeerFailedError", f"rank {rank}: {got['kind']}: {got['message']}"
        _has(got["message"], ["commfuse.graphs.capture of a signature", f"rank {n - 1} refused it",
                              f"RuntimeError: {cases.REFUSAL}", "no rank replays it"], f"rank {rank}")
    assert [got["replays"] for got in results] == [0] * n
    _after(results)


@pytest.mark.parametrize("n", (2, 3))
def test_failed_ranks_lists_the_rank_that_failed_on_every_rank(n):
    results = _results("graphs_case", "not ok", n)
    assert [(got["kind"], got["failed"]) for got in results] == [("ok", [n - 1])] * n, results
    _after(results)


@pytest.mark.parametrize("n", (2, 3))
def test_failed_ranks_without_one_rank_is_a_commfuse_timeout(n):
    results = _results("graphs_case", "skips", n)
    assert results[-1]["kind"] == "skipped"
    for rank, got in enumerate(results[:-1]):
        assert got["kind"] in ("CommfuseTimeoutError", "PeerFailedError"), \
            f"rank {rank}: {got['kind']}: {got['message']}"
        _has(got["message"], ["graphs.failed_ranks"], f"rank {rank}")
