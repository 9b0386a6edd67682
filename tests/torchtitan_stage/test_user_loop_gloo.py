"""torchtitan 0.3's Llama 3 with commfuse's modules in its users' loops, against the stock model in the same
loop (``_user_loop_cases``): bf16 autocast, per-block torch.compile, a distributed-checkpoint round trip, and a
failure on one rank told to every rank by name. Runs in the torchtitan environment (``ci/test_torchtitan.sh``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _user_loop_cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402


def _no_problems(results: list) -> None:
    assert len(results) == 2
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res]
    assert not problems, "\n".join(problems)


def test_bf16_autocast_matches_the_stock_model_under_autocast():
    _no_problems(launch(_user_loop_cases.autocast, 2, timeout=600))


def test_blocks_compiled_as_torchtitan_compiles_them_match_the_eager_stock_model():
    _no_problems(launch(_user_loop_cases.compiled, 2, timeout=600))


def test_a_distributed_checkpoint_moves_between_the_stock_and_the_fused_model():
    _no_problems(launch(_user_loop_cases.checkpoint, 2, timeout=600))


@pytest.mark.parametrize(("fault", "words"), [
    ("causal", ("rank 1", "causal")),          # its layer options differ: the fingerprint names them
    ("mask", ("BlockMask", "64")),             # its mask refused before its first call: peers told why
])
def test_a_fault_on_one_rank_is_told_to_every_rank_by_name(fault, words, monkeypatch):
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", str(_user_loop_cases.TIMEOUT))
    results = launch(_user_loop_cases.one_rank, 2, fault, timeout=600)
    for rank, (kind, message, seconds) in enumerate(results):
        assert kind != "ok", f"rank {rank} ran on"
        assert seconds < _user_loop_cases.TIMEOUT / 2, f"rank {rank} waited {seconds:.0f} s: {message}"
        if rank == 1 or fault == "causal":
            assert all(w in message for w in words), f"rank {rank}: {kind}: {message}"
        else:  # the peer waited in the call rank 1 left: told who and why
            assert "rank 1" in message and "BlockMask" in message, f"rank {rank}: {kind}: {message}"
