"""Tier (b), real gloo ranks: inputs that cannot corrupt a call.

A consumer that changes its tensor in place changes neither the caller's inputs nor any other rank's data;
``output_splits`` that are not what the peers send raise on the rank that gave them (the others are
unaffected, no process aborts); a layer built with other options on one rank is named on every rank;
``ring:m`` with more slices than rows is capped, alike on every rank, and says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the rank-side bodies must import in spawned ranks too
import _inputs_cases as cases  # noqa: E402

import commfuse as cf  # noqa: E402
from commfuse.launch import launch  # noqa: E402


@pytest.mark.parametrize("n", [2, 3])
def test_a_consumer_that_changes_its_tensor_in_place_changes_no_input_and_no_other_rank(n):
    for rank, result in enumerate(launch(cases.inplace_consumers, n, timeout=180)):
        assert len(result) == 2 * 5 + 4 + 4 * 2, result
        for name, (right, inputs_unchanged) in result.items():
            assert right, f"rank {rank}: {name}: a result differs from the reference"
            assert inputs_unchanged, f"rank {rank}: {name}: the caller's input was changed"


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("how", ["larger", "smaller", "zero"])
@pytest.mark.parametrize("op", ["all_to_all_consume", "produce_all_to_all"])
def test_output_splits_that_are_not_what_the_peer_sends_raise_on_that_rank_only(op, how, n):
    out = launch(cases.lying_output_splits, n, op, how, timeout=120)
    for rank, calls in enumerate(out):
        assert [alg for alg, _, _ in calls] == ["ring", "vanilla"], calls
        for alg, result, after_ok in calls:
            assert after_ok, f"rank {rank} ({alg}): the next call on the group went wrong"
            if rank == 1:  # the rank that claimed a wrong size for what rank 0 sends it (3 rows)
                kind, message = result
                claimed = {"larger": 5, "smaller": 2, "zero": 0}[how]
                assert kind == "CommfuseValueError", (alg, result)
                assert "rank 1" in message and "rank 0" in message, message
                assert f"output_splits[0] = {claimed}" in message and "sent 3" in message, message
                assert "dim 0" in message, message
            else:
                assert result == ("ok", True), (rank, alg, result)


@pytest.mark.parametrize("n", [2, 3])
def test_a_block_that_is_not_its_declared_input_split_is_named_and_never_sent(n):
    out = launch(cases.lying_input_splits, n, timeout=120)
    for rank, calls in enumerate(out):
        for alg, (kind, message, communication), seconds, after_ok in calls:
            assert after_ok, f"rank {rank} ({alg}): the next call on the group went wrong"
            assert seconds < 3 + 5, (rank, alg, seconds)
            if rank == 1:
                assert kind == "CommfuseValueError", (alg, kind, message)
                assert "producer(0)" in message and "[4, 2]" in message and "[2, 2]" in message, message
            elif rank == 0:  # waits for the block that was never sent: a bounded wait that names the step
                assert communication, (alg, kind, message)
                assert "rank 0" in message and "step" in message, message


LAYERS = {
    "ulysses causal": "causal=",
    "ulysses heads": "num_heads=",
    "parallel attention causal": "causal=",
    "parallel attention heads": "num_heads=",
    "column bias": "bias=",
    "row bias": "bias=",
    "mlp activation": "activation=",
    "sharded reduce": "reduce=",
    "sharded bias": "bias=",
}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("which", list(LAYERS))
def test_a_layer_built_with_other_options_on_one_rank_is_named_on_every_rank(which, n):
    out = launch(cases.layer_mismatch, n, which, timeout=120, env={"COMMFUSE_TIMEOUT_S": "10"})
    option = LAYERS[which]
    for rank, ((kind, message), seconds, alike_ok) in enumerate(out):
        assert kind == "MismatchError", (rank, kind, message)
        assert f"rank {rank}" in message and f"rank {n - 1}" in message, message
        # both sides of the difference, in words
        values = {line.split(option, 1)[1].split(",")[0].split(")")[0] for line in message.splitlines()
                  if option in line}
        assert len(values) == 2, message
        assert seconds < 10, (rank, seconds)
        assert alike_ok is True, (rank, alike_ok)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("which", ["causal", "rope"])
def test_an_attention_style_with_another_mask_or_rope_on_one_rank_is_named_on_every_rank(which, n):
    # named when the style is applied, by the ranks' agreement, before anything is distributed
    said = {"causal": ["causal: True on rank 0", f"False on rank {n - 1}"],
            "rope": ["rope: None on rank 0", f"_swap_qk' on rank {n - 1}"]}[which]
    out = launch(cases.tp_attention_mismatch, n, which, timeout=120, env={"COMMFUSE_TIMEOUT_S": "10"})
    for rank, ((kind, message), seconds, alike_ok) in enumerate(out):
        assert kind == "MismatchError", (rank, kind, message)
        assert all(words in message for words in said), message
        assert "AttentionParallel on 'attention'" in message and "nothing was distributed" in message, message
        assert seconds < 10, (rank, seconds)
        assert alike_ok, rank


def _steps(collective: str, n: int, rank: int, parts: int) -> int:
    return len(cf.schedule.build(collective, n, algorithm="ring", parts=parts).steps(rank))


@pytest.mark.parametrize("n, m", [(2, 10000), (3, 64)])
def test_ring_m_with_more_slices_than_rows_is_capped_alike_on_every_rank(n, m):
    out = launch(cases.capped_slices, n, m, timeout=120)
    collective = {"all_gather_consume": "all_gather", "all_gather_matmul": "all_gather",
                  "all_gather_matmul uneven": "all_gather", "matmul_reduce_scatter": "reduce_scatter",
                  "produce_reduce_scatter": "reduce_scatter", "all_to_all_consume": "all_to_all",
                  "produce_all_to_all": "produce_all_to_all"}
    for rank, result in enumerate(out):
        assert set(result) == set(collective) | {"all_gather_consume again"}, result
        for name, (right, algorithm, steps, said) in result.items():
            rows = 3 if name == "all_gather_matmul uneven" else 4  # the smallest shard's rows
            assert right, (rank, name)
            assert algorithm == f"ring:{rows}", (rank, name, algorithm)
            coll = collective[name.replace(" again", "")]
            assert steps == _steps(coll, n, rank, rows), (rank, name, steps)
            for message in said:
                assert f"ring:{m}" in message and f"ring:{rows}" in message and f"rank {rank}" in message, said
        assert result["all_gather_consume"][3], "the cap was not warned about"
        assert result["all_gather_consume again"][3] == [], "warned again for the same call signature"
    # every rank capped alike
    assert len({tuple(sorted((name, got[1]) for name, got in result.items())) for result in out}) == 1, out
