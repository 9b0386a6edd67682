"""Tier (b), real gloo ranks: torch.ops.commfuse under opcheck, and the functional ops and commfuse.nn's
layers under torch.compile(fullgraph=True): one graph, no break, and what eager gives, gradients included.
On the inductor backend on CPU, and on torch's fake process group at world size 8."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _compile_cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402


@functools.lru_cache(maxsize=None)
def _results(body: str, n: int, *args) -> list[dict]:
    return launch(getattr(_compile_cases, body), n, *args, timeout=900)


def _check(name: str, body: str, n: int, *args) -> None:
    results = _results(body, n, *args)
    errors = {r: res.get(name, "did not run") for r, res in enumerate(results) if res.get(name, "missing")}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())


OPS = ("all_gather_matmul", "all_gather_matmul-dim0-bidirectional", "all_gather_matmul-transposed-weight",
       "matmul_reduce_scatter", "matmul_reduce_scatter-avg-vanilla", "attention_reduce_scatter", "sharded_linear",
       "sharded_linear-no-bias-sum", "replicated")
LAYERS = ("mlp", "mlp-auto", "attention", "attention-full-mha", "sharded", "sharded-sum-no-bias")


@pytest.mark.parametrize("op", OPS)
def test_every_op_passes_opcheck(op):
    _check(op, "opcheck", 2)


@pytest.mark.parametrize("backend", ("aot_eager", "inductor"))
def test_functional_ops_compile_to_one_graph_and_equal_eager(backend):
    _check(f"functional-{backend}", "functional", 2, backend)
    _check(f"functional-no-grad-{backend}", "functional", 2, backend)


# Inductor's code generation is what these check at 2 ranks (a C++ compile per rank, the slowest cases of the
# suite); a ring of several hops inside a compiled graph is checked at 4 ranks under aot_eager (the same graph
# and the same commfuse ops, without the code generation), and the graph at world size 8 on the fake group below.
COMPILED = ((2, "inductor"), (4, "aot_eager"))


@pytest.mark.parametrize(("n", "backend"), COMPILED)
@pytest.mark.parametrize("layer", LAYERS)
def test_layers_compile_to_one_graph_and_train_as_eager(layer, n, backend):
    _check(f"{layer}-{backend}", "layers", n, backend)


@pytest.mark.parametrize("family", ("gemma2", "qwen3"))
def test_transformers_attention_compiles_with_inductor_to_one_graph(family):
    pytest.importorskip("transformers")
    _check(f"{family}-inductor", "transformers_attention", 2, "inductor")


@pytest.mark.parametrize(("n", "backend"), COMPILED)
@pytest.mark.parametrize("model", ("llama-block", "colwise-rowwise-mlp"))
def test_tp_styles_compile_to_one_graph_of_fused_ops(model, n, backend):
    _check(f"{model}-{backend}", "styles", n, backend)


def test_compiled_llama_block_under_fully_shard_trains_as_eager():
    # torchtitan's order: TP styles, then torch.compile of the block, then FSDP2 on the dp mesh (2 x 2)
    _check("llama-fsdp-aot_eager", "llama_fsdp", 4, "aot_eager")


@pytest.mark.parametrize("name", ("option-refused", "consume-refused-in-fullgraph",
                                  "consume-runs-eagerly-at-a-graph-break", "sharded-no-sync-refused",
                                  "ulysses-refused-then-runs-eagerly"))
def test_what_does_not_compile_says_so(name):
    _check(name, "refusals", 2)


@functools.lru_cache(maxsize=None)
def _fake_group(n: int) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import _compile_cases as c; "
            f"print(json.dumps(c.fake_group({n})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_compile_on_the_fake_group_at_world_size_8(layer):
    got = _fake_group(8)
    assert layer in got, sorted(got)
    assert got[layer] is None, got[layer]
