"""Tier (a), one process each (torch's fake process group, in a subprocess so that its group never meets the test
process's): the flight recorder stays bounded over 10,000 calls, dumps on SIGTERM and lets the signal end the
process, leaves a program's own SIGTERM handler alone, and can be turned off; its settings are checked."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from commfuse.errors import CommfuseValueError
from commfuse.runtime.recorder import size_from_env

PRELUDE = textwrap.dedent("""
    import json, os, signal, sys, time, tracemalloc
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import commfuse as cf
    from commfuse import metrics
    from commfuse.runtime.recorder import recorders
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    a, w, x = torch.randn(4, 8), torch.randn(8, 8), torch.randn(16, 8)
""")


def _run(body: str, tmp_path, env=None, timeout=120) -> subprocess.CompletedProcess:
    import os

    full = dict(os.environ, COMMFUSE_TRACE_DIR=str(tmp_path / "traces"), **(env or {}))
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=timeout, env=full)


def test_the_recorder_stays_bounded_over_ten_thousand_calls(tmp_path):
    done = _run("""
        def call(i):
            if i % 2:
                cf.all_gather_matmul(a, w, algorithm="ring", check=False)
            else:
                cf.matmul_reduce_scatter(x, w, algorithm="vanilla", check=False)
        call(0)
        call(1)
        import gc
        from commfuse.runtime.compiled import Plan
        for plan in (o for o in gc.get_objects() if isinstance(o, Plan)):
            plan.stamps = True  # the fake group's waits return at once, so it takes no stamps: take them here
        for i in range(2, 2000):
            call(i)
        (rec,) = recorders()
        tracemalloc.start()
        for i in range(2000, 6000):  # what fills once (the interpreter's free lists) is not growth
            call(i)
        before = tracemalloc.take_snapshot()
        for i in range(6000, 10000):
            call(i)
        after = tracemalloc.take_snapshot()
        # what was allocated in the runtime (the recorder and the loop that writes it) and is still alive; the
        # interpreter's free lists, filled by any code, swap hundreds of kB between sites and are left out
        runtime = [tracemalloc.Filter(True, "*commfuse/runtime/*")]
        growth = sum(s.size_diff for s in after.filter_traces(runtime).compare_to(before.filter_traces(runtime),
                                                                                  "filename"))
        records = rec.calls()
        paths = metrics.dump_trace()
        dumped = json.load(open(paths[0]))
        print(json.dumps({"ring": len(rec.ring), "records": len(records), "growth": growth,
                          "steps": max(len(c.steps) for c in records),
                          "seqs": [c["seq"] for c in dumped["calls"]], "kept": dumped["kept"]}))
    """, tmp_path, env={"COMMFUSE_RECORDER": "32"})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ring"] == 32 and out["records"] == 32 and out["kept"] == 32, out
    assert out["seqs"] == list(range(10000 - 32, 10000)), out["seqs"]  # the last 32 calls, oldest first
    assert 0 < out["steps"] <= 3 * 4, out  # a call's stamps: at most three per step of its plan
    assert out["growth"] < 16 * 1024, out  # 4000 more calls, and nothing more kept


def test_calls_that_take_no_stamps_are_kept_as_tuples_and_stay_bounded(tmp_path):
    # the fake group's waits return at once, so its calls take no stamps: the recorder keeps one tuple each
    # (a device's fast path), read into records only when asked
    done = _run("""
        for i in range(3):
            cf.all_gather_matmul(a, w, algorithm="ring", check=False)
        (rec,) = recorders()
        tracemalloc.start()
        for i in range(3, 5000):
            cf.all_gather_matmul(a, w, algorithm="ring" if i % 2 else "vanilla", check=False)
        before = tracemalloc.take_snapshot()
        for i in range(5000, 10000):
            cf.all_gather_matmul(a, w, algorithm="ring" if i % 2 else "vanilla", check=False)
        after = tracemalloc.take_snapshot()
        runtime = [tracemalloc.Filter(True, "*commfuse/runtime/*")]
        growth = sum(s.size_diff for s in after.filter_traces(runtime).compare_to(before.filter_traces(runtime),
                                                                                  "filename"))
        kinds = sorted({type(e).__name__ for e in rec.entries})
        dumped = json.load(open(metrics.dump_trace()[0]))
        print(json.dumps({"kinds": kinds, "growth": growth, "seqs": [c["seq"] for c in dumped["calls"]],
                          "status": sorted({c["status"] for c in dumped["calls"]}),
                          "ends": all(c["end_ns"] == c["start_ns"] for c in dumped["calls"]),
                          "algs": sorted({c["algorithm"] for c in dumped["calls"]})}))
    """, tmp_path, env={"COMMFUSE_RECORDER": "16"})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["kinds"] == ["tuple"], out
    assert out["seqs"] == list(range(10000 - 16, 10000)), out["seqs"]
    assert out["status"] == ["ok"] and out["ends"], out  # the host's enqueue: its end is its start
    assert out["algs"] == ["ring", "vanilla"], out
    assert out["growth"] < 16 * 1024, out


def test_a_call_without_stamps_is_seen_in_progress_and_failed(tmp_path):
    # a dump written inside a call shows it in progress; a call whose compute raised (its peers never hear,
    # the fake group has none) shows as failed, by its error, and the call before it as ok
    done = _run("""
        inside = []

        def consumer(part, s):
            if s == 1 and not inside:
                inside.append(metrics.dump_trace("from inside")[0])
            return part

        def broken(part, s):
            raise ValueError("the consumer broke on purpose")

        cf.all_gather_consume(a, consumer, algorithm="ring", check=False)
        seen = json.load(open(inside[0]))["calls"]
        try:
            cf.all_gather_consume(a, broken, algorithm="ring", check=False, timeout=1)
        except Exception as e:
            print("raised", type(e).__name__)
        after = json.load(open(metrics.dump_trace()[0]))["calls"]
        print(json.dumps({"inside": [(c["seq"], c["status"]) for c in seen],
                          "after": [(c["seq"], c["status"], c["error"]) for c in after]}))
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["inside"] == [[0, "in progress"]], out
    (first, second) = out["after"]
    assert first == [0, "ok", None], out
    assert second[:2] == [1, "failed"] and "the consumer broke on purpose" in second[2], out


def test_sigterm_dumps_the_recorder_and_still_ends_the_process(tmp_path):
    done = _run("""
        for _ in range(3):
            cf.all_gather_matmul(a, w, algorithm="ring", check=False)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        print("the signal was swallowed")
    """, tmp_path)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr)
    assert "swallowed" not in done.stdout
    (path,) = (tmp_path / "traces").glob("commfuse-trace-*-rank0.json")
    dump = json.loads(path.read_text())
    assert dump["reason"] == "SIGTERM received"
    assert [c["seq"] for c in dump["calls"]] == [0, 1, 2] and all(c["status"] == "ok" for c in dump["calls"])


def test_a_programs_own_sigterm_handler_is_left_alone(tmp_path):
    done = _run("""
        seen = []
        signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
        cf.all_gather_matmul(a, w, algorithm="ring", check=False)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print(json.dumps({"seen": seen, "dumps": metrics.dump_trace("the program's handler")}))
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["seen"] == [signal.SIGTERM] and len(out["dumps"]) == 1, out


def test_commfuse_recorder_zero_records_nothing(tmp_path):
    done = _run("""
        cf.all_gather_matmul(a, w, algorithm="ring", check=False)
        print(json.dumps({"recorders": len(recorders()), "dumps": metrics.dump_trace()}))
    """, tmp_path, env={"COMMFUSE_RECORDER": "0"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"recorders": 0, "dumps": []}


@pytest.mark.parametrize("bad", ["-1", "lots", "1e3", str(1 << 20)])
def test_a_bad_recorder_size_is_refused_by_name(monkeypatch, bad):
    monkeypatch.setenv("COMMFUSE_RECORDER", bad)
    with pytest.raises(CommfuseValueError, match="COMMFUSE_RECORDER"):
        size_from_env()


def test_trace_analyze_names_a_folder_without_dumps(tmp_path):
    done = subprocess.run([sys.executable, "-m", "commfuse", "trace", "analyze", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "no flight recorder dumps" in done.stderr and str(tmp_path) in done.stderr


def test_the_metrics_file_a_layers_calls_under_its_site(tmp_path):
    done = _run("""
        layer = cf.nn.ColumnParallelLinear(8, 16, bias=False, algorithm="ring")
        for _ in range(3):
            layer(torch.randn(2, 4, 8))  # (batch, sequence shard, features)
        cf.all_gather_matmul(a, w, algorithm="ring", check=False)
        snap = metrics.snapshot()
        again = metrics.snapshot()
        print(json.dumps({"snap": snap, "again": again}))
    """, tmp_path, env={"COMMFUSE_CHECK": "0"})  # the fake group moves no data: nothing to compare
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    snap = out["snap"]
    layer = [k for k in snap if k.endswith("/calls") and "ColumnParallelLinear" in k]
    assert len(layer) == 1 and snap[layer[0]] == 3, snap  # the layer's three calls, under its site
    assert snap["commfuse/0/all_gather_matmul.ring/calls"] == 1, snap  # the op outside any site
    assert not any(k.endswith("/calls") for k in out["again"]), out["again"]  # nothing new since


def test_device_stamps_are_read_only_once_the_device_passed_them(tmp_path):
    # COMMFUSE_DEVICE_TIMING's bookkeeping, on the fake group: the plans are switched to device stamps and the
    # backend's timing events are host-clock stand-ins (a CPU has no torch.Event; the real events are checked
    # on a GPU by benchmarks/recorder_device.py). An event the "device" has not reached keeps its call out of
    # the metrics (counted by a later snapshot) and makes the dump say the call is in progress at that step.
    done = _run("""
        import gc
        from commfuse.runtime.compiled import Plan
        from commfuse.runtime.recorder import DEVICE

        class HostEvent:
            made = 0
            reached = True
            def __init__(self):
                HostEvent.made += 1
                self.t = None
            def record(self):
                self.t = time.perf_counter_ns()
            def query(self):
                return HostEvent.reached and self.t is not None
            def elapsed_time(self, end):
                return (end.t - self.t) / 1e6

        call = lambda: cf.all_gather_matmul(a, w, algorithm="ring", check=False)
        call()
        metrics.snapshot()
        for plan in (o for o in gc.get_objects() if isinstance(o, Plan)):
            plan.stamps = DEVICE
            plan.backend.timing_event = HostEvent
        for _ in range(5):
            call()
        made = HostEvent.made
        for _ in range(5):
            call()
        first = metrics.snapshot()
        HostEvent.reached = False
        for _ in range(2):
            call()
        pending = metrics.snapshot()
        path = metrics.dump_trace()[0]
        HostEvent.reached = True
        later = metrics.snapshot()
        dump = json.load(open(path))
        print(json.dumps({"made": made, "after": HostEvent.made, "first": first, "pending": pending,
                          "later": later, "last": dump["calls"][-1]}))
    """, tmp_path, env={"COMMFUSE_CHECK": "0", "COMMFUSE_RECORDER": "4"})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    key = "commfuse/0/all_gather_matmul.ring/"
    # a ring of 4 waits 3 steps, two events each, made once per record (4 kept) and only recorded again after
    assert out["made"] == 4 * 3 * 2 and out["after"] == out["made"], out
    assert out["first"][key + "calls"] == 4 and out["first"][key + "wait_ms"] > 0, out["first"]
    assert not any(k.endswith("/calls") for k in out["pending"]), out["pending"]  # not reached: not counted
    assert out["later"][key + "calls"] == 2, out["later"]  # counted once the device passed them
    last = out["last"]
    assert last["stamped"] == "device" and last["status"] == "in progress", last
    assert last["waiting"]["device"] and last["waiting"]["step"] == last["steps"][0]["step"], last
    assert all(s["device_wait_ns"] is None for s in last["steps"]), last
