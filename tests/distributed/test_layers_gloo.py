"""Tier (b), real gloo ranks (1-4): every layer's output and gradients equal the unsharded layer's.

Also the autograd of the fused ops for every algorithm, with the gathered
input kept or gathered again, and exact checkpoint round trips.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _layers_cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402

WORLD_SIZES = (1, 2, 3, 4)
LAYERS = ["column", "row", "mlp", "attention", "ulysses", "sharded", "roundtrip", "measure-modes"]
OPS = [f"ops-{alg}-keep{keep}-dim{dim}" for alg in ("ring", "bidirectional", "sliced:2", "vanilla")
       for keep in (True, False) for dim in (0, 1)]


@functools.lru_cache(maxsize=None)
def _battery(n: int) -> list[dict]:
    return launch(_layers_cases.layers, n, timeout=900)


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("name", LAYERS + OPS)
def test_layer_and_gradients_match_unsharded(n, name):
    if n == 1 and name.startswith("ops-"):
        name = name  # world size 1 runs them too: the ops are then the local computation
    errors = {r: res.get(name, "did not run") for r, res in enumerate(_battery(n)) if res.get(name, "missing")}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())


@functools.lru_cache(maxsize=None)
def _training(n: int) -> list[dict]:
    return launch(_layers_cases.training, n, timeout=900)


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("name", ["train-tpsp", "train-ulysses", "train-fsdp"])
def test_training_20_steps_follows_the_unsharded_loss_curve(n, name):
    errors = {r: res.get(name, "did not run") for r, res in enumerate(_training(n)) if res.get(name, "missing")}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())


@pytest.mark.parametrize("name", ["mesh-mlp-tp", "mesh-sharded-dp", "mesh-2d-rejected"])
def test_tp_by_dp_device_mesh(name):
    results = _mesh()
    errors = {r: res.get(name, "did not run") for r, res in enumerate(results) if res.get(name, "missing")}
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())


@functools.lru_cache(maxsize=None)
def _mesh() -> list[dict]:
    return launch(_layers_cases.mesh_2d, 4, timeout=600)
