"""The capabilities file for the conformance suite: the ``jax`` backend's ranks are devices of one program.

``commfuse conformance --backend jax -n N`` finds this file beside the plugin
(the record declares ``whole_ops``). The tiers that launch ranks as processes
skip by ``traced_check``; the traced tier calls :func:`check`, which executes
every case of :mod:`commfuse_jax.verify` on N CPU host devices (float32 and
bfloat16, forward and backward, against plain torch) and checks each case's
lowered HLO against its schedule.
"""

from __future__ import annotations

import os
import sys

import commfuse.testing


class Capabilities(commfuse.testing.Capabilities):
    dtypes = ("float32", "bfloat16")
    device = "jax"
    traced_check = "commfuse_jax.conformance:check"


def check(world_size: int) -> list[str]:
    """Every verify case at ``world_size`` host devices; the failures, as lines."""
    if "jax" not in sys.modules:  # the host devices are fixed when jax starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={max(8, world_size)}").strip()
    from commfuse_jax import verify

    failures = []
    for case in verify.CASES:
        for dtype in ("float32", "bfloat16"):
            fwd, bwd, scale = verify.run_case(case, world_size, dtype)
            tol = verify.tolerance(case, dtype) * scale
            if fwd > tol or bwd > tol:
                failures.append(f"world {world_size} {case} {dtype}: forward error {fwd:.3g}, backward {bwd:.3g}, "
                                f"allowed {tol:.3g}")
        failures += [f"world {world_size} {case} hlo: {f}" for f in
                     verify.check_hlo(case, world_size, verify.lowered_hlo(case, world_size))]
    return failures
