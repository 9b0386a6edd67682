"""The integration against the torchtitan release installed here: the version CI tests, the swap on every
llama3 config in its registry, and what it refuses or leaves alone."""

from __future__ import annotations

import copy
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _harness import TESTED, prepare  # noqa: E402

prepare()

from torchtitan.models.common.attention import FusedQKVLinear as StockFusedQKV  # noqa: E402
from torchtitan.models.llama3 import llama3_configs  # noqa: E402

from commfuse.errors import CommfuseTypeError  # noqa: E402
from commfuse.integrations import torchtitan as cf_titan  # noqa: E402


def test_the_installed_torchtitan_is_the_one_tested():
    # a new torchtitan release must be tested here and added to TESTED by name, not slip in
    assert version("torchtitan") in cf_titan.TESTED == TESTED


@pytest.mark.parametrize("name", sorted(llama3_configs))
def test_every_llama3_config_in_torchtitans_registry_is_swapped_whole(name):
    config = llama3_configs[name](attn_backend="flex")
    before = copy.deepcopy(config)
    swapped = cf_titan.use_commfuse(config, algorithm="ring")
    assert len(swapped) == 4 * len(config.layers)
    for layer, old in zip(config.layers, before.layers):
        # FlexAttention with the decoder's causal document masks: the attention is split by query too
        assert type(layer.attention) is cf_titan.Attention.Config
        assert layer.attention.causal and layer.attention.algorithm == "ring"
        assert type(layer.attention.qkv_linear) is cf_titan.FusedQKVLinear.Config
        assert type(layer.attention.wo) is cf_titan.RowParallelLinear.Config
        assert type(layer.feed_forward) is cf_titan.FeedForward.Config
        assert layer.attention.qkv_linear.algorithm == "ring"
        kept = {k: v for k, v in layer.attention.to_dict().items() if k not in ("qkv_linear", "wo")}
        assert kept == {**{k: v for k, v in old.attention.to_dict().items() if k not in ("qkv_linear", "wo")},
                        "algorithm": "ring", "causal": True}
        # every stock field kept: the built module has the stock sizes, FQNs and initialisation
        for new, stock in ((layer.attention.qkv_linear, old.attention.qkv_linear), (layer.attention.wo, old.attention.wo),
                           (layer.feed_forward, old.feed_forward)):
            assert new.to_dict() == {**stock.to_dict(), "algorithm": "ring"}


def test_the_built_module_keeps_torchtitans_state_dict_keys():
    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:1]
    stock = copy.deepcopy(config).build()
    cf_titan.use_commfuse(config)
    fused = config.build()
    assert isinstance(fused.layers["0"].attention.qkv_linear, StockFusedQKV)
    assert list(fused.state_dict()) == list(stock.state_dict())
    assert any(k.endswith("attention.qkv_linear.wq.weight") for k in fused.state_dict())  # saved split, as stock


def test_a_config_without_layers_is_refused_by_name():
    with pytest.raises(CommfuseTypeError, match="layers"):
        cf_titan.use_commfuse(object())


def test_a_block_it_cannot_fuse_whole_is_left_stock():
    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:1]
    config.layers[0].attention.qkv_linear = object()  # not a Q/K/V projection it knows
    assert cf_titan.use_commfuse(config) == ["layers.0.feed_forward"]
    assert type(config.layers[0].attention.wo).__name__ == "Config" and \
        not isinstance(config.layers[0].attention.wo, cf_titan.RowParallelLinear.Config)


@pytest.mark.parametrize(("core", "causal"), [("sdpa", True), ("flex", True), ("varlen causal", True),
                                               ("varlen whole", False), ("varlen window", None)])
def test_the_attention_core_decides_whether_attention_is_split_by_query(core, causal):
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:1]
    config.layers[0].attention.inner_attention = {
        "sdpa": ScaledDotProductAttention.Config(), "flex": FlexAttention.Config(),
        "varlen causal": VarlenAttention.Config(window_size=(-1, 0)),
        "varlen whole": VarlenAttention.Config(window_size=(-1, -1)),
        "varlen window": VarlenAttention.Config(window_size=(128, 0))}[core]
    swapped = cf_titan.use_commfuse(config)
    attention = config.layers[0].attention
    if causal is None:  # a sliding window: commfuse's slices do not reproduce it, torchtitan's core stays
        assert "layers.0.attention" not in swapped and type(attention) is not cf_titan.Attention.Config
        assert type(attention.wo) is cf_titan.RowParallelLinear.Config  # the projections are fused still
    else:
        assert "layers.0.attention" in swapped and attention.causal is causal


def test_query_split_false_keeps_torchtitans_attention_core():
    config = llama3_configs["debugmodel"](attn_backend="flex")
    swapped = cf_titan.use_commfuse(config, query_split=False)
    assert len(swapped) == 3 * len(config.layers)
    assert not any(type(layer.attention) is cf_titan.Attention.Config for layer in config.layers)


def test_attention_is_refused_without_the_fused_projections():
    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:1]
    cf_titan.use_commfuse(config)
    config.layers[0].attention.wo = before = copy.deepcopy(llama3_configs["debugmodel"](attn_backend="flex").layers[0].attention.wo)
    assert not isinstance(before, cf_titan.RowParallelLinear.Config)
    with pytest.raises(CommfuseTypeError, match="qkv_linear and wo must be"):
        config.build()
