"""Tier (b), real gloo ranks: commfuse's MoE layer inside whole models. On a dp x ep mesh a model of dense and
MoE layers, wrapped by commfuse.ep's FSDP2 or DDP recipe and clipped by commfuse.ep.clip_grad_norm_, trains like
one process holding every parameter (and so does transformers' Qwen3-MoE, dense and sparse layers); inside
transformers' Mixtral under torch's tensor-parallel plan with sequence parallelism the layer takes the
sequence-sharded activation (a DTensor or its local tensor) and, with loss='shared', gives the one-process
model's gradients. What the layer or the recipe cannot take is refused by name on every rank. One process:
the layer with a transformers sparse block's weights computes what the block computes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _moe_model_cases as cases  # noqa: E402

from commfuse.errors import CommfuseValueError  # noqa: E402
from commfuse.launch import launch  # noqa: E402
from commfuse.nn import MoE  # noqa: E402

HF = "transformers is installed by ci/setup.sh (commfuse's 'hf' extra)"


@pytest.mark.parametrize("wrapper", ("fully_shard", "ddp"))
def test_a_model_of_dense_and_moe_layers_on_dp_by_ep_trains_like_one_process(wrapper):
    """2 x 2 (dp, ep): the dense parameters averaged over all four ranks, the experts and the router over dp (the
    layer has averaged over ep); losses, the clipped gradients, their norm and the parameters after 3 AdamW
    steps (one of them two micro-batches, the first unsynchronised) equal one process's."""
    for rank, problems in enumerate(launch(cases.dp_by_ep, 4, wrapper, 0.5, timeout=600)):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)


def test_a_checkpoint_of_such_a_model_loads_back_exactly(tmp_path):
    for rank, problems in enumerate(launch(cases.dcp_round_trip, 4, str(tmp_path / "checkpoint"), timeout=600)):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.parametrize("wrapper,said", [
    # torch 2.13 names the meshes; torch 2.9 fails in the stack's sharding propagation
    ("fully_shard", ("must have the same mesh", "Sharding propagation failed for Op(op=aten.stack.default")),
    ("ddp", ("mixed torch.Tensor and DTensor",))])
def test_torch_clip_grad_norm_cannot_take_such_a_model(wrapper, said):
    """Why commfuse.ep.clip_grad_norm_ exists: torch's stacks one norm per device and dtype, which fails for
    DTensors of several meshes (FSDP2) or beside plain tensors (DDP). Should torch learn to, this test says
    so."""
    for rank, text in enumerate(launch(cases.torch_clip_on_dp_by_ep, 4, wrapper, timeout=300)):
        assert any(s in text for s in said), f"rank {rank}: {text}"


RECIPE_REFUSALS = {  # what commfuse.ep refuses, and what every rank's error says
    "group on dp": "build it with group=mesh['ep']",
    "shared loss": "loss='shared'",
    "no ep axis": "without ['ep']",
    "ddp given a process group": "process_group= is not taken",
    "rank 3's layer differs": "global ranks [3] hold other MoE layers",
    "rank 3 has one layer more": "of 3 MoE layers",  # rank 3's, in the exchange's own check
}


def test_the_recipe_refuses_by_name_on_every_rank():
    assert tuple(RECIPE_REFUSALS) == cases.RECIPE_REFUSALS
    for rank, said in enumerate(launch(cases.recipe_refusals, 4, timeout=300)):
        for what, named in RECIPE_REFUSALS.items():
            text = said[what]
            assert text.startswith(("CommfuseValueError: ", "MismatchError: ")), f"rank {rank}, {what}: {text}"
            assert named in text, f"rank {rank}, {what}: {text}"
            if what in ("group on dp", "shared loss", "no ep axis"):
                assert f"rank {rank}" in text, f"rank {rank}, {what}: {text}"
            if what.startswith("rank 3"):
                assert "rank 3" in text, f"rank {rank}, {what}: {text}"


def test_per_rank_gives_the_mean_and_shared_the_sum_of_the_ranks_losses():
    for rank, problems in enumerate(launch(cases.per_rank_gives_the_mean, 2, timeout=300)):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.parametrize("how", ("dtensor", "local"))
def test_in_mixtral_under_tensor_and_sequence_parallelism_the_layer_gives_the_models_gradients(how):
    """torch's TP plan with SequenceParallel norms, two ranks sharing one loss: the MoE gets the norm's
    Shard(1) DTensor, or its local tensor through torch's PrepareModuleInputOutput, and with loss='shared'
    every gradient, the clipped norm and two AdamW steps equal transformers' model in one process (with
    per-rank averaging its gradients were half the model's)."""
    pytest.importorskip("transformers", reason=HF)
    for rank, problems in enumerate(launch(cases.mixtral_sequence_parallel, 2, how, timeout=600)):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.parametrize("wrapper", ("fully_shard", "ddp"))
def test_qwen3_moe_on_dp_by_ep_trains_like_one_process(wrapper):
    pytest.importorskip("transformers", reason=HF)
    for rank, problems in enumerate(launch(cases.qwen3_moe_dp_by_ep, 4, wrapper, timeout=600)):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)


SHARDED_INPUT_REFUSALS = {  # what the layer refuses, and what every rank's error says
    "DTensor into a per_rank layer": "built with loss='per_rank'",
    "replicated DTensor": "replicated: every rank would route every token",
    "DTensor sharded along its features": "sharded along its features",
    "DTensor over other ranks": "the layer's expert-parallel group is global ranks",
    "convention differs on rank 1": "(loss='shared')",
}


def test_what_the_layer_cannot_take_is_named_on_every_rank_and_the_group_stays_usable():
    assert tuple(SHARDED_INPUT_REFUSALS) == cases.SHARDED_INPUT_REFUSALS
    for rank, said in enumerate(launch(cases.sharded_input_refusals, 4, timeout=300)):
        for what, named in SHARDED_INPUT_REFUSALS.items():
            text = said[what]
            want = "MismatchError: " if what == "convention differs on rank 1" else "CommfuseValueError: "
            assert text.startswith(want) and named in text, f"rank {rank}, {what}: {text}"
            assert "the next call gave" not in text, f"rank {rank}, {what}: {text}"
            if what == "convention differs on rank 1":
                assert "rank 1" in text and "one loss shared over the group" in text, f"rank {rank}: {text}"
            else:
                assert f"rank {rank}" in text, f"rank {rank}, {what}: {text}"


@pytest.mark.parametrize("model", ("mixtral", "qwen3_moe"))
def test_one_process_the_layer_computes_what_the_transformers_block_computes(model):
    """A transformers sparse MoE block from a small config, and commfuse's MoE with its weights: the output,
    the input's gradient and the router's and experts' gradients."""
    pytest.importorskip("transformers", reason=HF)
    if model == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config = cases.mixtral_config()
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        config = cases.qwen3_moe_config()
    torch.manual_seed(0)
    block = Block(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe = cases.moe_from_sparse_block(block, normalize=getattr(block.gate, "norm_topk_prob", True))
    x = torch.randn(2, 7, config.hidden_size)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = block(xa), moe(xb)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.router.grad, block.gate.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.w13.grad, block.experts.gate_up_proj.grad.transpose(1, 2), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.w2.grad, block.experts.down_proj.grad.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_a_bad_loss_convention_is_named_when_built_or_set():
    with pytest.raises(CommfuseValueError, match="loss must be 'per_rank'.*got 'mean'"):
        MoE(8, 4, 2, 1, loss="mean")
    moe = MoE(8, 4, 2, 1, loss="shared")
    with pytest.raises(CommfuseValueError, match="got None"):
        moe.loss = None
    assert moe.loss == "shared" and "loss='shared'" in repr(moe)
