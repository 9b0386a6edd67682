"""Tier (b), real gloo ranks: a style is applied on every rank or on none, and every rank says why.

``parallelize_module`` with commfuse.tp's styles on 2 and 3 ranks whose modules or style arguments differ on
the last rank: when one rank refuses, every rank raises (the refusing rank its own error, the others
``PeerFailedError`` naming it, its words and the module's path); when the ranks decided differently, every rank
raises ``MismatchError`` naming both ranks and what differs; either way within the timeout, before anything is
distributed, and a later plain call on the group works. ``COMMFUSE_TIMEOUT_S`` is 10 s here, so a rank left
waiting shows as a timeout rather than a hang.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _style_agreement_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402

TIMEOUT_S = 10

#: the odd rank refuses alone: its error's class, and words its error and every peer's must hold
ONE_REFUSES = {
    "activation refused": ("CommfuseValueError", ["'layers.0.feed_forward' (FeedForward)", "'act' (QuickGELU)"]),
    "extra submodule": ("CommfuseValueError", ["'layers.0.attention' (Attention)", "'gate' (a Linear)"]),
    "heads refused": ("CommfuseValueError", ["'wq'", "not whole heads of 4 split evenly"]),
    "not a linear": ("CommfuseTypeError", ["parallelizes nn.Linear modules, got Conv1d"]),
    "ring attention extra part": ("CommfuseValueError", ["'layers.0.attention' (Attention)", "'gate' (a Linear)"]),
}
#: the ranks decided differently: words every rank's MismatchError must hold
DIFFER = {
    "activation differs": ["'layers.0.feed_forward' (FeedForward)", "computes activation: 'silu'", "'gelu'",
                           "'act': 'SiLU()'", "\"GELU(approximate='none')\""],
    "heads differ": ["'layers.0.attention' (Attention)", "'wq': 'Linear(in_features=16, out_features={h}",
                     "out_features={h2}"],
    "ffn width differs": ["'layers.0.feed_forward' (FeedForward)", "'w1': 'Linear(in_features=16, out_features=48",
                          "out_features=96"],
    "scale argument differs": ["commfuse.tp.AttentionParallel on 'layers.0.attention'", "scale: None on rank 0",
                               "0.5 on rank {last}"],
    "algorithm argument differs": ["commfuse.tp.ColwiseParallel on 'proj' (Linear)", "algorithm: 'ring'",
                                   "'vanilla' on rank {last}"],
    "layout argument differs": ["input_layouts: 'Replicate()'", "'Shard(dim=1)' on rank {last}"],
}


@functools.lru_cache(maxsize=None)
def _results(name: str, n: int) -> list[dict]:
    return launch(cases.apply_case, n, name, timeout=240, env={"COMMFUSE_TIMEOUT_S": str(TIMEOUT_S)})


def _has(text: str, words, where: str) -> None:
    missing = [w for w in words if w not in text]
    assert not missing, f"{where}: the error does not say {missing}:\n{text}"


def _after(results: list[dict]) -> None:
    for rank, got in enumerate(results):
        assert got["seconds"] < TIMEOUT_S, f"rank {rank} took {got['seconds']:.1f} s: it waited out the timeout"
        assert got["after"] is None, f"rank {rank}: {got['after']}"


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", sorted(ONE_REFUSES))
def test_one_rank_refuses_and_every_rank_raises_by_name(name, n):
    kind, words = ONE_REFUSES[name]
    results = _results(name, n)
    last = results[-1]
    assert last["kind"] == kind, f"rank {n - 1}: {last['kind']}: {last['message']}"
    _has(last["message"], words, f"rank {n - 1}")
    for rank, got in enumerate(results[:-1]):
        assert got["kind"] == "PeerFailedError", f"rank {rank}: {got['kind']}: {got['message']}"
        _has(got["message"], [f"rank {n - 1} refused it", kind, *words, "nothing was distributed"], f"rank {rank}")
    _after(results)


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", sorted(DIFFER))
def test_ranks_that_decided_differently_are_named_on_every_rank(name, n):
    h = 2 * n * cases.HEAD_DIM
    words = [w.format(last=n - 1, h=h, h2=2 * h) for w in DIFFER[name]]
    results = _results(name, n)
    for rank, got in enumerate(results):
        assert got["kind"] == "MismatchError", f"rank {rank}: {got['kind']}: {got['message']}"
        _has(got["message"], ["rank 0", f"rank {n - 1}", "differ in", *words], f"rank {rank}")
    _after(results)


@pytest.mark.parametrize("n", (2, 3))
def test_ranks_that_all_refuse_alike_each_raise_their_own_refusal(n):
    results = _results("all refuse alike", n)
    for rank, got in enumerate(results):
        assert got["kind"] == "CommfuseValueError", f"rank {rank}: {got['kind']}: {got['message']}"
        _has(got["message"], ["'layers.0.attention' (Attention)", "'gate' (a Linear)", "other ranks refused too"],
             f"rank {rank}")
    _after(results)


@pytest.mark.parametrize("n", (2, 3))
def test_a_rank_that_does_not_refuse_is_told_which_ranks_did(n):
    results = _results("all but the last refuse", n)
    refusing = ", ".join(map(str, range(n - 1)))
    for rank, got in enumerate(results[:-1]):
        assert got["kind"] == "CommfuseValueError", f"rank {rank}: {got['kind']}: {got['message']}"
    last = results[-1]
    assert last["kind"] == "PeerFailedError", f"rank {n - 1}: {last['kind']}: {last['message']}"
    _has(last["message"], [f"{'rank' if n == 2 else 'ranks'} {refusing} refused it", "'gate' (a Linear)"],
         f"rank {n - 1}")
    _after(results)


@pytest.mark.parametrize("n", (2, 3))
def test_ranks_that_agree_apply_the_styles_as_before(n):
    results = _results("happy", n)
    for rank, got in enumerate(results):
        assert got["kind"] == "applied", f"rank {rank}: {got['kind']}: {got['message']}"
        assert got["same output"] is None, f"rank {rank}: {got['same output']}"
    _after(results)
