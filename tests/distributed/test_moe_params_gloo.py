"""Tier (b), real gloo ranks: MoE's parameters in the loops users run. Its experts are DTensors sharded by
expert and its router a replicated one, so a torch.distributed.checkpoint round trip gives every rank its own
experts back; DDP over the expert-parallel group never overwrites them silently; on a dp x ep mesh torch's
fully_shard (and DDP) over dp train like one process holding every expert; under torch.autocast the experts
and the exchanges run in the autocast dtype with moe_reference's output and gradient dtypes; ``group`` and
``algorithm`` are checked when the layer is built."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _moe_params_cases as cases  # noqa: E402

from commfuse.errors import CommfuseValueError  # noqa: E402
from commfuse.launch import launch  # noqa: E402
from commfuse.nn import MoE  # noqa: E402


@pytest.mark.parametrize("n", (2, 4))
def test_a_checkpoint_round_trip_gives_every_rank_its_own_experts_back(n, tmp_path):
    results = launch(cases.dcp_round_trip, n, str(tmp_path / "checkpoint"), timeout=600)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.parametrize("how", ("process_group", "device_mesh"))
def test_ddp_over_the_expert_parallel_group_never_runs_on_overwritten_experts(how):
    """DDP broadcasts rank 0's parameters when it is built. Over a process group torch refuses the DTensor
    parameters then (nothing is overwritten); over a sub-mesh (DDP's DTensor path) the broadcast overwrites the
    experts and the layer refuses the first forward, naming DDP's ranks and what to do."""
    for rank, got in enumerate(launch(cases.ddp_over_experts, 2, how, timeout=300)):
        assert got["forward"] is None, f"rank {rank}: a training step ran under DDP over the expert group: {got}"
        if got["built"] is not None:
            assert got["experts_kept"], f"rank {rank}: DDP failed to build but changed the experts: {got}"
        else:
            text = got["refused"] or ""
            assert text.startswith("CommfuseValueError: ") and "DistributedDataParallel" in text, (rank, got)
            assert "expert-parallel group" in text and "mesh['dp']" in text and f"rank {rank}" in text, (rank, got)


@pytest.mark.parametrize("wrapper", ("fully_shard", "ddp"))
def test_on_a_dp_by_ep_mesh_wrapping_over_dp_trains_like_one_process(wrapper):
    """2 x 2 (dp, ep): the router's gradient is the mean over all four ranks' losses, each expert's too (the
    layer averages over ep, the wrapper over dp); losses, gradients and parameters after 3 AdamW steps equal
    a single process holding every expert, within fp32 tolerance."""
    for rank, problems in enumerate(launch(cases.dp_by_ep, 4, wrapper, timeout=600)):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_under_autocast_the_experts_and_exchanges_run_in_its_dtype(dtype):
    for rank, problems in enumerate(launch(cases.autocast_matches_reference, 2, dtype, timeout=600)):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)


def test_group_is_the_parameters_mesh_and_experts_differ_per_rank():
    for rank, problems in enumerate(launch(cases.groups_and_init, 2, timeout=300)):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.parametrize("algorithm,named", [("rign", "unknown algorithm 'rign'"),
                                             ("bidirectional", "not defined for all_to_all"),
                                             ("ring:", "bad algorithm 'ring:'")])
def test_a_bad_algorithm_is_refused_when_the_layer_is_built_or_set(algorithm, named):
    with pytest.raises(CommfuseValueError, match=named):
        MoE(8, 4, 2, 1, algorithm=algorithm)
    moe = MoE(8, 4, 2, 1, algorithm="ring:2")
    with pytest.raises(CommfuseValueError, match=named):
        moe.algorithm = algorithm
    assert moe.algorithm == "ring:2"
