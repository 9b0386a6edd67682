"""The flight recorder's device timing (``COMMFUSE_DEVICE_TIMING=1``) checked on a device, for one device run.

Tier: device check (prints a PASS/FAIL line per check with its figures; exits 1 where a check failed on this
rank). Two ranks under torchrun, NCCL and CUDA tensors; two NCCL ranks may share one GPU when each has its own
``NCCL_HOSTID`` (see ``gpu/README.md``: ``hostid.sh``)::

    torchrun --standalone --nproc-per-node 2 --no-python bash hostid.sh python3 benchmarks/recorder_device.py

The checks, in order:

1. ``device stamps``: the ring plans of a group made with ``COMMFUSE_DEVICE_TIMING=1`` stamp with the device's
   events (``Plan.stamps == "device"``), a second group made with it unset does not; after 20
   ``all_gather_matmul`` ring calls and a drain, ``commfuse.metrics.snapshot()`` counts all 20 with a
   positive device wait per call and a wait per peer.
2. ``slow peer``: rank 1 queues ``--delay-ms`` of extra GEMMs on its stream before each of 20 calls. Rank 0's
   stream then stalls in each call's wait for about that long more than rank 1's (the two ranks time-slice
   one GPU, so rank 1's stream waits for rank 0's kernels too): the difference of their device waits per
   call must exceed half of the delay measured on rank 1's stream, and the straggler verdict (``snapshot()``
   on both ranks, two rounds) names rank 1.
3. ``host cost`` (informational): host microseconds per call (no drain between calls, small tensors) on the
   group with device timing and on the group without, alternated over rounds; the difference is what the two
   event records per step cost the host.
4. ``stuck device``: rank 1's host sleeps ``--stall-s`` before its next call; rank 0 makes the call (its host
   returns at once: the stream waits) and dumps its recorder at once. The dump's last call must be ``in
   progress``, waiting on the device at its first step for rank 1, and ``commfuse trace analyze`` prints its
   verdict over the dumps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _checks import Checks

os.environ.setdefault("COMMFUSE_TRACE_DIR", os.path.join(os.environ.get("OUT", "."), "traces"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--stall-s", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    import commfuse as cf
    from commfuse import metrics
    from commfuse.runtime.compiled import Plan

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    timed = dist.new_group(backend="nccl")
    plain = dist.new_group(backend="nccl")
    checks = Checks(rank)
    report = checks.report

    dev = "cuda"
    a = torch.randn(args.tokens // 2, args.hidden, device=dev)
    w = torch.randn(args.hidden, args.hidden, device=dev)

    def call(group, x=a, weight=w):
        # COMMFUSE_DEVICE_TIMING is read when a signature is first planned: set for the timed group's calls
        if group is timed:
            os.environ["COMMFUSE_DEVICE_TIMING"] = "1"
        else:
            os.environ.pop("COMMFUSE_DEVICE_TIMING", None)
        return cf.all_gather_matmul(x, weight, group=group, algorithm="ring", check=False)

    def plan_stamps(group) -> set:
        import gc

        from commfuse.runtime.groups import state_of_group

        state = state_of_group(group)
        return {o.stamps for o in gc.get_objects() if isinstance(o, Plan) and o.state is state}

    # 1. device stamps
    for g in (timed, plain):
        call(g)
    torch.cuda.synchronize()
    dist.barrier()
    metrics.snapshot(exchange=False)
    for _ in range(20):
        call(timed)
    torch.cuda.synchronize()
    snap = metrics.snapshot(exchange=False)
    keys = {k: v for k, v in snap.items() if "all_gather_matmul.ring" in k}
    calls = [v for k, v in keys.items() if k.endswith("/calls")]
    per_call = [v for k, v in keys.items() if k.endswith("/wait_ms_per_call")]
    peers = [k for k in keys if "/wait_ms/rank" in k]
    report("device stamps", plan_stamps(timed) == {"device"} and plan_stamps(plain) == {False} and calls == [20]
           and per_call and per_call[0] > 0 and len(peers) == 1,
           f"stamps timed={plan_stamps(timed)} plain={plan_stamps(plain)}, snapshot {json.dumps(keys)}")

    # 2. slow peer
    extra = torch.randn(2048, 2048, device=dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 1
    if rank == 1:  # how many GEMMs make --delay-ms on this stream
        for _ in range(3):
            start.record()
            for _ in range(reps):
                extra @ extra
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
            reps = max(1, int(reps * args.delay_ms / max(ms, 1e-3)))
    delay = torch.tensor([0.0], device=dev)
    dist.barrier()
    torch.cuda.synchronize()
    metrics.snapshot(exchange=False)
    for _ in range(20):
        if rank == 1:
            start.record()
            for _ in range(reps):
                extra @ extra
            end.record()
        call(timed)
    torch.cuda.synchronize()
    if rank == 1:
        delay[0] = start.elapsed_time(end)
    dist.broadcast(delay, src=1)
    delay_ms = float(delay.item())
    snaps = [metrics.snapshot()]
    dist.barrier()
    snaps.append(metrics.snapshot())
    wait = [v for k, v in snaps[0].items() if "all_gather_matmul.ring" in k and k.endswith("/wait_ms_per_call")]
    named = [v for k, v in snaps[-1].items() if k.endswith("/straggler_rank") and k.startswith(f"commfuse/{_name(timed)}")]
    waits = torch.tensor([wait[0] if wait else -1.0, 0.0], device=dev)
    both = [torch.zeros_like(waits) for _ in range(2)]
    dist.all_gather(both, waits)
    w0, w1 = float(both[0][0]), float(both[1][0])
    # the two ranks time-slice one GPU, so rank 1's stream also waits for rank 0's kernels: what rank 0 waits
    # beyond rank 1 is the delay
    report("slow peer", w0 - w1 > delay_ms / 2 and named == [1],
           f"rank 1's extra compute {delay_ms:.2f} ms per call; device wait per call: rank 0 {w0:.2f} ms, rank 1 "
           f"{w1:.2f} ms (difference {w0 - w1:.2f}); straggler named {named}")

    # 3. host cost
    small = torch.randn(64, 256, device=dev)
    ws = torch.randn(256, 256, device=dev)
    for g in (timed, plain):
        for _ in range(20):
            call(g, small, ws)
    torch.cuda.synchronize()
    dist.barrier()
    per = {"timed": [], "plain": []}
    for r in range(args.rounds):
        for name, g in (("timed", timed), ("plain", plain)) if r % 2 else (("plain", plain), ("timed", timed)):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call(g, small, ws)
            per[name].append((time.perf_counter() - t0) / args.calls * 1e6)
            torch.cuda.synchronize()
    on, off = statistics.median(per["timed"]), statistics.median(per["plain"])
    report("host cost", None, f"us per call, median of {args.rounds} rounds of {args.calls}: device timing on "
           f"{on:.1f}, off {off:.1f}, on - off {on - off:+.1f} (ring, world size 2, 1 waited step)")

    # 4. stuck device
    metrics.dump_trace("before the stall")
    dist.barrier()
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(args.stall_s)
        call(timed)
        torch.cuda.synchronize()
    else:
        call(timed)
        paths = metrics.dump_trace("the device is stuck")
        dumped = [json.load(open(p)) for p in paths if _name(timed) in os.path.basename(p)]
        last = dumped[0]["calls"][-1] if dumped else {}
        w8 = last.get("waiting") or {}
        report("stuck device", last.get("status") == "in progress" and w8.get("device") and w8.get("waits_for") == [1],
               f"the dump's last call: #{last.get('seq')} {last.get('status')}, waiting {json.dumps(w8)}")
        analysis = subprocess.run([sys.executable, "-m", "commfuse", "trace", "analyze",
                                   os.environ["COMMFUSE_TRACE_DIR"]], capture_output=True, text=True, timeout=60)
        print(f"[rank {rank}] trace analyze (rc {analysis.returncode}):\n" + analysis.stdout[:3000]
              + analysis.stderr[-1000:], flush=True)
        torch.cuda.synchronize()
    dist.barrier()
    status = checks.summary()
    dist.destroy_process_group()
    return status


def _name(group) -> str:
    """The group's name in metrics keys and dump files (``commfuse.runtime.recorder.group_name``)."""
    return str(group.group_name)


if __name__ == "__main__":
    sys.exit(main())
