"""Tier (b), real gloo ranks: mixed precision. Under torch.autocast (bfloat16 and float16) commfuse's fused ops,
commfuse.nn's layers and commfuse.tp's styles compute and communicate in the autocast dtype and give the output
and gradient dtypes torch's own styles and modules give, with values within the dtype's tolerance, forward and
backward, eager and compiled; a low-precision input into float32 weights without autocast is refused by name, as
torch refuses it; and FSDP2's MixedPrecisionPolicy composes with the styles and with ShardedLinear.

``pytest -s -k table`` prints the autocast comparison table (torch's dtypes against commfuse's, the largest
differences)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _mixed_precision_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402

DTYPES = ("bfloat16", "float16")
STYLES = ("colwise", "rowwise", "rowwise-lowp-in", "mlp", "swiglu", "attention")
LAYERS = ("ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelAttention", "UlyssesAttention",
          "ShardedLinear")
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "produce_reduce_scatter")


@functools.lru_cache(maxsize=None)
def _results(body: str, n: int, *args) -> list[dict]:
    return launch(getattr(cases, body), n, *args, timeout=900)


def _check(body: str, n: int, name: str, *args):
    """Every rank's result for ``name`` (a rank that raised fails the test with its traceback); rank 0's value."""
    results = _results(body, n, *args)
    errors = {r: res.get(name, ("error", "did not run")) for r, res in enumerate(results)}
    errors = {r: value for r, (status, value) in errors.items() if status != "ok"}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())
    return results[0][name][1]


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", STYLES)
def test_styles_under_autocast_match_torch_styles(style, dtype, n):
    _check("styles", n, f"{style}-{dtype}")


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer", LAYERS)
def test_layers_under_autocast_match_torch_modules(layer, dtype, n):
    _check("layers", n, f"{layer}-{dtype}")


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_ops_under_autocast_compute_and_communicate_in_its_dtype(op, dtype, n):
    _check("ops", n, f"{op}-{dtype}")


@pytest.mark.parametrize("backend", ("aot_eager", "inductor"))
@pytest.mark.parametrize("name", [f"functional-{d}-{where}" for d in DTYPES for where in ("outside", "inside")]
                         + ["layer-mlp", "layer-attention", "layer-sharded"])
def test_compiled_custom_ops_follow_autocast(name, backend):
    _check("compiled", 2, name, backend)


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", ("styles", "layers"))
def test_low_precision_input_without_autocast_is_refused_as_torch_refuses_it(name, n):
    _check("mixed", n, name)


@pytest.mark.parametrize("name", ("styles", "sharded-beside-fsdp"))
def test_fsdp2_mixed_precision_policy_composes(name):
    _check("fsdp_policy", 4, name)


def test_autocast_comparison_table():
    """The table the closing note shows: every style, layer and op at 2 ranks under bfloat16 and float16."""
    rows = []
    for body, names in (("styles", STYLES), ("layers", LAYERS), ("ops", OPS)):
        for name in names:
            for dtype in DTYPES:
                rows.append(_check(body, 2, f"{name}-{dtype}"))
    rows += _check("fsdp_policy", 4, "styles")
    header = ("style / layer / op", "autocast", "torch out", "commfuse out", "torch grads", "commfuse grads",
              "max |d out|", "max |d grad|")
    table = [header] + [(r["what"], r["autocast"], r["torch_out"], r["commfuse_out"], r["torch_grads"],
                         r["commfuse_grads"], f"{r['max_out_diff']:.2e}", f"{r['max_grad_diff']:.2e}") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    print("\nautocast comparison table (2 gloo ranks; ShardedLinear against FSDP2's nn.Linear, the other layers "
          "against the unsharded module; 4 ranks, dp 2 x tp 2, for the FSDP2 policy rows)")
    for i, row in enumerate(table):
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    for r in rows:
        assert r["torch_out"] == r["commfuse_out"] and r["torch_grads"] == r["commfuse_grads"], r
