"""The backend-agnostic schedule core: pure Python, imports no torch.

``build`` makes a :class:`Schedule` (what every rank does at every step),
``render`` prints it as a step table, and the ``*_ref`` functions define what
each collective means over per-rank lists.
"""

from commfuse.schedule._builders import ALGORITHMS, build
from commfuse.schedule._ir import Algorithm, Collective, CollectiveCall, Schedule, SliceId, Step, Transfer
from commfuse.schedule._overlap import hidden_fraction
from commfuse.schedule._permute import LoweringError, hop_slice, permute_plan
from commfuse.schedule._reference import all_gather_ref, all_to_all_ref, reduce_scatter_ref, run_schedule
from commfuse.schedule._render import render
from commfuse.schedule._ring import Ring
from commfuse.schedule._spec import (
    ALGORITHM_NAMES,
    AlgorithmSpec,
    offsets,
    parse_algorithm,
    site_algorithm,
    split_sizes,
)
from commfuse.schedule._validate import validate

__all__ = [
    "ALGORITHMS",
    "ALGORITHM_NAMES",
    "AlgorithmSpec",
    "Algorithm",
    "Collective",
    "CollectiveCall",
    "LoweringError",
    "Ring",
    "Schedule",
    "SliceId",
    "Step",
    "Transfer",
    "all_gather_ref",
    "all_to_all_ref",
    "build",
    "hidden_fraction",
    "hop_slice",
    "offsets",
    "parse_algorithm",
    "permute_plan",
    "reduce_scatter_ref",
    "render",
    "run_schedule",
    "site_algorithm",
    "split_sizes",
    "validate",
]
