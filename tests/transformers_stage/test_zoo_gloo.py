"""Tier (b), real gloo ranks: whole HuggingFace transformers decoder models (small configs, random weights, no
hub) under a tensor-parallel plan with sequence parallelism on 2 ranks, trained two AdamW steps in float64
beside the same model in one process. Each family runs under torch's styles, under commfuse's per-linear styles
(swapped into torch's plan, and given the sequence-sharded input so that each gather is fused), and under
commfuse's block styles (with commfuse's MoE for a sparse block). Every run gives the model's loss and every
gradient, or commfuse refuses a module by its path and part when the plan is applied, and then the per-linear
styles on that module give them. ``-s`` prints the table. Runs in the transformers stage
(``ci/test_transformers.sh``)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _zoo_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402

RANKS = 2


@functools.lru_cache(maxsize=None)
def _zoo() -> list[dict]:
    """Every family, every run, on each rank: one launch, so that each rank imports transformers once."""
    return launch(cases.zoo, RANKS, tuple(cases.FAMILIES), timeout=600)


@pytest.mark.parametrize("run", cases.RUNS)
@pytest.mark.parametrize("name", sorted(cases.FAMILIES))
def test_the_model_trains_as_in_one_process_or_a_module_is_refused_by_name(name, run):
    """Within the family's tolerance, on every rank; the ranks refused the same modules; where commfuse's
    styles are given the sequence-sharded activation, every commfuse site ran a fused op."""
    results = [rank_results[name][0][run] for rank_results in _zoo()]
    for rank, (worst, refusals, error, (fused, unfused)) in enumerate(results):
        assert error is None, f"rank {rank}: {error}"
        assert worst is not None and worst[0] <= cases.FAMILIES[name].tolerance, f"rank {rank}: {worst}"
        if run == "torch":
            assert not fused and not unfused, f"rank {rank}: commfuse sites under torch's styles: {fused + unfused}"
        elif run != "per-linear":
            assert fused and not unfused, f"rank {rank}: no fused op ran at {unfused}"
    paths = [[path for path, _ in refusals] for _, refusals, _, _ in results]
    assert all(p == paths[0] for p in paths), f"the ranks refused different modules: {paths}"


def test_the_table():
    """Every family and run on every rank, printed (``-s``): the largest relative difference from the model
    in one process over the loss and every gradient of two AdamW steps, and what commfuse refused."""
    results = _zoo()
    width = max(map(len, cases.FAMILIES)) + 2
    lines = [f"{RANKS} gloo ranks, float64, 2 AdamW steps; the largest relative difference of the loss and "
             "every gradient from the model in one process, and how many of commfuse's sites ran a fused op "
             "(rank 0):", "", "model".ljust(width) + "".join(run.ljust(34) for run in cases.RUNS) + "seconds"]
    notes = []
    for name in cases.FAMILIES:
        per_rank = [r[name] for r in results]
        assert all(set(runs) == set(cases.RUNS) for runs, _ in per_rank), name
        runs, seconds = per_rank[0]
        cells = []
        for run in cases.RUNS:
            worst, refusals, error, sites = runs[run]
            cell = "FAILED" if error else f"{worst[0]:.1e}"
            if sites is not None and run != "torch":
                cell += f", {len(sites[0])}/{len(sites[0]) + len(sites[1])} fused"
            if refusals:
                cell += f" ({len(refusals)} refused)"
                notes += [f"{name}, {run}: refused {path}: {' '.join(message.split())[:260]}..."
                          for path, message in refusals]
            cells.append(cell.ljust(34))
        lines.append(name.ljust(width) + "".join(cells) + f"{seconds:.1f}")
    print("\n" + "\n".join(lines + [""] + notes))
