"""Tier (a): ``algorithm`` is parsed and checked when a style or a layer is built (and whenever a layer's is
set), naming the class and the text, not at the first forward."""

from __future__ import annotations

import pytest

from commfuse.errors import CommfuseValueError
from commfuse.nn import (
    ColumnParallelLinear,
    MoE,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    ShardedLinear,
    UlyssesAttention,
)
from commfuse.tp import AttentionParallel, ColwiseParallel, RowwiseParallel, SwiGLUParallel

STYLES = {
    "ColwiseParallel": lambda a: ColwiseParallel(algorithm=a),
    "RowwiseParallel": lambda a: RowwiseParallel(algorithm=a),
    "SwiGLUParallel": lambda a: SwiGLUParallel(algorithm=a),
    "AttentionParallel": lambda a: AttentionParallel(head_dim=8, algorithm=a),
}
LAYERS = {  # world size 1 (no process group): building one needs no ranks
    "ColumnParallelLinear": lambda a: ColumnParallelLinear(8, 8, algorithm=a),
    "RowParallelLinear": lambda a: RowParallelLinear(8, 8, algorithm=a),
    "ParallelMLP": lambda a: ParallelMLP(8, 16, algorithm=a),
    "ParallelAttention": lambda a: ParallelAttention(8, 2, algorithm=a),
    "UlyssesAttention": lambda a: UlyssesAttention(8, 2, algorithm=a),
    "ShardedLinear": lambda a: ShardedLinear(8, 8, algorithm=a),
    "MoE": lambda a: MoE(8, 8, 2, 1, algorithm=a),
}
#: where each algorithm is not defined: native only has fused GEMMs, bidirectional no all-to-all
NOT_FOR = {
    "native": ("AttentionParallel", "ParallelAttention", "UlyssesAttention", "ShardedLinear", "MoE"),
    "bidirectional": ("UlyssesAttention", "MoE"),
}


@pytest.mark.parametrize("name", [*STYLES, *LAYERS])
@pytest.mark.parametrize("bad", ["rign", "ring:0", "sliced:x", "auto:2", "", "Ring"])
def test_a_misspelt_algorithm_is_refused_when_built_naming_the_class_and_the_text(name, bad):
    make = {**STYLES, **LAYERS}[name]
    with pytest.raises(CommfuseValueError) as e:
        make(bad)
    assert name.replace("ParallelMLP", "ColumnParallelLinear") in str(e.value), str(e.value)
    assert repr(bad) in str(e.value), str(e.value)


@pytest.mark.parametrize("name", [*STYLES, *LAYERS])
@pytest.mark.parametrize("algorithm", ["auto", "ring", "ring:2", "vanilla", "sliced:4", "serial", "native",
                                       "bidirectional"])
def test_an_algorithm_is_taken_where_defined_and_refused_by_name_where_not(name, algorithm):
    make = {**STYLES, **LAYERS}[name]
    if name in NOT_FOR.get(algorithm, ()):
        with pytest.raises(CommfuseValueError, match=algorithm) as e:
            make(algorithm)
        assert name in str(e.value), str(e.value)
    else:
        assert make(algorithm).algorithm == algorithm


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_layers_algorithm_set_later_is_checked_too(name):
    layer = LAYERS[name]("ring")
    with pytest.raises(CommfuseValueError, match="rign"):
        layer.algorithm = "rign"
    assert layer.algorithm == "ring"
    layer.algorithm = "vanilla"
    assert layer.algorithm == "vanilla"


def test_a_style_refuses_an_algorithm_that_is_not_a_string_by_name():
    with pytest.raises(TypeError, match="ColwiseParallel"):
        ColwiseParallel(algorithm=2)
