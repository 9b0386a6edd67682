"""Activation checkpointing of a Llama block under commfuse's styles: what it keeps, what it costs.

Tier: benchmark (prints figures, asserts nothing). Two gloo ranks (one thread each) run the Llama block of
``commfuse.models.llama`` parallelized with ``commfuse_plan`` (AttentionParallel, SwiGLUParallel, ring), a
training step at a time, under three ways of checkpointing, interleaved repeat by repeat:

- ``none``: no checkpointing;
- ``full``: ``checkpoint_wrapper`` (torchtitan's full AC);
- ``selective``: ``checkpoint_wrapper`` with torchtitan's per-op policy (its matmuls but every second one, its
  attention kernels) and ``commfuse.library.CHECKPOINT_SAVE``.

Per way, rank 0's medians: the memory the forward leaves resident for the backward (``/proc/self/status``
``VmRSS`` after the forward less before it, the C library's free heap handed back before each reading: what
checkpointing is for), the step's peak above where it started (``commfuse.bench.memory.peak_memory``), and the step's time;
and whether its gradients equal those of ``none`` bit for bit.

    python benchmarks/checkpoint.py [--dim 256] [--seq 1024] [--batch 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _rank(rank: int, n: int, dim: int, seq: int, batch: int, repeats: int) -> dict:
    import functools

    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    import commfuse.library
    from commfuse.bench import memory
    from commfuse.models import llama

    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    heads = 8
    head_dim = dim // heads
    saved = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
             *commfuse.library.CHECKPOINT_SAVE}

    def policy(counts):
        def decide(ctx, func, *args, **kwargs):
            if func == torch.ops.aten.mm.default:
                counts[ctx.is_recompute] += 1
                if counts[ctx.is_recompute] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE
        return decide

    def context():
        return create_selective_checkpoint_contexts(policy({True: 0, False: 0}))

    blocks = {}
    for way in ("none", "full", "selective"):
        torch.manual_seed(0)
        block = parallelize_module(llama.Block(dim=dim, n_heads=heads, n_kv_heads=heads // 2, ffn=4 * dim),
                                   mesh["tp"], llama.commfuse_plan(head_dim=head_dim, algorithm="ring"))
        run = block if way == "none" else checkpoint_wrapper(
            block, **({"context_fn": context} if way == "selective" else {}))
        blocks[way] = (block, run)
    cache = llama.rope_cache(head_dim, seq)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, dim, generator=g).tensor_split(n, dim=1)[rank].contiguous()
    figures: dict = {way: {"kept": [], "peak": [], "ms": []} for way in blocks}
    grads: dict = {}
    for repeat in range(repeats + 1):  # the first round plans and checks every call: not counted
        for way, (block, run) in blocks.items():
            block.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            torch.distributed.barrier()
            with memory.peak_memory() as peak:
                memory._release_free_heap()
                before = memory._kib("VmRSS")
                start = time.perf_counter()
                y = run(xi, cache)
                memory._release_free_heap()  # what the forward freed is not kept
                after = memory._kib("VmRSS")
                y.square().mean().backward()
                took = time.perf_counter() - start
            if repeat:
                figures[way]["kept"].append(None if before is None or after is None else after - before)
                figures[way]["peak"].append(peak.bytes)
                figures[way]["ms"].append(took * 1e3)
            grads[way] = [xi.grad] + [p.grad.to_local() for p in block.parameters()]
            del y
    equal = {way: all(torch.equal(a, b) for a, b in zip(grads[way], grads["none"])) for way in grads}
    return {way: {k: statistics.median(v) if v and None not in v else None for k, v in f.items()} | {
        "equal": equal[way]} for way, f in figures.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from commfuse.bench.memory import text
    from commfuse.launch import launch

    got = launch(_rank, 2, args.dim, args.seq, args.batch, args.repeats, timeout=1800)[0]
    print(f"Llama block, dim {args.dim}, sequence {args.seq}, batch {args.batch}, 2 gloo ranks (rank 0), "
          f"median of {args.repeats} interleaved steps")
    print(f"  {'checkpointing':<12} {'kept for backward':>18} {'step peak':>12} {'step ms':>9}  gradients")
    for way, f in got.items():
        print(f"  {way:<12} {text(f['kept']):>18} {text(f['peak']):>12} {f['ms']:>9.1f}  "
              f"{'equal to none' if f['equal'] else 'DIFFER from none'}")


if __name__ == "__main__":
    main()
