"""Tier (b), real gloo ranks: activation checkpointing, every way torch and torchtitan do it, over every style,
layer and op of commfuse: reentrant and non-reentrant ``torch.utils.checkpoint``, ``checkpoint_wrapper``, torch's
composable ``checkpoint``, torchtitan's selective per-op policy (built with
``create_selective_checkpoint_contexts``) and a policy that saves every op it sees, each against the same module
run without checkpointing on the same ranks: losses and every gradient equal, bit for bit. Ranks that checkpoint
differently are named on every rank before any call pairs wrongly."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _checkpoint_cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402


@functools.lru_cache(maxsize=None)
def _results(body: str, n: int, *args) -> list:
    return launch(getattr(_checkpoint_cases, body), n, *args, timeout=600)


def _check(body: str, n: int, name: str, *args) -> list:
    results = _results(body, n, *args)
    errors = {r: res.get(name, "did not run") for r, res in enumerate(results) if res.get(name, "missing")}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())
    return results


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", ("colwise-rowwise", "attention-swiglu-block", "block-auto-bf16"))
def test_tp_styles_under_every_checkpointing(name, n):
    _check("tp_styles", n, name)


@pytest.mark.parametrize("n", (2, 3))
def test_ring_attention_style_under_every_checkpointing(n):
    _check("ring_attention_style", n, "ring-attention-parallel")


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", ("parallel-mlp", "parallel-attention", "ulysses-attention", "ring-attention", "moe",
                                  "sharded-linear"))
def test_nn_layers_under_every_checkpointing(name, n):
    _check("nn_layers", n, name)


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", ("all-gather-matmul-reduce-scatter", "produce-reduce-scatter-dropout"))
def test_functional_ops_under_checkpointing(name, n):
    _check("functional", n, name)


@pytest.mark.parametrize("mode", ("wrapper", "selective"))
def test_checkpointed_block_under_fully_shard_on_a_2x2_mesh(mode):
    _check("with_fsdp", 4, f"fsdp-{mode}")


@pytest.mark.parametrize("n", (2, 4))  # the strands tests' block: a sequence of 16, cut over the ranks
@pytest.mark.parametrize("name", ("strands-non-reentrant-alternate", "strands-non-reentrant-searched",
                                  "strands-selective-alternate", "strands-selective-searched"))
def test_two_strands_with_checkpointed_stages(name, n):
    _check("two_strands", n, name)


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("case, words", [
    ("one-rank-checkpoints", ("recompute different checkpointed regions",
                              "'autograd, recomputing the checkpointed region of call #0'", "'autograd'")),
    # the first recomputed calls have one signature on every rank: named at the first of them (call #0 of the
    # recompute), before any pairs
    ("other-regions", ("recompute different checkpointed regions", "recomputing the checkpointed region of call #0",
                       "recomputing the checkpointed region of call #4", "call #0 all_gather_matmul")),
    ("other-policy", ("the ranks called different ops or shapes",)),
])
def test_ranks_that_checkpoint_differently_are_named_on_every_rank(case, words, n):
    results = _results("disagree", n, case)
    for rank, got in enumerate(results):
        assert got["error"] == "MismatchError" and got["commfuse"], f"rank {rank}: {got}"
        missing = [w for w in words if w not in got["message"]]
        assert not missing, f"rank {rank} does not say {missing}: {got['message']}"
        assert got["seconds"] < 15, f"rank {rank} took {got['seconds']:.1f} s (timeout 30 s): waited, not told"


@pytest.mark.parametrize("n", (2, 3))
def test_a_selective_policy_saves_commfuse_reduce_scatters_and_recomputes_its_gathers(n):
    # the recompute's calls, from the group's flight recorder: full checkpointing runs the block's four fused
    # ops again (the last one too: torch stops a recompute only after the tensors an op saves as it returns);
    # torchtitan's policy with commfuse.library.CHECKPOINT_SAVE runs the two gathers again and nothing else
    for rank, got in enumerate(_results("recomputed_calls", n)):
        for mode, want in (("wrapper", ["all_gather_matmul", "produce_reduce_scatter", "all_gather_matmul",
                                        "matmul_reduce_scatter"]),
                           ("selective", ["all_gather_matmul", "all_gather_matmul"])):
            again = [label for lane, label in got[mode] if "recomputing" in lane]
            assert again == want, f"rank {rank}, {mode}: the recompute made {again}, want {want}: {got[mode]}"
            forward = [label for lane, label in got[mode] if lane == "MainThread"]
            assert len(forward) == 4, f"rank {rank}, {mode}: the forward made {forward}"


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("mode", ("wrapper", "selective"))
def test_compiled_checkpointed_block_equals_eager_and_recomputes_as_the_policy_says(mode, n):
    # AOTAutograd with inductor's partitioner: the backward graph holds the recomputed forward ops; the fused
    # ops' results are those of the block compiled without checkpointing, bit for bit (of eager, within rounding)
    results = _check("compiled", n, f"{mode}-record", "record")
    for rank, res in enumerate(results):
        backward = res[f"{mode}-graphs"]["backward"]
        again = sorted(op for op in backward if not op.endswith("_backward.default"))
        want = (["commfuse.all_gather_matmul.default"] * 2 + ["commfuse.attention_reduce_scatter.default"]
                if mode == "wrapper" else ["commfuse.all_gather_matmul.default"] * 2)
        assert again == sorted(want), f"rank {rank}: the backward graph recomputes {again}, want {want}"


def test_compiled_with_inductor_under_the_selective_policy_equals_eager():
    _check("compiled", 2, "selective-inductor", "inductor")
