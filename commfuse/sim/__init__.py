"""The simulator: predict what an overlap algorithm gains before the cluster exists.

It walks the same :class:`~commfuse.schedule.Schedule` objects the executor
runs (``commfuse.schedule.build``), every rank, with a cost model of a
hardware :class:`Profile` in place of a backend; see ``docs/simulator.md``.

>>> from commfuse import sim
>>> w = sim.Workload("mlp", tp=4, seq=4096, hidden=4096, batch=32)
>>> for p in sim.compare("paper-table1", w):          # doctest: +SKIP
...     print(p.algorithm, round(1e3 * p.time, 1))
"""

from commfuse.sim._engine import MODES, Engine, OpCost, Phase, StepRecord, Timeline, simulate_phases
from commfuse.sim._model import Kernel, collective_time, efficiency, kernel_time, ring_step_rate
from commfuse.sim._models import MODELS, Model, ModelPart, ModelPrediction, compare_model, model_parts
from commfuse.sim._planner import choose, crossovers, explain, op_times, plan, profile_for
from commfuse.sim._predict import DEFAULT_ALGORITHMS, Prediction, compare, predict
from commfuse.sim._profile import (
    CollectiveSpec,
    ComputeSpec,
    ContentionSpec,
    HostSpec,
    LinkSpec,
    Profile,
    ProfileError,
    from_dict,
    load_profile,
    shipped,
    user_dir,
)
from commfuse.sim._workloads import (
    MLA,
    MOE_PRESETS,
    PASSES,
    WORKLOADS,
    AttentionWidths,
    ComputeOnly,
    ExpertOp,
    QuerySliceOp,
    ShardedOp,
    Workload,
    attention_widths,
    parse_algorithm,
)

__all__ = [
    "DEFAULT_ALGORITHMS",
    "MLA",
    "MODELS",
    "MODES",
    "MOE_PRESETS",
    "PASSES",
    "WORKLOADS",
    "AttentionWidths",
    "CollectiveSpec",
    "ComputeOnly",
    "ComputeSpec",
    "ContentionSpec",
    "Engine",
    "ExpertOp",
    "HostSpec",
    "Kernel",
    "LinkSpec",
    "Model",
    "ModelPart",
    "ModelPrediction",
    "OpCost",
    "Phase",
    "Prediction",
    "Profile",
    "ProfileError",
    "QuerySliceOp",
    "ShardedOp",
    "StepRecord",
    "Timeline",
    "Workload",
    "attention_widths",
    "choose",
    "collective_time",
    "compare",
    "compare_model",
    "crossovers",
    "efficiency",
    "explain",
    "from_dict",
    "kernel_time",
    "load_profile",
    "model_parts",
    "op_times",
    "parse_algorithm",
    "plan",
    "predict",
    "profile_for",
    "ring_step_rate",
    "shipped",
    "simulate_phases",
    "user_dir",
]
