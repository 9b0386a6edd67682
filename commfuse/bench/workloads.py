"""The workloads one rank runs: each call of ``run(algorithm)`` is one iteration.

A workload builds its tensors (and, for the layer workloads, its module) once;
``run`` switches the algorithm and returns the tensors that the correctness
check compares with ``vanilla``'s: the output, and for forward + backward the
input's and the parameters' gradients too. Inputs differ per rank and are
drawn from a generator seeded by (seed, rank); layer parameters come from
``torch.manual_seed(seed)`` so every rank builds the same module.

``--compile`` (``commfuse.bench.compiled``): :meth:`Workload.compile` wraps
the same module (the bare ops: a function calling the op) in
``torch.compile(..., fullgraph=True)``, and ``run(algorithm, compiled=True)``
runs that instead, on the same inputs and parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from contextlib import nullcontext

import torch

from commfuse.bench.config import WORKLOADS, BenchConfig
from commfuse.errors import CommfuseValueError, first_line

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Largest error, relative to the reference's largest magnitude, that still
#: counts as correct. Reduce-scatter sums in ring order, so results are equal
#: to vanilla's up to rounding, not bit for bit.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


class Workload:
    """One iteration per ``run``; ``taken`` maps each algorithm to what ``auto`` resolved to."""

    name = ""

    def __init__(self, config: BenchConfig, rank: int, world_size: int, device: torch.device) -> None:
        self.config, self.rank, self.n, self.device = config, rank, world_size, device
        self.dtype = DTYPES[config.dtype]
        self.generator = torch.Generator().manual_seed(1_000_003 * config.seed + rank)

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=self.generator, dtype=torch.float32) * scale
        return t.to(device=self.device, dtype=self.dtype)

    def run(self, algorithm: str, compiled: bool = False) -> list[torch.Tensor]:
        raise NotImplementedError

    def compile(self, backend: str) -> None:
        """Make ``run(..., compiled=True)`` run through ``torch.compile(..., fullgraph=True, backend=backend)``
        (compiled lazily by the first such run)."""
        raise CommfuseValueError(f"workload {self.name} has no compiled form")


def _agmm(x: torch.Tensor, w: torch.Tensor, algorithm: str) -> torch.Tensor:
    import commfuse as cf

    return cf.all_gather_matmul(x, w, algorithm=algorithm)


def _mmrs(x: torch.Tensor, w: torch.Tensor, algorithm: str) -> torch.Tensor:
    import commfuse as cf

    return cf.matmul_reduce_scatter(x, w, algorithm=algorithm)


class AllGatherMatmul(Workload):
    """``all_gather(x) @ W``: tokens gathered along dim 0, as in a sequence-first (s, b, h) layout."""

    name = "ag_matmul"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        s = self.config.shape
        self.x = self.randn(s.batch * s.seq // self.n, s.hidden)
        self.w = self.randn(s.hidden, s.ffn // self.n, scale=1 / math.sqrt(s.hidden))

    def run(self, algorithm: str, compiled: bool = False) -> list[torch.Tensor]:
        return [(self.compiled if compiled else _agmm)(self.x, self.w, algorithm)]

    def compile(self, backend: str) -> None:
        self.compiled = torch.compile(_agmm, fullgraph=True, backend=backend)


class MatmulReduceScatter(Workload):
    """``reduce_scatter(x @ W)`` over the token dim: each rank ends with its (b*s/N, h) shard."""

    name = "matmul_rs"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        s = self.config.shape
        self.x = self.randn(s.batch * s.seq, s.ffn // self.n)
        self.w = self.randn(s.ffn // self.n, s.hidden, scale=1 / math.sqrt(s.ffn))

    def run(self, algorithm: str, compiled: bool = False) -> list[torch.Tensor]:
        return [(self.compiled if compiled else _mmrs)(self.x, self.w, algorithm)]

    def compile(self, backend: str) -> None:
        self.compiled = torch.compile(_mmrs, fullgraph=True, backend=backend)


class LayerWorkload(Workload):
    """A ``commfuse.nn`` layer, forward (+ backward) on (b, s/N, h) with sequence dim 1."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        info = WORKLOADS[self.name]
        try:
            import commfuse.nn as cnn

            cls = getattr(cnn, info.layer)
        except (ImportError, AttributeError) as e:
            raise CommfuseValueError(
                f"workload {self.name} runs commfuse.nn.{info.layer}, which this installation does not have ({e}); "
                "run the ag_matmul and matmul_rs workloads instead"
            ) from None
        s = self.config.shape
        torch.manual_seed(self.config.seed)  # the same parameters on every rank
        self.module = self.build(cls, s).to(device=self.device, dtype=self.dtype)
        self.backward = self.config.backward
        self.x = self.randn(s.batch, s.seq // self.n, s.hidden).requires_grad_(self.backward)
        with torch.no_grad():
            self.module.algorithm = "vanilla"
            shape = self.module(self.x).shape
        self.dy = self.randn(*shape)
        self.params = [p for p in self.module.parameters() if p.requires_grad]

    def build(self, cls, s):
        raise NotImplementedError

    def run(self, algorithm: str, compiled: bool = False) -> list[torch.Tensor]:
        self.module.algorithm = algorithm  # the compiled module is this one, wrapped: it guards on the algorithm
        module = self.compiled if compiled else self.module
        if not self.backward:
            with torch.no_grad():
                return [module(self.x)]
        self.x.grad = None
        for p in self.params:
            p.grad = None
        y = module(self.x)
        y.backward(self.dy)
        return [y.detach(), self.x.grad] + [_local(p.grad) for p in self.params]

    def compile(self, backend: str) -> None:
        self.compiled = torch.compile(self.module, fullgraph=True, backend=backend)


class MLP(LayerWorkload):
    name = "mlp"

    def build(self, cls, s):
        return cls(s.hidden, s.ffn, sequence_dim=1, algorithm="vanilla")


class Attention(LayerWorkload):
    name = "attention"

    def build(self, cls, s):
        return cls(s.hidden, s.heads, num_kv_heads=s.kv_heads, causal=True, sequence_dim=1, algorithm="vanilla")


class Ulysses(LayerWorkload):
    name = "ulysses"

    def build(self, cls, s):
        return cls(s.hidden, s.heads, num_kv_heads=s.kv_heads, causal=True, algorithm="vanilla")


class FSDPLinear(LayerWorkload):
    name = "fsdp_linear"

    def build(self, cls, s):
        return cls(s.hidden, s.ffn, algorithm="vanilla")


class _SideBySide(Workload):
    """A block built twice, run side by side: the ``vanilla`` run is ``theirs`` (a plan whose collectives are its
    own, which commfuse's measure modes cannot remove: its runs refuse them, and the runner times it in the
    normal mode only), every other algorithm ``ours``, with the algorithm set on ``tuned`` (what of ours takes
    one), whose compute-only and comm-only times give the regime. Forward + backward on (b, s/N, h), under
    :attr:`context`; ``stock`` says what ``theirs`` runs, for the refusal."""

    stock = ""
    context = staticmethod(nullcontext)
    #: the runner times compute_only and comm_only for ``ours`` only (their ops are commfuse's), never ``theirs``
    measures_vanilla = False

    def side_by_side(self, theirs, ours, tuned: list, *args) -> None:
        """The two blocks, what takes the algorithm, and the blocks' arguments after the input."""
        self.theirs, self.ours, self.tuned, self.args = theirs, ours, tuned, args
        s = self.config.shape
        self.backward = self.config.backward
        self.x = self.randn(s.batch, s.seq // self.n, s.hidden).requires_grad_(self.backward)
        self.dy = self.randn(s.batch, s.seq // self.n, s.hidden)

    def run(self, algorithm: str) -> list[torch.Tensor]:
        from commfuse.runtime.observe import measuring

        if algorithm == "vanilla":
            if measuring() is not None:
                raise CommfuseValueError(f"{self.stock}, which compute_only and comm_only cannot remove")
            block = self.theirs
        else:
            block = self.ours
            for each in self.tuned:
                each.algorithm = algorithm
        with self.context():
            if not self.backward:
                with torch.no_grad():
                    return [block(self.x, *self.args)]
            self.x.grad = None
            params = list(block.parameters())
            for p in params:
                p.grad = None
            y = block(self.x, *self.args)
            y.backward(self.dy)
        return [y.detach(), self.x.grad] + [_local(p.grad) for p in params]


class LlamaBlock(_SideBySide):
    """commfuse.models.llama's block on a tensor-parallel mesh over every rank, built twice from one seed:
    with torch's styles (the ``vanilla`` run: DTensor's collectives, then the GEMMs) and with commfuse.tp's
    block styles (every other algorithm, set on the styles). Forward + backward on (b, s/N, h).

    ``compute_only`` and ``comm_only`` cannot take torch's plan apart (its collectives are DTensor's, which
    commfuse's measure modes do not reach): its runs refuse them and it is timed in the normal mode only; the
    styles' runs are timed in all three."""

    name = "llama_block"
    stock = "torch's styles run DTensor's collectives"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from commfuse.models import llama

        s = self.config.shape
        if s.hidden % s.heads:
            raise CommfuseValueError(f"workload llama_block: hidden {s.hidden} is not divisible by heads {s.heads}")
        head_dim = s.hidden // s.heads
        mesh = init_device_mesh(self.device.type, (self.n,), mesh_dim_names=("tp",))
        ours = llama.commfuse_plan(head_dim=head_dim, algorithm="vanilla")
        styles = [style for style in ours.values() if hasattr(style, "algorithm")]  # commfuse.tp's
        blocks = []
        for plan in (llama.torch_plan(), ours):
            torch.manual_seed(self.config.seed)  # the same parameters in both blocks and on every rank
            block = llama.Block(dim=s.hidden, n_heads=s.heads, n_kv_heads=s.kv_heads or s.heads, ffn=s.ffn)
            blocks.append(parallelize_module(block.to(device=self.device, dtype=self.dtype), mesh, plan))
        cache = tuple(t.to(device=self.device, dtype=self.dtype) for t in llama.rope_cache(head_dim, s.seq))
        self.side_by_side(*blocks, styles, cache)


class TorchtitanBlock(_SideBySide):
    """torchtitan 0.3's Llama 3 block (``Llama3TransformerBlock``: RMSNorm, grouped-query attention with the fused
    ``wqkv`` and RoPE, SwiGLU) on a tensor-parallel mesh over every rank, sequence parallelism on, under its
    ``spmd_types`` backend (plain local tensors), built twice from one seed by torchtitan's own config classes and
    ``Module.parallelize``: stock (the ``vanilla`` run: the boundary all-gathers and reduce-scatters torchtitan
    declares, then its GEMMs) and with ``commfuse.integrations.torchtitan.use_commfuse`` (every other algorithm,
    set on its modules). Attention's core is torchtitan's SDPA module (causal). Forward + backward on
    (b, s/N, h). As for ``llama_block``, the measure modes cannot take the stock plan apart: its runs refuse them.
    """

    name = "torchtitan"
    stock = "torchtitan's stock plan runs its own collectives"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        try:
            from commfuse.integrations.torchtitan_cpu import prepare

            if self.device.type == "cpu":
                prepare()
            from commfuse.integrations import torchtitan as cf_titan
        except ImportError as e:
            raise CommfuseValueError(f"workload torchtitan needs torchtitan installed beside commfuse ({e}); "
                                     "`bash ci/setup_torchtitan.sh` makes such an environment") from None
        s = self.config.shape
        if s.hidden % s.heads:
            raise CommfuseValueError(f"workload torchtitan: hidden {s.hidden} is not divisible by heads {s.heads}")
        stock, fused, self.context = torchtitan_blocks(self.n, hidden=s.hidden, heads=s.heads,
                                                       kv_heads=s.kv_heads or s.heads, ffn=s.ffn,
                                                       algorithm="vanilla", device=self.device, seed=self.config.seed)
        blocks = [stock.to(dtype=self.dtype), fused.to(dtype=self.dtype)]
        self.side_by_side(*blocks, [m for m in blocks[1].modules() if isinstance(m, cf_titan._Fused)], None)


def torchtitan_blocks(n: int, *, hidden: int, heads: int, kv_heads: int, ffn: int, algorithm: str, device,
                      seed: int) -> tuple:
    """torchtitan 0.3's Llama 3 block (one layer of ``llama3_configs["debugmodel"]`` resized: the fused ``wqkv``,
    torchtitan's SDPA core, SwiGLU of ``ffn``) sharded by its own ``Module.parallelize`` over ``n`` TP ranks
    (sequence parallel, ``spmd_types``), built twice with the same parameters (drawn from ``seed``): stock, and
    through ``use_commfuse(..., algorithm=algorithm)``. Returns (stock block, fused block, the spmd context
    factory both run under). torchtitan must be importable (and ready for this device: ``torchtitan_cpu``)."""
    import dataclasses
    import types

    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import llama3_configs

    from commfuse.integrations import torchtitan as cf_titan

    parallelism = ParallelismConfig(tensor_parallel_degree=n, enable_sequence_parallel=True,
                                    spmd_backend="spmd_types")
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=n, pp=1, ep=1, world_size=n, spmd_backend="spmd_types")
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    blocks = []
    for fused in (False, True):
        config = llama3_configs["debugmodel"](attn_backend="flex")
        layer = config.layers[0]
        init = {"weight": layer.feed_forward.w1.param_init["weight"]}
        config.dim, config.layers = hidden, [layer]
        for norm in (config.norm, layer.attention_norm, layer.ffn_norm):
            norm.normalized_shape = hidden
        config.tok_embeddings.embedding_dim, config.lm_head.in_features = hidden, hidden
        layer.attention = make_gqa_config(dim=hidden, n_heads=heads, n_kv_heads=kv_heads, wqkv_param_init=init,
                                          wo_param_init=init, inner_attention=ScaledDotProductAttention.Config(),
                                          fuse_qkv=True, rope=dataclasses.replace(layer.attention.rope,
                                                                                  dim=hidden // heads))
        layer.feed_forward = make_ffn_config(dim=hidden, hidden_dim=ffn, w1_param_init=init, w2w3_param_init=init)
        if fused:
            cf_titan.use_commfuse(config, algorithm=algorithm)
        config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
        with torch.device("meta"):
            model = config.build()
        model.parallelize(dims)
        model.to_empty(device=device)
        torch.manual_seed(seed)  # the same parameters in both blocks
        with torch.no_grad(), context():
            model.init_weights(buffer_device=device)
        blocks.append(model.layers["0"])
    return blocks[0], blocks[1], context


class MixtureOfExperts(Workload):
    """``commfuse.nn.MoE`` under expert parallelism over every rank, forward + backward on (b, s/N, h).

    Every rank holds ``experts / N`` SwiGLU experts of size ``ffn`` and routes
    its own (b, s/N) tokens top-k to all of them. The full router and expert
    weights are drawn once from the seed (the same on every rank) and loaded
    with ``MoE.load_experts``, so the experts differ from each other and the
    one-process reference (``moe_reference``) can hold them all.

    ``reference()``: what every algorithm is checked against, vanilla
    included: ``moe_reference`` on this rank's tokens with every expert, its
    output and input gradient, and the parameters' gradients of the mean of
    the ranks' losses, as the layer gives them: the full-size gradients summed
    over every rank's tokens (an all-reduce, once, in set-up) and divided by
    the world size, the experts' then cut to this rank's.
    """

    name = "moe"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        from commfuse.nn import MoE

        s, c = self.config.shape, self.config
        g = torch.Generator().manual_seed(1_000_003 * c.seed + 999_983)  # the same full weights on every rank

        def full(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(device=self.device, dtype=self.dtype)

        self.weights = (full(c.experts, s.hidden, scale=1 / math.sqrt(s.hidden)),
                        full(c.experts, s.hidden, 2 * s.ffn, scale=1 / math.sqrt(s.hidden)),
                        full(c.experts, s.ffn, s.hidden, scale=1 / math.sqrt(s.ffn)))
        self.module = MoE(s.hidden, s.ffn, c.experts, c.topk, algorithm="vanilla", device=self.device,
                          dtype=self.dtype).load_experts(*self.weights)
        self.backward = c.backward
        self.x = self.randn(s.batch, s.seq // self.n, s.hidden).requires_grad_(self.backward)
        self.dy = self.randn(s.batch, s.seq // self.n, s.hidden)
        self.params = [p for p in self.module.parameters() if p.requires_grad]

    def run(self, algorithm: str, compiled: bool = False) -> list[torch.Tensor]:
        self.module.algorithm = algorithm
        if not self.backward:
            with torch.no_grad():
                return [self.module(self.x)]
        self.x.grad = None
        for p in self.params:
            p.grad = None
        y = self.module(self.x)
        y.backward(self.dy)
        return [y.detach(), self.x.grad] + [_local(p.grad) for p in self.params]

    def reference(self) -> list[torch.Tensor]:
        import torch.distributed as dist

        from commfuse.nn import moe_reference

        c = self.config
        if not self.backward:
            with torch.no_grad():
                return [moe_reference(self.x, *self.weights, c.topk)]
        router, w13, w2 = (w.detach().clone().requires_grad_() for w in self.weights)
        x = self.x.detach().clone().requires_grad_()
        y = moe_reference(x, router, w13, w2, c.topk)
        y.backward(self.dy)
        # the gradients of the mean of the ranks' losses (the layer's): summed over ranks, divided by their count
        whole = torch.cat([router.grad.flatten(), w13.grad.flatten(), w2.grad.flatten()])
        dist.all_reduce(whole)
        whole /= self.n
        drouter, dw13, dw2 = whole.split([router.numel(), w13.numel(), w2.numel()])
        start, stop = self.module.expert_range
        grads = {"router": drouter.view_as(router), "w13": dw13.view_as(w13)[start:stop],
                 "w2": dw2.view_as(w2)[start:stop]}
        names = {id(p): name for name, p in self.module.named_parameters()}
        return [y.detach(), x.grad] + [grads[names[id(p)]] for p in self.params]

    def routing(self) -> list[int]:
        """Rows this rank's tokens send to each rank (top-k slots per expert, summed over each rank's experts)."""
        from commfuse.nn.moe import route

        with torch.no_grad():
            xt = self.x.reshape(-1, self.x.shape[-1])
            _, chosen = route(xt, self.module.router, self.config.topk)
            per_expert = torch.bincount(chosen.reshape(-1), minlength=self.config.experts)
        return per_expert.view(self.n, -1).sum(dim=1).tolist()


@dataclasses.dataclass
class StrandBlock:
    """One block the ``strands`` workload runs as stages (``commfuse.models``): this rank's parameters
    (requiring grad), ``stages(algorithm, figures)`` building the block's :class:`commfuse.strands.Stage` list
    (``figures``: stage name -> (compute, comm) seconds of the forward, or None) and two micro-batches
    ``(inputs, target)``. ``skipped``: why the block is not run here (its builder is missing), else empty."""

    name: str
    what: str
    params: dict = dataclasses.field(default_factory=dict)
    stages: Callable | None = None
    batches: list = dataclasses.field(default_factory=list)
    skipped: str = ""


def _llama_tp(w: "TwoStrands") -> StrandBlock:
    """The Llama block at TP N with sequence parallelism (``commfuse.models.stages.llama_tp_stages``)."""
    from commfuse.models.stages import llama_tp_params, llama_tp_stages

    s = w.config.shape
    params = {k: v.to(w.device).requires_grad_() for k, v in
              llama_tp_params(w.rank, w.n, hidden=s.hidden, ffn=s.ffn, seed=w.config.seed, dtype=w.dtype).items()}

    def stages(algorithm: str, figures: dict | None = None) -> list:
        return llama_tp_stages(params, heads=s.heads, algorithm=algorithm, figures=figures)

    return StrandBlock(f"llama block, TP {w.n}", f"b={s.batch} s={s.seq} h={s.hidden} ffn={s.ffn} heads={s.heads}",
                       params, stages, w.micro_batches())


def _moe_ep(w: "TwoStrands") -> StrandBlock:
    """The MoE block at EP N (``commfuse.models.moe_stages.moe_ep_stages``)."""
    import importlib.util

    s, c = w.config.shape, w.config
    name = f"moe block, EP {w.n}"
    what = f"b={s.batch} s={s.seq} h={s.hidden} expert ffn={s.ffn} experts={c.experts} top-{c.topk} heads={s.heads}"
    if importlib.util.find_spec("commfuse.models.moe_stages") is None:
        return StrandBlock(name, what, skipped="commfuse.models.moe_stages is not in this installation")
    from commfuse.models.moe_stages import moe_ep_params, moe_ep_stages

    params = {k: v.to(w.device).requires_grad_() for k, v in
              moe_ep_params(w.rank, w.n, hidden=s.hidden, ffn=s.ffn, experts=c.experts, seed=c.seed,
                            dtype=w.dtype).items()}

    def stages(algorithm: str, figures: dict | None = None) -> list:
        return moe_ep_stages(params, heads=s.heads, topk=c.topk, algorithm=algorithm, figures=figures)

    return StrandBlock(name, what, params, stages, w.micro_batches())


#: The blocks the ``strands`` workload times, in order: a block more is one entry more.
STRAND_BLOCKS = {"llama": _llama_tp, "moe": _moe_ep}


def strand_loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The micro-batches' loss: the mean squared distance of the block's output to the target."""
    return (y - target).square().mean()


class TwoStrands(Workload):
    """``strands``: each of :data:`STRAND_BLOCKS` at N ranks, two micro-batches forward + backward through
    ``commfuse.strands.run``, one row of ``config.STRAND_ROWS`` per :meth:`step` (``commfuse.bench.strands``
    times them). Parameters are cut from full weights drawn from the seed; each micro-batch is this rank's
    (b, s/N, h) of the inputs and of the target."""

    name = "strands"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.blocks = [build(self) for build in STRAND_BLOCKS.values()]

    def micro_batches(self) -> list:
        s = self.config.shape
        return [(self.randn(s.batch, s.seq // self.n, s.hidden), self.randn(s.batch, s.seq // self.n, s.hidden))
                for _ in range(2)]

    def step(self, block: StrandBlock, stages: list, plan: str) -> list[torch.Tensor]:
        """One row's run: the losses, then every parameter's gradient (what the rows are checked on)."""
        from commfuse.strands import run

        for p in block.params.values():
            p.grad = None
        losses = run(stages, block.batches, strand_loss, plan=plan)
        return [torch.stack(losses)] + [p.grad for p in block.params.values()]

    def run(self, algorithm: str, compiled: bool = False) -> list[torch.Tensor]:
        raise CommfuseValueError("workload strands times rows of its own (commfuse.bench.strands), not algorithms")


class RingAttentionRows(Workload):
    """``ring_attention``: causal grouped-query attention over a sequence sharded over the ranks (context
    parallelism), forward + backward, one row of ``config.RING_ATTENTION_ROWS`` per :meth:`step`
    (``commfuse.bench.ring_attention`` times them).

    q (b, s, heads, d), k and v (b, s, kv_heads, d) with d = hidden / heads are drawn whole from the seed (the
    same on every rank), with the output gradient dy; the reference is the unsharded attention of the whole
    sequence on every rank (torch's ``scaled_dot_product_attention``, causal) and its q, k, v
    gradients. A row
    takes this rank's shards in its layout (``commfuse.context.shard_sequence``) and is checked against the
    same shards of the reference. Rows whose code this installation lacks are not run and say why
    (:attr:`missing`).

    The ``torch cp`` rows run the ring of torch's ``context_parallel``: ``_templated_ring_attention`` and its
    backward, the functions ``context_parallel`` dispatches SDPA to, with its rotate method and head-tail load
    balancing (the zigzag layout) set, and the device's flash kernel passed in. On a CPU the public
    ``context_parallel`` refuses (DTensor has no sharding strategy for SDPA's CPU kernel), so the kernel is
    passed in directly: :attr:`stock` says what the public API did here.
    """

    name = "ring_attention"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        from commfuse.bench.config import RING_ATTENTION_ROWS

        s = self.config.shape
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads or s.heads, s.hidden // s.heads
        g = torch.Generator().manual_seed(1_000_003 * self.config.seed + 7)  # the same whole tensors on every rank

        def whole(heads: int) -> torch.Tensor:
            t = torch.randn(s.batch, s.seq, heads, self.head_dim, generator=g, dtype=torch.float32)
            return t.to(device=self.device, dtype=self.dtype)

        self.whole = {"q": whole(self.heads), "k": whole(self.kv_heads), "v": whole(self.kv_heads),
                      "dy": whole(self.heads)}
        self.rows = list(RING_ATTENTION_ROWS)
        self.missing = {row: why for row in self.rows if (why := self._missing(*RING_ATTENTION_ROWS[row]))}
        self.stock = self._stock_probe() if any(RING_ATTENTION_ROWS[r][0] == "torch" for r in self.rows
                                                if r not in self.missing) else ""
        self.inputs = {row: self._inputs(*RING_ATTENTION_ROWS[row]) for row in self.rows if row not in self.missing}

    # -- what each row needs ----------------------------------------------------------------------------------

    def _missing(self, who: str, how: str, layout: str) -> str:
        """Why a row cannot run here (empty: it can)."""
        import commfuse

        try:
            import commfuse.context  # noqa: F401
        except ImportError:
            return "commfuse.context (the sequence layouts) is not in this installation"
        if who == "commfuse" and not hasattr(commfuse, "ring_attention"):
            return "commfuse.ring_attention is not in this installation"
        if who == "torch":
            if self.device.type != "cpu":
                return (f"the bench passes torch's ring the CPU flash kernel only; on {self.device.type} run "
                        "torch's context_parallel itself")
            found = torch_ring_module()
            if isinstance(found, str):
                return found
        return ""

    def _stock_probe(self) -> str:
        """What torch's public ``context_parallel`` does here with a small causal SDPA: ``""`` where it ran, else
        its error's first line. Every rank fails alike (before any transfer: at DTensor's sharding propagation)."""
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        n = self.n
        mesh = init_device_mesh(self.device.type, (n,))
        q, k, v = (torch.randn(1, 2, 4 * n, 8, device=self.device) for _ in range(3))
        sdpa = F.scaled_dot_product_attention
        try:
            with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
            why = ""
        except Exception as e:  # noqa: BLE001 - reported in the table, the exact error
            why = first_line(e, 300, named=True)
        finally:
            # torch 2.9's context manager leaves SDPA wrapped when its body raised: every later SDPA (the
            # reference's) would go through the context-parallel dispatcher
            F.scaled_dot_product_attention = sdpa
        dist.barrier()
        return why

    def _inputs(self, who: str, how: str, layout: str) -> dict:
        """This rank's shards of q, k, v, dy and of the reference in the row's layout (torch's: (b, H, s/N, d))."""
        from commfuse.context import shard_sequence

        shards = {name: shard_sequence(t, self.rank, self.n, layout, dim=1) for name, t in self.whole.items()}
        if who == "torch":
            shards = {name: t.transpose(1, 2).contiguous() for name, t in shards.items()}
        return shards

    def reference(self) -> dict:
        """The unsharded attention of the whole sequence and its gradients, (b, s, H, d) each: the output and
        dq, dk, dv of torch's ``scaled_dot_product_attention`` (causal, grouped-query) under the output gradient
        dy, in float32 (float64 for float64 rows), SDPA's CPU flash kernel holding no (s, s) scores."""
        import torch.nn.functional as F

        acc = torch.promote_types(self.dtype, torch.float32)
        q, k, v = (self.whole[name].detach().to(acc).transpose(1, 2).requires_grad_() for name in ("q", "k", "v"))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y.backward(self.whole["dy"].to(acc).transpose(1, 2))
        return {name: t.transpose(1, 2).to(self.dtype) for name, t in
                (("y", y.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}

    def expected(self, row: str, ref: dict) -> list[torch.Tensor]:
        """The reference's shards this rank's row must give: output, dq, dk, dv, each (b, s/N, H, d)."""
        from commfuse.bench.config import RING_ATTENTION_ROWS
        from commfuse.context import shard_sequence

        layout = RING_ATTENTION_ROWS[row][2]
        return [shard_sequence(ref[name], self.rank, self.n, layout, dim=1) for name in ("y", "dq", "dk", "dv")]

    # -- one row's run ----------------------------------------------------------------------------------------

    def step(self, row: str) -> list[torch.Tensor]:
        """One row's forward + backward on this rank's shards: the output and dq, dk, dv, (b, s/N, H, d) each."""
        from commfuse.bench.config import RING_ATTENTION_ROWS

        who, how, layout = RING_ATTENTION_ROWS[row]
        x = self.inputs[row]
        if who == "torch":
            return self._torch_ring(how, x)
        q, k, v = (x[name].detach().requires_grad_() for name in ("q", "k", "v"))
        if who == "ulysses":
            from commfuse.nn.attention import ulysses_attention

            y = ulysses_attention(q, k, v, causal=True, algorithm=how)
        else:
            import commfuse

            y = commfuse.ring_attention(q, k, v, causal=True, layout=layout, algorithm=how)
        y.backward(x["dy"])
        return [y.detach(), q.grad, k.grad, v.grad]

    def _torch_ring(self, method: str, x: dict) -> list[torch.Tensor]:
        """torch's context-parallel ring, forward then backward, as ``context_parallel``'s SDPA dispatch runs it:
        ``_templated_ring_attention`` with rotate ``method`` and head-tail load balancing, the flash kernel's
        logsumexp kept for ``_templated_ring_attention_backward`` (k, v rotated with kv_heads heads: the CPU kernel
        takes grouped-query attention as it is)."""
        import torch.distributed as dist

        cp = torch_ring_module()
        aten = torch.ops.aten
        options = cp._cp_options
        before = (options.rotate_method, options.enable_load_balance)
        cp.set_rotate_method(method)
        options.enable_load_balance = True
        group = dist.group.WORLD
        try:
            y, lse = cp._templated_ring_attention(group, 2, aten._scaled_dot_product_flash_attention_for_cpu.default,
                                                  x["q"], x["k"], x["v"], is_causal=True, dropout_p=0.0)[:2]
            dq, dk, dv = cp._templated_ring_attention_backward(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, x["dy"], "grad_out",
                x["q"], x["k"], x["v"], y, lse, True, dropout_p=0.0)[:3]
        finally:
            options.rotate_method, options.enable_load_balance = before
        return [t.transpose(1, 2) for t in (y, dq, dk, dv)]

    def run(self, algorithm: str, compiled: bool = False) -> list[torch.Tensor]:
        raise CommfuseValueError("workload ring_attention times rows of its own (commfuse.bench.ring_attention), "
                                 "not algorithms")


def torch_ring_module():
    """torch's ring attention module, which its ``context_parallel`` dispatches SDPA to (private:
    ``tensor.experimental._context_parallel._attention`` since torch 2.10, ``tensor.experimental._attention``
    before, with the same ``_templated_ring_attention``, its backward, ``_cp_options`` and
    ``set_rotate_method``), or why it cannot be run (a string)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    except ImportError:
        try:
            from torch.distributed.tensor.experimental import _attention as cp
        except ImportError as e:
            return f"this torch has no context parallel ring ({e})"
    needed = ("_templated_ring_attention", "_templated_ring_attention_backward", "_cp_options", "set_rotate_method")
    missing = [name for name in needed if not hasattr(cp, name)]
    if missing or not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return (f"this torch's ring attention lacks {', '.join(missing) or 'the CPU flash kernel'}, which the "
                "comparison calls")
    return cp


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's piece of a DTensor gradient (the blocks' parameters are DTensors); a tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


CLASSES = {c.name: c for c in (AllGatherMatmul, MatmulReduceScatter, MLP, Attention, Ulysses, FSDPLinear,
                               LlamaBlock, TorchtitanBlock, MixtureOfExperts, TwoStrands,
                               RingAttentionRows)}


def make(name: str, config: BenchConfig, rank: int, world_size: int, device: torch.device) -> Workload:
    return CLASSES[name](config, rank, world_size, device)


def compare(got: list[torch.Tensor | None], ref: list[torch.Tensor | None]) -> tuple[bool, float]:
    """(within tolerance, largest error relative to the reference's largest magnitude) over the lists."""
    if len(got) != len(ref):
        return False, math.inf
    worst = 0.0
    ok = True
    for g, r in zip(got, ref):
        if g is None or r is None:
            ok = ok and g is None and r is None
            continue
        if g.shape != r.shape:
            return False, math.inf
        r64, g64 = r.detach().double(), g.detach().double()
        scale = r64.abs().max().item() if r64.numel() else 0.0
        err = (g64 - r64).abs().max().item() if r64.numel() else 0.0
        rel = err / scale if scale > 0 else err
        if not math.isfinite(rel):
            rel = math.inf
        worst = max(worst, rel)
        ok = ok and rel <= TOLERANCE[r.dtype]
    return ok, worst
