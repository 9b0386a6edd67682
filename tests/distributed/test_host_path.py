"""Tier (b), real processes on torch's fake process group: what a planned call costs the host, in counts
that cannot be noisy (timings live in benchmarks/host_overhead.py).

On the fake group every transfer completes at once, so each rank runs its whole schedule alone: the
test sees the host path exactly as a GPU run would drive it.
"""

from __future__ import annotations

import json
import subprocess
import sys

ALGORITHMS = ("ring", "ring:2", "bidirectional", "vanilla", "sliced:2", "serial")


def _no_cycles(n):
    """Unreachable objects per call, after the first call of each signature (plans are made then)."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import commfuse as cf

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    a, w, x = torch.randn(4, 8), torch.randn(8, 8), torch.randn(4 * n, 8)
    out = {}
    with torch.no_grad():
        for alg in ALGORITHMS:
            calls = {
                "all_gather_matmul": lambda: cf.all_gather_matmul(a, w, algorithm=alg, check=False),
                "matmul_reduce_scatter": lambda: cf.matmul_reduce_scatter(x, w, algorithm=alg, check=False),
                "all_gather_consume": lambda: cf.all_gather_consume(a, lambda t, s: t.sum(), algorithm=alg,
                                                                    check=False),
            }
            for name, call in calls.items():
                call()
                gc.collect()
                gc.disable()
                try:
                    for _ in range(50):
                        call()
                    out[f"{name}-{alg}"] = gc.collect()
                finally:
                    gc.enable()
    return out


def test_a_planned_call_leaves_no_reference_cycles_for_the_garbage_collector():
    # A cycle per call (a closure that refers to the program that holds it) leaves every call's tensors to
    # the collector's passes: measured at about a third of a small call's host time before it was removed.
    code = f"import json, sys; sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r}); " \
           "import test_host_path as t; print(json.dumps(t._no_cycles(4)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == 3 * len(ALGORITHMS) and all(v == 0 for v in found.values()), {
        k: v for k, v in found.items() if v}
