"""Machine instructions per call of commfuse's ops, counted by valgrind: a host cost that load cannot blur.

Tier: benchmark (prints figures, asserts nothing). ``host_overhead.py`` times
calls; on a shared machine a change of a few hundred instructions is lost in
the noise of the clock. This counts them instead: each op runs in a child
process under ``valgrind --tool=callgrind`` on torch's ``fake`` process group
(rank 0 of N, as ``host_overhead.py``; N = 1: no process group, a single
process), warmed up with instrumentation off, then ``--calls`` calls made
through ``itertools.starmap`` with collection on only inside it
(``--toggle-collect=starmap_next``), so the figure is the calls and nothing
around them. The count is the same from run to run for the same code;
between two trees of the package, allocation and layout move it by a few
hundred instructions, so compare figures of that size against a measured
statement (``--statement``).

    python benchmarks/call_instructions.py [--ops ag_consume a2a_consume produce_rs ring_attention ag_ring rs_ring]
        [--world-size 2] [--calls 300] [--dtype float32] [--statement 'type(x) is not Tensor']

``walk_program`` and ``walk_one_by_one``: ``host_overhead.py --walks``' two rows, one ring all-gather signature
walked with a program (``runtime.walks.execute``) and without (``execute_one_by_one``).

``--dtype`` (float32, bfloat16 or float16) is the ops' tensors' dtype: a
reduce-scatter of half partials sums them in float32 (``programs.sum_dtype``),
which costs a cast per partial and one on the result.

Run it with ``PYTHONPATH`` pointing at another checkout to count that
checkout's package. Needs valgrind (``callgrind_control`` beside it).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

OPS = ("ag_consume", "a2a_consume", "produce_rs", "ring_attention", "ring_attention_docs", "ag_ring", "rs_ring",
       "walk_program", "walk_one_by_one")


def _calls(op: str, n: int, dtype: str = "float32"):
    """``op``'s call on tiny tensors of ``dtype``, as ``host_overhead.py --consume`` makes it."""
    import torch

    import commfuse as cf

    m, k, f = 4, 8, 8
    dt = getattr(torch, dtype)
    a, w = torch.randn(m, k, dtype=dt), torch.randn(k, f, dtype=dt)
    x = torch.randn(n * m, k, dtype=dt)
    chunks = list(x.view(n, m, k).unbind(0))
    q, kv = torch.randn(1, 4, 2, 8, dtype=dt), torch.randn(1, 4, 2, 8, dtype=dt)

    def gemm(t, source):
        return torch.matmul(t, w)

    def partial(dest, x, w):
        return torch.matmul(x[dest * m:(dest + 1) * m], w)

    if op.startswith("walk_"):  # host_overhead.py --walks' rows (its folder is the script's, on sys.path)
        from host_overhead import walk_pair

        rows = walk_pair(a, w, torch.empty(n * m, f, dtype=dt), m, n)
        return rows["walk with a program" if op == "walk_program" else "walk without a program"]
    return {
        "ag_consume": lambda: cf.all_gather_consume(a, gemm, algorithm="ring", check=False),
        "a2a_consume": lambda: cf.all_to_all_consume(chunks, gemm, algorithm="ring", check=False),
        "produce_rs": lambda: cf.produce_reduce_scatter(partial, inputs=(x, w), algorithm="ring", check=False),
        "ring_attention": lambda: cf.ring_attention(q, kv, kv, algorithm="ring"),
        "ring_attention_docs": lambda: cf.ring_attention(q, kv, kv, algorithm="ring", document_lengths=[2 * n, 2 * n]),
        "ag_ring": lambda: cf.all_gather_matmul(a, w, algorithm="ring", check=False),
        "rs_ring": lambda: cf.matmul_reduce_scatter(x, w, algorithm="ring", check=False),
    }[op]


def _child(op: str, n: int, calls: int, dtype: str = "float32") -> None:
    """Under valgrind: warm up, say READY, wait for a line on stdin (instrumentation is on by then), call."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["COMMFUSE_CHECK"] = "0"  # ring_attention takes no check argument; the fake group carries no fingerprint
    if n > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    if op.startswith("statement:"):
        x = torch.randn(4, 8)  # noqa: F841 - the statement's operand
        fn = eval("lambda: " + op.partition(":")[2], {"torch": torch, "x": x, "Tensor": torch.Tensor})
    else:
        fn = _calls(op, n, dtype)
    with torch.no_grad():
        for _ in range(50):
            fn()
        print("READY", flush=True)
        sys.stdin.readline()
        for _ in itertools.starmap(fn, itertools.repeat((), calls)):  # collected only inside starmap_next
            pass
    if n > 1:
        dist.destroy_process_group()


def count(op: str, n: int, calls: int, dtype: str = "float32") -> float:
    """Instructions per call of ``op`` on ``dtype`` tensors at world size ``n``, over ``calls`` calls."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               "--toggle-collect=starmap_next", f"--callgrind-out-file={out}", sys.executable, __file__,
               "--child", op, str(n), str(calls), dtype]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, env=dict(os.environ, PYTHONHASHSEED="0"))
        line = proc.stdout.readline()
        if line.strip() != "READY":
            proc.kill()
            raise SystemExit(f"{op}: the child said {line!r} instead of READY")
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        if proc.wait(timeout=3600):
            raise SystemExit(f"{op}: the child ended with {proc.returncode}")
        with open(out) as f:
            total = int(re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M).group(1))
    return total / calls


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:6])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--statement", action="append", default=[],
                   help="also count a Python expression over x (a tensor), torch and Tensor (torch.Tensor bound as "
                        "a global), e.g. 'type(x) is not Tensor'")
    args = p.parse_args(argv)
    import commfuse

    print(f"instructions per call, world size {args.world_size}, {args.calls} calls, {args.dtype}, commfuse from "
          f"{os.path.dirname(commfuse.__file__)}")
    for op in args.ops:
        print(f"  {op:18s} {count(op, args.world_size, args.calls, args.dtype):12,.0f}", flush=True)
    for statement in args.statement:
        empty = count("statement:None", 1, 10000)
        print(f"  {statement!r}: {count('statement:' + statement, 1, 10000) - empty:,.0f} "
              f"(less the empty call's {empty:,.0f})", flush=True)


if __name__ == "__main__":
    main()
