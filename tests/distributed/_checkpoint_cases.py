"""Rank-side bodies of the activation-checkpointing tests: every style, layer and op of commfuse run with each
way torch checkpoints a module (reentrant and non-reentrant ``torch.utils.checkpoint``, ``checkpoint_wrapper``,
torch's composable ``checkpoint``, torchtitan's selective per-op policy), against the same module run without
checkpointing on the same ranks: losses and every gradient equal, bit for bit."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import commfuse as cf
from commfuse import library, tp
from commfuse.context import shard_sequence
from commfuse.models import llama
from commfuse.nn import (
    MoE,
    ParallelAttention,
    ParallelMLP,
    RingAttention,
    ShardedLinear,
    UlyssesAttention,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the ways a module is checkpointed, as users write them
MODES = ("reentrant", "non-reentrant", "wrapper", "composable", "selective", "save-all")
#: the modes for models with torch's RMSNorm, whose kernel changes an output the "save-all" policy keeps
#: (torch's own limit: "Tensor cached during selective activation checkpoint has been mutated")
NORM_MODES = MODES[:-1]


def _run(results, name, fn):
    try:
        fn()
        results[name] = None
    except Exception as e:  # noqa: BLE001 - reported to the test, which names the rank
        results[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=12)}"


# -- torchtitan's selective per-op policy, reproduced with torch's own API ----------------------------------------
# torchtitan saves the outputs of its matmuls (every second one recomputed), attention kernels, reduce-scatters and
# max; everything else is recomputed. commfuse's ops that carry communication are added from the public list.

_TITAN_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


def _titan_policy(counts):
    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[mode] += 1
        if func in library.CHECKPOINT_SAVE:
            return CheckpointPolicy.MUST_SAVE
        save = func in _TITAN_SAVE and not (func == torch.ops.aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _titan_context():
    return create_selective_checkpoint_contexts(_titan_policy(defaultdict(int)))


def checkpointed(module: nn.Module, mode: str):
    """``module`` run under activation checkpointing ``mode`` (one of :data:`MODES`, or "none"): a callable
    with the module's signature."""
    if mode == "none":
        return module
    if mode == "reentrant":
        return lambda *args: checkpoint(module, *args, use_reentrant=True)
    if mode == "non-reentrant":
        return lambda *args: checkpoint(module, *args, use_reentrant=False)
    if mode == "wrapper":
        return checkpoint_wrapper(module)
    if mode == "composable":
        from torch.distributed._composable import checkpoint as composable

        return composable(module)
    if mode == "selective":  # torchtitan's op-level selective AC
        return checkpoint_wrapper(module, context_fn=_titan_context, preserve_rng_state=False)
    if mode == "save-all":  # a policy that saves every op it sees: the recompute runs none of them again
        return checkpoint_wrapper(module, context_fn=lambda: create_selective_checkpoint_contexts(
            lambda ctx, func, *args, **kwargs: CheckpointPolicy.MUST_SAVE))
    raise ValueError(mode)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _steps(model, run, inputs, steps: int):
    """``steps`` forward + backward passes of ``run`` (the model, checkpointed or not): per step the loss, the
    inputs' gradients and every parameter's gradient (this rank's shard of a DTensor's)."""
    got = []
    for step in range(steps):
        for p in model.parameters():
            p.grad = None
        args = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in inputs(step)]
        out = run(*args)
        loss = _local(out).float().square().mean()
        loss.backward()
        got.append((loss.detach(), [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad],
                    [None if p.grad is None else _local(p.grad).clone() for p in model.parameters()]))
    return got


def _bf16_close(a, b) -> bool:
    """Within 3e-2 of the largest value, the bfloat16 tolerance of the mixed-precision tests: bfloat16 partials
    summed in another order."""
    return (a.float() - b.float()).abs().max().item() <= 3e-2 * b.float().abs().max().item()


def _f32_close(a, b) -> bool:
    """Within float32 rounding (the compile tests' tolerance): inductor fuses the elementwise work."""
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def _same(got, want, what: str, equal=torch.equal) -> None:
    """Every step's loss, input gradients and parameter gradients of ``got`` and ``want`` (from :func:`_steps`)
    alike by ``equal`` (bit for bit by default), or an ``AssertionError`` listing each that is not."""
    problems = []
    for step, ((loss, dxs, dps), (loss_w, dxs_w, dps_w)) in enumerate(zip(got, want)):
        pairs = [(loss, loss_w, "loss")] + [(a, b, f"input {i} grad") for i, (a, b) in enumerate(zip(dxs, dxs_w))]
        pairs += [(a, b, f"parameter {i} grad") for i, (a, b) in enumerate(zip(dps, dps_w))]
        for a, b, name in pairs:
            if (a is None) != (b is None):
                problems.append(f"{what}, step {step}: {name} is {a} with checkpointing, {b} without")
            elif a is None:
                continue
            elif a.shape != b.shape or a.dtype != b.dtype:
                problems.append(f"{what}, step {step}: {name} is {a.dtype}{list(a.shape)}, want "
                                f"{b.dtype}{list(b.shape)}")
            elif not equal(a, b):
                problems.append(f"{what}, step {step}: {name} differs by {(a - b).abs().max().item():.3g}")
    if problems:
        raise AssertionError("\n".join(problems))


def against_plain(name: str, make, inputs, modes=MODES, steps: int = 2, context=contextlib.nullcontext,
                  bf16: tuple = ()):
    """``make()`` (a fresh module, the same weights each time) run under every mode of ``modes`` and without
    checkpointing: the same losses and gradients, bit for bit, but for the modes in ``bf16``, compared within
    bfloat16's rounding. Each mode starts from commfuse's state forgotten (``commfuse.backends.release``), so
    its first forward plans and checks every call inside the region."""
    failures = []
    runs = {}
    for mode in ("none", *modes):
        cf.backends.release()
        model = make()
        with context():
            runs[mode] = _steps(model, checkpointed(model, mode), inputs, steps)
    for mode in modes:
        try:
            _same(runs[mode], runs["none"], f"{name} under {mode} checkpointing",
                  _bf16_close if mode in bf16 else torch.equal)
        except AssertionError as e:
            failures.append(str(e))
    if failures:
        raise AssertionError("\n".join(failures))


def _seeded(make, seed):
    def fresh():
        torch.manual_seed(seed)
        return make()

    return fresh


def _rows(n, rank, shape, seed, dim=1):
    """This rank's rows (``dim``) of a tensor of ``shape`` drawn alike on every rank, per step."""
    def inputs(step):
        g = torch.Generator().manual_seed(seed + step)
        return (torch.randn(shape, generator=g).tensor_split(n, dim=dim)[rank].contiguous(),)

    return inputs


# -- the workloads -----------------------------------------------------------------------------------------------


class _MLP(nn.Module):
    """RMSNorm, up projection, SiLU, down projection, residual."""

    def __init__(self, hidden=16, ffn=32):
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.w1 = nn.Linear(hidden, ffn)
        self.w2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.w2(nn.functional.silu(self.w1(self.norm(x))))


def tp_styles(rank, n):
    """commfuse.tp's styles: ColwiseParallel / RowwiseParallel (an MLP under sequence parallelism), and the
    Llama block's AttentionParallel (RoPE, grouped-query) and SwiGLUParallel."""
    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))

    def mlp():
        def make():
            model = _MLP(16, 8 * n)
            return parallelize_module(model, mesh["tp"], {
                "norm": SequenceParallel(),
                "w1": tp.ColwiseParallel(input_layouts=Shard(1), algorithm="ring"),
                "w2": tp.RowwiseParallel(output_layouts=Shard(1), algorithm="ring")})

        against_plain("colwise-rowwise", _seeded(make, 1), _rows(n, rank, (2, 4 * n, 16), 100), NORM_MODES)

    def block():
        def make():
            model = llama.Block(dim=8 * n, n_heads=2 * n, n_kv_heads=n, ffn=8 * n)
            return parallelize_module(model, mesh["tp"], llama.commfuse_plan(head_dim=4, algorithm="ring"))

        rows = _rows(n, rank, (2, 4 * n, 8 * n), 200)
        against_plain("llama block", _seeded(make, 2), lambda step: (*rows(step), llama.rope_cache(4, 4 * n)),
                      NORM_MODES)

    def block_auto_bf16():
        # algorithm="auto" and bfloat16 autocast: the slices made again in the backward run in autocast's dtype.
        # Under the selective policy the fused ops run as their custom ops, which cast their inputs up front
        # (commfuse.library's autocast rules), as compiled: equal within bfloat16's rounding there
        def make():
            model = llama.Block(dim=8 * n, n_heads=2 * n, n_kv_heads=n, ffn=8 * n)
            return parallelize_module(model, mesh["tp"], llama.commfuse_plan(head_dim=4, algorithm="auto"))

        rows = _rows(n, rank, (2, 4 * n, 8 * n), 300)
        against_plain("llama block, auto, bf16 autocast", _seeded(make, 3),
                      lambda step: (*rows(step), llama.rope_cache(4, 4 * n)), NORM_MODES,
                      context=lambda: torch.autocast("cpu", dtype=torch.bfloat16), bf16=("selective",))

    _run(results, "colwise-rowwise", mlp)
    _run(results, "attention-swiglu-block", block)
    _run(results, "block-auto-bf16", block_auto_bf16)
    return results


def ring_attention_style(rank, n):
    """commfuse.tp.RingAttentionParallel on the Llama block's attention (context parallelism, zigzag)."""
    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
    s = 4 * n
    cache = llama.rope_cache(4, s)

    def rope(q, k, cache, *, positions):
        cos, sin = cache
        return llama.apply_rope(q, k, (cos[positions], sin[positions]))

    def make():
        block = llama.Attention(16, 4, 2)
        parallelize_module(block, mesh["cp"], tp.RingAttentionParallel(head_dim=4, layout="zigzag", rope=rope,
                                                                       algorithm="ring"))
        return block

    def inputs(step):
        g = torch.Generator().manual_seed(400 + step)
        return (shard_sequence(torch.randn(2, s, 16, generator=g), rank, n, "zigzag"), cache)

    _run(results, "ring-attention-parallel", lambda: against_plain("RingAttentionParallel", _seeded(make, 4), inputs))
    return results


def nn_layers(rank, n):
    """commfuse.nn's layers: ParallelMLP (column- and row-parallel linear), ParallelAttention (query-split),
    UlyssesAttention, RingAttention, MoE, ShardedLinear."""
    results = {}
    h = 8 * n

    def case(name, make, inputs, seed):
        _run(results, name, lambda: against_plain(name, _seeded(make, seed), inputs))

    case("parallel-mlp", lambda: ParallelMLP(h, 2 * h, algorithm="ring"), _rows(n, rank, (2, 4 * n, h), 500), 5)
    case("parallel-attention", lambda: ParallelAttention(h, 2 * n, num_kv_heads=n, algorithm="ring"),
         _rows(n, rank, (2, 4 * n, h), 600), 6)
    case("ulysses-attention", lambda: UlyssesAttention(h, 2 * n, algorithm="ring"),
         _rows(n, rank, (2, 4 * n, h), 700), 7)

    def ring_inputs(step):
        g = torch.Generator().manual_seed(800 + step)
        return (shard_sequence(torch.randn(2, 4 * n, 16, generator=g), rank, n, "zigzag"),)

    case("ring-attention", lambda: RingAttention(16, 4, num_kv_heads=2, layout="zigzag", algorithm="ring"),
         ring_inputs, 8)

    def moe_inputs(step):
        g = torch.Generator().manual_seed(900 + step + 31 * rank)  # every rank its own tokens
        return (torch.randn(2, 6, 16, generator=g),)

    case("moe", lambda: MoE(16, 24, experts=2 * n, topk=2, algorithm="ring"), moe_inputs, 9)
    case("sharded-linear", lambda: nn.Sequential(ShardedLinear(16, 4 * n, algorithm="ring"), nn.GELU(),
                                                 ShardedLinear(4 * n, 8 * n, algorithm="ring")),
         _rows(n, rank, (2 * n, 5, 16), 1000, dim=0), 10)
    return results


def functional(rank, n):
    """The functional ops under checkpointing: all_gather_matmul + matmul_reduce_scatter, and
    produce_reduce_scatter with a producer that draws random numbers (dropout): the backward makes each partial
    again with the random numbers the forward drew."""
    results = {}

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(8, 12) / 4)
            self.w2 = nn.Parameter(torch.randn(12, 8) / 4)

        def forward(self, x):
            y = cf.all_gather_matmul(x, self.w1, gather_dim=1, algorithm="ring")
            return cf.matmul_reduce_scatter(torch.relu(y), self.w2, scatter_dim=1, algorithm="ring")

    class Produced(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8) / 4)

        def forward(self, x):
            rows = x.shape[1]

            def producer(d, x, w):
                part = nn.functional.dropout(x @ w, p=0.3, training=True)
                return part[:, :rows // n] * (d + 1)

            return cf.produce_reduce_scatter(producer, inputs=(x, self.w), dim=1, algorithm="ring")

    _run(results, "all-gather-matmul-reduce-scatter",
         lambda: against_plain("functional ops", _seeded(Functional, 11), _rows(n, rank, (2, 4 * n, 8), 1100)))

    def produced():
        # the same random numbers on every run: each mode's model starts from the same seed, and its inputs too
        def inputs(step):
            torch.manual_seed(1200 + step)
            return (torch.randn(2, 4 * n, 8),)

        against_plain("produce_reduce_scatter with dropout", _seeded(Produced, 12), inputs,
                      modes=("reentrant", "non-reentrant", "wrapper", "composable"))

    _run(results, "produce-reduce-scatter-dropout", produced)
    return results


def two_strands(rank, n):
    """commfuse.strands.run with every stage checkpointed (non-reentrant, and the selective policy): the next
    micro-batch's forward interleaved with the previous one's backward, in which each stage's recompute runs;
    against the same stages unchecked, one micro-batch after the other."""
    import _strands_cases as sc

    from commfuse import strands

    results = {}

    def case(mode, plan):
        problems: list[str] = []
        ours = {k: v.clone().requires_grad_() for k, v in sc._params(rank, n).items()}
        theirs = {k: v.clone().requires_grad_() for k, v in sc._params(rank, n).items()}

        def wrapped(stage):
            if mode == "non-reentrant":
                def fn(*args, _fn=stage.fn):
                    return checkpoint(_fn, *args, use_reentrant=False)
            else:
                def fn(*args, _fn=stage.fn):
                    return checkpoint(_fn, *args, use_reentrant=False, context_fn=_titan_context,
                                      preserve_rng_state=False)
            return strands.Stage(stage.name, fn, stage.compute, stage.comm)

        stages_ours = [wrapped(s) for s in sc._stages(ours, "ring", plan == "searched")]
        stages_theirs = sc._stages(theirs, "ring", False)
        sc.against_sequential(ours, theirs, stages_ours, stages_theirs, lambda step: sc._batches(rank, n, 3, step),
                              sc._loss, plan, problems)
        if problems:
            raise AssertionError("\n".join(problems))

    for mode in ("non-reentrant", "selective"):
        for plan in ("alternate", "searched"):
            _run(results, f"strands-{mode}-{plan}", lambda: case(mode, plan))
    return results


# -- ranks that checkpoint differently ----------------------------------------------------------------------------


def disagree(rank, n, case):
    """Rank 0 checkpoints otherwise than the others; every rank must raise a commfuse error naming it, before
    any call of the backward pairs wrongly. ``case``:

    - ``one-rank-checkpoints``: rank 0 checkpoints two blocks, the others run them plainly;
    - ``other-regions``: rank 0 checkpoints the two blocks as one region, the others each block as its own: the
      first recomputed calls have equal signatures on every rank, so only the region tells them apart;
    - ``other-policy``: rank 0 saves commfuse's reduce-scatters under a selective policy, the others recompute
      them.

    Returns, per rank, the error's class, its message and the seconds until it came (None: no error)."""
    os.environ["COMMFUSE_TIMEOUT_S"] = "30"  # read when the calls are first resolved, below
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    torch.manual_seed(2)
    blocks = [parallelize_module(llama.Block(dim=8 * n, n_heads=2 * n, n_kv_heads=n, ffn=8 * n), mesh["tp"],
                                 llama.commfuse_plan(head_dim=4, algorithm="ring")) for _ in range(2)]
    cache = llama.rope_cache(4, 4 * n)
    x = _rows(n, rank, (2, 4 * n, 8 * n), 200)(0)[0].requires_grad_()

    def both(h):
        return blocks[1](blocks[0](h, cache), cache)

    def recompute_reduce_scatters(ctx, func, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    def save_reduce_scatters(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in library.CHECKPOINT_SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    start = time.monotonic()
    try:
        if case == "one-rank-checkpoints":
            y = checkpoint(both, x, use_reentrant=False) if rank == 0 else both(x)
        elif case == "other-regions":
            if rank == 0:
                y = checkpoint(both, x, use_reentrant=False)
            else:
                h = checkpoint(blocks[0], x, cache, use_reentrant=False)
                y = checkpoint(blocks[1], h, cache, use_reentrant=False)
        else:
            policy = save_reduce_scatters if rank == 0 else recompute_reduce_scatters
            y = checkpoint(both, x, use_reentrant=False,
                           context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        y.square().mean().backward()
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return {"error": type(e).__name__, "commfuse": isinstance(e, cf.errors.CommfuseError), "message": str(e),
                "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


# -- what the recompute runs again: the policy for commfuse's ops --------------------------------------------------


def _block(n, mesh):
    torch.manual_seed(2)
    model = llama.Block(dim=8 * n, n_heads=2 * n, n_kv_heads=n, ffn=8 * n)
    return parallelize_module(model, mesh["tp"], llama.commfuse_plan(head_dim=4, algorithm="ring"))


def recomputed_calls(rank, n):
    """One training step of the Llama block (AttentionParallel, SwiGLUParallel) under full checkpointing and
    under torchtitan's selective policy with ``commfuse.library.CHECKPOINT_SAVE``: the calls each recompute
    makes on the group, read from its flight recorder (the lane of a recomputed call names its region)."""
    from commfuse.runtime.groups import state_of_group
    from commfuse.runtime.recorder import recorder_for

    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    rows = _rows(n, rank, (2, 4 * n, 8 * n), 200)
    out = {}
    for mode in ("wrapper", "selective"):
        cf.backends.release()
        model = _block(n, mesh)
        _steps(model, checkpointed(model, mode), lambda step: (*rows(step), llama.rope_cache(4, 4 * n)), 1)
        calls = recorder_for(state_of_group(mesh["tp"].get_group())).calls()
        out[mode] = [(call.head[2][0], call.head[0].label) for call in calls]
    return out


def compiled(rank, n, backend):
    """torch.compile of the checkpointed Llama block, as torchtitan applies AC then compile: full checkpointing
    and torchtitan's selective policy with ``commfuse.library.CHECKPOINT_SAVE``, against the block run eagerly
    without checkpointing. ``backend`` "record": AOTAutograd with the min-cut partitioner inductor uses,
    compiling nothing, recording the fused ops of the forward and backward graphs (results equal bit for bit to
    the block compiled the same way without checkpointing, and to eager within float32 rounding);
    "inductor": compiled (results within float32 rounding: inductor fuses the elementwise work)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="commfuse-inductor-")
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    rows = _rows(n, rank, (2, 4 * n, 8 * n), 200)

    def inputs(step):
        return (*rows(step), llama.rope_cache(4, 4 * n))

    results = {}
    cf.backends.release()
    model = _block(n, mesh)
    want = _steps(model, model, inputs, 2)
    unchecked = None
    if backend == "record":
        # the same block compiled the same way without checkpointing: AOTAutograd's decompositions round
        # differently from eager on some torch versions (2.9: ~1e-9), so checkpointing is judged against it,
        # bit for bit, and eager within float32 rounding
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        cf.backends.release()
        torch._dynamo.reset()
        model = _block(n, mesh)
        unchecked = _steps(model, torch.compile(model, backend=aot_autograd(
            fw_compiler=lambda gm, _: gm.forward, bw_compiler=lambda gm, _: gm.forward,
            partition_fn=min_cut_rematerialization_partition)), inputs, 2)
    for mode in (("wrapper", "selective") if backend == "record" else ("selective",)):
        graphs: dict = {"forward": [], "backward": []}

        def case():
            cf.backends.release()
            torch._dynamo.reset()
            model = _block(n, mesh)
            if backend == "record":
                from torch._dynamo.backends.common import aot_autograd
                from torch._functorch.partitioners import min_cut_rematerialization_partition

                def recording(kind):
                    def compiler(gm, example_inputs):
                        graphs[kind] += [str(node.target) for node in gm.graph.nodes
                                         if node.op == "call_function" and str(node.target).startswith("commfuse.")]
                        return gm.forward
                    return compiler

                run = torch.compile(checkpointed(model, mode), backend=aot_autograd(
                    fw_compiler=recording("forward"), bw_compiler=recording("backward"),
                    partition_fn=min_cut_rematerialization_partition))
            else:
                run = torch.compile(checkpointed(model, mode), backend=backend)
            got = _steps(model, run, inputs, 2)
            if unchecked is not None:
                _same(got, unchecked, f"compiled ({mode}, {backend}) against the block compiled without it",
                      torch.equal)
            _same(got, want, f"compiled ({mode}, {backend})", _f32_close)
            results[f"{mode}-graphs"] = graphs

        _run(results, f"{mode}-{backend}", case)
    return results


def with_fsdp(rank, n):
    """torchtitan's order on a dp 2 x tp 2 mesh: commfuse's styles, activation checkpointing of the block
    (full, and torchtitan's selective policy), then FSDP2's fully_shard over dp; two AdamW steps against the same
    model without checkpointing: losses, every gradient (gathered) and the parameters after."""
    from torch.distributed.fsdp import fully_shard

    results = {}
    mesh = init_device_mesh("cpu", (n // 2, 2), mesh_dim_names=("dp", "tp"))
    dp, tpm = mesh["dp"], mesh["tp"]
    cache = llama.rope_cache(8, 8)

    def shard(x):
        mine = x.tensor_split(dp.size())[dp.get_local_rank()]
        return mine.tensor_split(2, dim=1)[tpm.get_local_rank()].clone()

    def train(mode):
        cf.backends.release()
        torch.manual_seed(0)
        block = parallelize_module(llama.Block(), tpm, llama.commfuse_plan(algorithm="ring"))
        run = checkpointed(block, mode)
        fully_shard(run, mesh=dp)  # torchtitan shards the block as apply_ac left it: the checkpoint wrapper
        opt = torch.optim.AdamW(block.parameters(), lr=1e-2)
        got = []
        for step in range(2):
            g = torch.Generator().manual_seed(2000 + step)
            x, target = torch.randn(2 * dp.size(), 8, 32, generator=g), torch.randn(2 * dp.size(), 8, 32, generator=g)
            loss = (run(shard(x), cache) - shard(target)).square().mean()
            loss.backward()
            got.append((loss.detach(), [p.grad.full_tensor() for p in block.parameters()]))
            opt.step()
            opt.zero_grad()
        return got, [p.full_tensor() for p in block.parameters()]

    want = train("none")
    for mode in ("wrapper", "selective"):
        def case(mode=mode):
            got = train(mode)
            problems = []
            for step, ((loss, grads), (loss_w, grads_w)) in enumerate(zip(got[0], want[0])):
                if not torch.equal(loss, loss_w):
                    problems.append(f"step {step} loss {loss.item()} != {loss_w.item()}")
                problems += [f"step {step} parameter {i} grad differs by {(a - b).abs().max().item():.3g}"
                             for i, (a, b) in enumerate(zip(grads, grads_w)) if not torch.equal(a, b)]
            problems += [f"parameter {i} after two steps differs by {(a - b).abs().max().item():.3g}"
                         for i, (a, b) in enumerate(zip(got[1], want[1])) if not torch.equal(a, b)]
            if problems:
                raise AssertionError(f"{mode} checkpointing under fully_shard:\n" + "\n".join(problems))

        _run(results, f"fsdp-{mode}", case)
    return results
