"""Tier (b), real gloo ranks: the conformance suite's traced tier (``commfuse.testing.traced``) asks the right
things. Its problems, run eagerly on gloo ranks (commfuse's eager ops, tested everywhere else), match its
references, forward and, where the eager op is differentiable, backward; a result or gradient of the wrong rank
fails, naming the rank; every op and algorithm has a case, the all-to-all's without a bidirectional ring."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _traced_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402
from commfuse.testing import traced  # noqa: E402
from commfuse.testing.suite import ALL_ALGORITHMS, cases as tier_cases  # noqa: E402

ALGORITHMS = ("ring", "ring:2", "bidirectional", "sliced:2", "vanilla")
NAMES = traced.cases(ALGORITHMS, ("float32", "bfloat16"))


@functools.lru_cache(maxsize=None)
def _eager(n: int) -> list[dict]:
    return launch(cases.eager, n, NAMES, timeout=600)


def _answers(n: int, name: str):
    """What the gloo ranks gave for case ``name``, as a runner returns it: outputs and gradients by rank."""
    dtype = traced.prepare(name, n).problem.inputs[0][0].dtype
    per_rank = [r[name] for r in _eager(n)]
    outputs = [torch.from_numpy(o).to(dtype) for o, _ in per_rank]
    if per_rank[0][1] is None:
        return outputs, None
    return outputs, [[torch.from_numpy(g[i]).to(dtype) for _, g in per_rank] for i in range(len(per_rank[0][1]))]


@pytest.mark.parametrize("n", (2, 3))
def test_the_eager_ops_on_gloo_match_every_traced_reference(n):
    failures = {name: traced.compare(traced.prepare(name, n), *_answers(n, name)) for name in NAMES}
    failures = {name: f for name, f in failures.items() if f}
    assert not failures, "\n".join(f"{name}: {f}" for name, f in failures.items())
    assert sum(_answers(n, name)[1] is not None for name in NAMES) > len(NAMES) // 2  # gradients compared


def test_a_result_of_the_wrong_rank_fails_naming_the_rank():
    n = 3
    name = "traced-all_gather_consume-ring-float32"
    outputs, _ = _answers(n, name)
    swapped = [outputs[1], outputs[0], outputs[2]]
    failures = traced.compare(traced.prepare(name, n), swapped, None)
    assert any(f.startswith("rank 0: output") for f in failures) and not any("rank 2" in f for f in failures)


def test_a_gradient_of_the_wrong_rank_fails_naming_the_rank_and_the_argument():
    n = 3
    name = "traced-matmul_reduce_scatter-bidirectional-bfloat16"
    outputs, grads = _answers(n, name)
    grads = [list(g) for g in grads]
    grads[1] = [grads[1][2], grads[1][1], grads[1][0]]
    failures = traced.compare(traced.prepare(name, n), outputs, grads)
    assert failures and all("gradient of argument 1" in f for f in failures)
    assert {f.split(":")[0] for f in failures} == {"rank 0", "rank 2"}


def test_the_runner_must_give_gradients():
    def forward_only(body, inputs, n, cotangents):
        return [None] * n, None

    assert traced.check(forward_only, "traced-all_gather_matmul-ring-float32", 2) == [
        "the runner returned no gradient lists for 2 arguments"]


def test_every_op_and_algorithm_has_a_case_and_the_all_to_all_no_bidirectional_ring():
    names = tier_cases("traced", 4)
    assert names[-1] == "traced-check"
    for op in traced.OPS:
        for alg in ALL_ALGORITHMS:
            want = not (op == "all_to_all_consume" and alg == "bidirectional")
            assert (f"traced-{op}-{alg}-float32" in names) == want, (op, alg)
    with pytest.raises(ValueError, match="unknown traced case 'traced-softmax-ring-float32'"):
        traced.prepare("traced-softmax-ring-float32", 2)
