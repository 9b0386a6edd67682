"""Host cost per call of commfuse's torchtitan modules, against torchtitan's stock block and the bare ops.

Tier: benchmark (prints figures, asserts nothing). torch's ``fake`` process group makes this one process
rank 0 of N (every transfer completes at once, no data moves), and the sizes are tiny, so what is timed is
the Python and dispatch each forward costs on the host: on a GPU, where a shard's GEMM takes ~0.1 ms, that
decides whether the host keeps the device fed. Rows (median over rounds of the mean per call, forward
under ``no_grad`` and forward + backward):

- ``stock block``: torchtitan 0.3's Llama 3 block, its stock TP plan (``spmd_types``, SP on);
- ``commfuse block``: the same block through ``use_commfuse`` (ring; attention split by query);
- ``FusedQKVLinear`` against ``ops.all_gather_matmul`` on the same tensors, each call entering
  torchtitan's mesh context: what the module adds to its op (the context read, the bias, the split into
  heads, which the stock module does too).

Needs torchtitan (``bash ci/setup_torchtitan.sh``)::

    ~/.cache/commfuse/venv-torchtitan/bin/python benchmarks/torchtitan_host.py [--world-sizes 2 8]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from _timing import per_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # the ops' fingerprint exchange off, as in the bench's timed runs: the fake group's peers return no fingerprint
    os.environ["COMMFUSE_CHECK"] = "0"

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from commfuse.bench.workloads import torchtitan_blocks
    from commfuse.integrations.torchtitan_cpu import prepare

    prepare()
    import commfuse.ops as ops

    print("host cost per call, us (fake process group: rank 0 of N, transfers complete at once; tiny sizes)")
    print(f"{'N':>3}  {'stock block fwd':>15}  {'commfuse fwd':>12}  {'stock fwd+bwd':>13}  {'commfuse fwd+bwd':>16}"
          f"  {'FusedQKVLinear':>14}  {'all_gather_matmul':>17}")
    for n in args.world_sizes:
        dist.init_process_group("fake", rank=0, world_size=n, store=FakeStore())
        try:
            hidden, heads = 64, 8
            stock, fused, context = torchtitan_blocks(n, hidden=hidden, heads=heads, kv_heads=heads, ffn=2 * hidden,
                                                      algorithm="ring", device=torch.device("cpu"), seed=0)
            x = torch.randn(1, 2, hidden)  # this rank's sequence shard: 2 rows of 2N
            xg = x.clone().requires_grad_()
            qkv = fused.attention.qkv_linear
            group = dist.group.WORLD

            def forward(block):
                with torch.no_grad(), context():
                    block(x, None, None)

            def train(block):
                with context():
                    block(xg, None, None).sum().backward()

            def module():
                with torch.no_grad(), context():
                    qkv(x)

            def bare():  # in the same context as the module, whose entry costs both the same
                with torch.no_grad(), context():
                    ops.all_gather_matmul(x, qkv.wqkv.weight.t(), group=group, gather_dim=1, algorithm="ring")

            row = [per_call(lambda: forward(stock), args.calls, args.rounds),
                   per_call(lambda: forward(fused), args.calls, args.rounds),
                   per_call(lambda: train(stock), args.calls, args.rounds),
                   per_call(lambda: train(fused), args.calls, args.rounds),
                   per_call(module, args.calls, args.rounds), per_call(bare, args.calls, args.rounds)]
            print(f"{n:>3}  " + "  ".join(f"{1e6 * v:>{w}.0f}" for v, w in zip(row, (15, 12, 13, 16, 14, 17))))
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
