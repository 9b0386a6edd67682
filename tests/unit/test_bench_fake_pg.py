"""`commfuse bench --fake-pg N`: one process, torch's fake process group, every algorithm against the unsliced GEMM.

On CPU here (the CUDA path needs a GPU). The mode runs in a subprocess so that
its process group never meets the test process's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from commfuse.bench.config import ALGORITHMS

FIELDS = {"mode", "workload", "op", "algorithm", "taken", "world_size", "device", "dtype", "tokens", "hidden", "ffn",
          "calls", "repeats", "device_ms", "device_p25_ms", "device_p75_ms", "host_ms", "gemm_ms", "vs_gemm", "tflops",
          "captured_ms", "captured_vs_gemm", "captured_vs_eager", "captured_not_measured", "compile_backend",
          "compiled_ms", "compiled_vs_gemm", "compiled_vs_eager", "compiled_not_measured", "compiled_first_call_s"}


def test_fake_pg_on_cpu_times_every_algorithm_against_the_gemm():
    cmd = [sys.executable, "-m", "commfuse.bench", "--fake-pg", "4", "--device", "cpu", "--tokens", "64",
           "--hidden", "32", "--ffn", "64", "--repeats", "2", "--warmup", "1", "--calls", "2", "--json", "-",
           "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    recs = json.loads(done.stdout)  # --json alone: only JSON on stdout, the table on stderr
    assert {(r["workload"], r["algorithm"]) for r in recs} == {
        (w, a) for w in ("ag_matmul", "matmul_rs") for a in ("gemm", *ALGORITHMS)}
    for r in recs:
        assert FIELDS <= set(r), r
        assert r["mode"] == "fake_pg" and r["world_size"] == 4 and r["device"] == "cpu" and r["dtype"] == "float32"
        assert (r["tokens"], r["hidden"], r["ffn"], r["calls"], r["repeats"]) == (64, 32, 64, 2, 2)
        assert r["device_p25_ms"] <= r["device_ms"] <= r["device_p75_ms"]
        assert 0 < r["device_ms"] < 10_000 and 0 < r["host_ms"] < 10_000 and r["gemm_ms"] > 0
        assert r["vs_gemm"] == pytest.approx(r["device_ms"] / r["gemm_ms"], rel=0.05)  # of the rounded figures
        assert r["host_ms"] == r["device_ms"]  # on CPU the ops run on the host
        if r["algorithm"] == "gemm":
            assert r["vs_gemm"] == 1.0
        # the captured column says why it is empty on CPU; the compiled one that it was not asked for
        assert r["captured_ms"] is None and r["captured_not_measured"] == "capture needs a CUDA device (this run: cpu)"
        assert r["compiled_ms"] is None and r["compile_backend"] is None
    taken = {r["algorithm"]: r["taken"] for r in recs if r["workload"] == "ag_matmul"}
    assert taken["serial"] == "serial" and taken["auto"] in ("ring", "vanilla", "bidirectional", "serial")
    table = done.stderr
    assert "all_gather_matmul: fake group, rank 0 of 4, cpu" in table and "matmul_reduce_scatter:" in table
    assert "unsliced GEMM" in table and "serial" in table
    assert "ring at most 1.25x the unsliced GEMM" in table and "figures only, no verdict" in table
    assert "captured ms/call (vs GEMM)" in table and "not measured" in table
    assert "captured: not measured: capture needs a CUDA device (this run: cpu)" in table
    assert ("ring captured in a CUDA graph at most 1.15x the unsliced GEMM: not measured: capture needs a CUDA "
            "device") in table


def test_fake_pg_compile_adds_the_compiled_op_column():
    """--compile on the fake group: torch.compile(fullgraph=True) of a function calling the op, beside eager; the
    captured column still says why it is empty on CPU."""
    cmd = [sys.executable, "-m", "commfuse.bench", "--fake-pg", "4", "--device", "cpu", "--tokens", "64",
           "--hidden", "32", "--ffn", "64", "--repeats", "2", "--warmup", "1", "--calls", "2", "-a", "ring",
           "--compile", "aot_eager", "--json", "-", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    recs = json.loads(done.stdout)
    assert {(r["workload"], r["algorithm"]) for r in recs} == {
        (w, a) for w in ("ag_matmul", "matmul_rs") for a in ("gemm", "vanilla", "ring")}
    for r in recs:
        assert r["compile_backend"] == "aot_eager"
        assert r["captured_ms"] is None and r["captured_not_measured"].startswith("capture needs a CUDA device")
        if r["algorithm"] == "gemm":
            assert r["compiled_ms"] is None
            continue
        assert r["compiled_ms"] > 0 and r["compiled_not_measured"] is None and r["compiled_first_call_s"] > 0
        assert r["compiled_vs_gemm"] == pytest.approx(r["compiled_ms"] / r["gemm_ms"], rel=0.05)
        assert r["compiled_vs_eager"] == pytest.approx(r["compiled_ms"] / r["device_ms"], rel=0.05)
    table = done.stderr
    assert "compiled ms/call (vs GEMM)" in table and "first compiled call s" in table
    assert "captured: not measured: capture needs a CUDA device" in table


def test_fake_pg_refuses_layer_workloads():
    cmd = [sys.executable, "-m", "commfuse.bench", "--fake-pg", "2", "--device", "cpu", "-w", "mlp", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "--fake-pg times the bare ops only" in done.stderr and "mlp" in done.stderr


_DEVICE_POST = r"""
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import commfuse as cf
from commfuse.bench import fakepg
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
be = fakepg._backend(torch.device("cpu"))
be._coalesce = True  # post as on a device (coalesced, or one by one through _handle), as --device cuda does
for alg in ("ring", "bidirectional", "vanilla"):
    got = cf.all_gather_matmul(torch.randn(8, 16), torch.randn(16, 4), algorithm=alg, backend=be, check=False)
    assert got.shape == (32, 4), got.shape
    got = cf.matmul_reduce_scatter(torch.randn(32, 16), torch.randn(16, 4), algorithm=alg, backend=be, check=False)
    assert got.shape == (8, 4), got.shape
print("posted through", type(be).__name__)
"""


def test_fake_pg_backend_posts_as_a_device_does():
    """The fake group's backend passes every argument of the device post path on to its base class: a device's
    post hands its works over through ``_handle`` (on CPU a step posts without it), so this is the path
    ``--device cuda`` takes, reached here by posting as a device would. (Its signature once fell behind the base's
    and every CUDA run of the mode failed at its first step.)"""
    done = subprocess.run([sys.executable, "-c", _DEVICE_POST], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "posted through FakeGroupC10dBackend" in done.stdout
