"""Ring attention (``commfuse.ring_attention``) checked on a device over NCCL, for one device run.

Tier: device check (prints a PASS/FAIL line per check with its figures; exits 1 where a check failed on this
rank). Ranks under torchrun, NCCL and CUDA tensors, TF32 off; several NCCL ranks may share one GPU when each
has its own ``NCCL_HOSTID`` (see ``gpu/README.md``: ``hostid.sh``)::

    torchrun --standalone --nproc-per-node 2 --no-python bash hostid.sh python3 benchmarks/ring_attention_device.py

Every check draws q, k, v and the output gradient whole from one seed on every rank, takes this rank's shards
in the layout (``commfuse.context.shard_sequence``), runs forward and backward, and compares the output and
dq, dk, dv shards with float64 attention of the whole sequence (torch's SDPA with the causal or document mask,
grouped-query heads expanded for the reference only): within 1e-4 of the largest magnitude for float32, 2e-2
for bfloat16. The checks: ``ring``, ``bidirectional`` and ``vanilla`` on zigzag shards, causal, grouped-query
(8 query heads, 2 K/V heads), float32 and bfloat16; ``ring`` on contiguous shards with documents;
``RingAttention`` forward + backward under bfloat16 autocast (output finite, every parameter given a
gradient). Last, informational: the median milliseconds of the ring's forward + backward against vanilla's,
with the device drained around each (two ranks on one GPU time-slice it: not overlap figures).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from _checks import Checks


def main() -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import commfuse as cf
    from commfuse.context import shard_sequence

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU and gloo: a dry run of the script itself
    if dev == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    checks = Checks(rank)
    report = checks.report

    b, s, hq, hkv, d = 2, (512 if dev == "cuda" else 64) * n, 8, 2, 64

    def reference(q, k, v, causal, lengths):
        q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
        mask = None
        if lengths is not None:
            doc = torch.repeat_interleave(torch.arange(len(lengths), device=dev), torch.tensor(lengths, device=dev))
            mask = doc[:, None] == doc[None, :]
            if causal:
                mask &= torch.ones(s, s, dtype=torch.bool, device=dev).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None).transpose(1, 2)

    def check(name, algorithm, layout, dtype, lengths=None, causal=True):
        try:
            g = torch.Generator(device=dev).manual_seed(11)
            full = [torch.randn(b, s, h, d, device=dev, generator=g) for h in (hq, hkv, hkv, hq)]
            qf, kf, vf, dof = full
            qd, kd, vd = (t.double().requires_grad_() for t in (qf, kf, vf))
            want = reference(qd, kd, vd, causal, lengths)
            want.backward(dof.double())
            mine = [shard_sequence(t, rank, n, layout).to(dtype).requires_grad_() for t in (qf, kf, vf)]
            out = cf.ring_attention(*mine, causal=causal, layout=layout, algorithm=algorithm,
                                    document_lengths=lengths)
            out.backward(shard_sequence(dof, rank, n, layout).to(dtype))
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            errors = {}
            for what, got, ref in (("out", out, want), ("dq", mine[0].grad, qd.grad), ("dk", mine[1].grad, kd.grad),
                                   ("dv", mine[2].grad, vd.grad)):
                ref = shard_sequence(ref.detach(), rank, n, layout)
                errors[what] = float((got.double() - ref).abs().max() / ref.abs().max())
            report(name, all(e <= tol for e in errors.values()),
                   "max error / largest magnitude: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
                   + f" (tolerance {tol:g})")
        except Exception as e:  # noqa: BLE001 - the next check runs
            report(name, False, f"{type(e).__name__}: {str(e)[:600]}")

    for algorithm in ("ring", "bidirectional", "vanilla"):
        for dtype in (torch.float32, torch.bfloat16):
            check(f"{algorithm} zigzag {str(dtype)[6:]}", algorithm, "zigzag", dtype)
    check("ring contiguous documents float32", "ring", "contiguous", torch.float32,
          lengths=[s // 4, s // 2 - 3, s // 4 + 3])
    check("ring zigzag full float32", "ring", "zigzag", torch.float32, causal=False)

    try:
        layer = cf.nn.RingAttention(512, 8, num_kv_heads=2, layout="zigzag", algorithm="ring").to(dev)
        x = torch.randn(2, 512 if dev == "cuda" else 32, 512, device=dev, requires_grad=True)
        with torch.autocast(dev, dtype=torch.bfloat16):
            y = layer(x)
        y.float().pow(2).mean().backward()
        grads = [p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in layer.parameters()]
        report("RingAttention bf16 autocast", y.dtype == torch.bfloat16 and bool(torch.isfinite(y).all())
               and all(grads), f"output {y.dtype}, {sum(grads)}/{len(grads)} parameters with finite gradients")
    except Exception as e:  # noqa: BLE001
        report("RingAttention bf16 autocast", False, f"{type(e).__name__}: {str(e)[:600]}")

    times = {}
    length = 2048 if dev == "cuda" else 128
    q, k, v = (torch.randn(1, length, h, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for h in (16, 4, 4))
    for algorithm in ("ring", "vanilla"):
        per = []
        for i in range(12):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            out = cf.ring_attention(q, k, v, layout="zigzag", algorithm=algorithm)
            out.sum().backward()
            sync()
            if i >= 2:
                per.append((time.perf_counter() - t0) * 1e3)
        times[algorithm] = statistics.median(per)
    report("timing", None, f"forward + backward, {length} tokens per rank, 16/4 heads of 128, bf16, median ms: "
           + ", ".join(f"{a} {t:.2f}" for a, t in times.items()))
    status = checks.summary()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
