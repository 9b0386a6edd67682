"""Moved; where each job lives. This module only re-exports, for the callers not yet pointed at the new homes.

The pipelined primitives (a collective's ring steps with the caller's compute on each arriving piece, the
level of torch's ``_pipelined_all_gather_and_consume``) are split by job, each module importing only
those above it in this list:

* ``planning.derive``: the call a plan is made for (:func:`capped`, :func:`configured`,
  :func:`layer_config`);
* ``planning.plans``: the plan entries kept in the table (:func:`schedule_for`, :func:`compiled_for`,
  :class:`SignaturePlan`);
* ``planning.spans``: rows along a dim (:func:`join`, :func:`consecutive`, :func:`rows_of`,
  :func:`write_rows`, :func:`matmul_rows`);
* ``planning.consumers``: what a program calls as pieces arrive (:class:`StandIn`, :data:`collect`);
* ``planning.gather``: the all-gather and consume, at each of its layers (:func:`all_gather_consume_core`,
  :func:`gather_spans`, :func:`prepare_gather`, :func:`run_gather`, :func:`run_gather_one_by_one`);
* ``planning.scatter``: the produce and reduce-scatter (:func:`produce_reduce_scatter_core`,
  :func:`scatter_spans`, :func:`prepare_scatter`, :func:`run_scatter`, :func:`scatter_runners`, ...);
* ``planning.all_to_all``: the all-to-all forms and :func:`exchange_sizes`;
* ``planning.all_reduce``: :func:`all_reduce_core`, :func:`group_sum`.

How fingerprints read back (:func:`gather_matmul_meta` and every op's describer) is
``commfuse.runtime.fingerprints``.
"""

from __future__ import annotations

from commfuse.planning.all_reduce import all_reduce_core, group_sum
from commfuse.planning.all_to_all import a2a_layout, all_to_all_consume_core, exchange_sizes, produce_all_to_all_core
from commfuse.planning.consumers import StandIn, collect
from commfuse.planning.consumers import handed_over as _handed_over  # noqa: F401 - tests import it from here
from commfuse.planning.derive import capped, configured, layer_config
from commfuse.planning.gather import (
    all_gather_consume_core,
    gather_spans,
    prepare_gather,
    run_gather,
    run_gather_one_by_one,
    gather_walk,
)
from commfuse.planning.plans import SignaturePlan, compiled_for, schedule_for
from commfuse.planning.scatter import (
    prepare_scatter,
    produce_reduce_scatter_core,
    run_scatter,
    run_scatter_one_by_one,
    run_scatter_whole,
    scatter_runners,
    scatter_spans,
    scatters_whole,
)
from commfuse.planning.spans import consecutive, join, matmul_rows, rows_of, write_rows
from commfuse.runtime.fingerprints import gather_matmul_meta

__all__ = [
    "StandIn", "a2a_layout", "all_gather_consume_core", "all_reduce_core", "group_sum", "all_to_all_consume_core", "capped",
    "collect", "compiled_for", "gather_matmul_meta",
    "configured", "consecutive", "exchange_sizes", "layer_config", "produce_all_to_all_core",
    "gather_spans", "join", "matmul_rows", "prepare_gather", "prepare_scatter", "produce_reduce_scatter_core",
    "SignaturePlan", "rows_of", "run_gather", "run_gather_one_by_one", "gather_walk", "run_scatter", "run_scatter_one_by_one",
    "run_scatter_whole", "schedule_for",
    "scatter_runners", "scatter_spans", "scatters_whole", "write_rows",
]
