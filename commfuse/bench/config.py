"""What a benchmark run measures: workloads, algorithms, sizes and presets. Imports no torch.

Sizes are those of a transformer layer under tensor parallelism with sequence
parallelism (TPSP): ``batch`` b, ``seq`` s (the whole sequence; each rank
holds s/N of it), ``hidden`` h, ``ffn`` (the MLP's inner size; each rank
holds ffn/N of its columns), ``heads`` and ``kv_heads``. Every workload reads
the sizes it needs (see :data:`WORKLOADS`).
"""

from __future__ import annotations

import dataclasses

from commfuse.errors import CommfuseError, CommfuseValueError
from commfuse.schedule import AlgorithmSpec, parse_algorithm

#: What the benchmark compares by default, in this order. ``vanilla`` is the
#: baseline every speed-up and correctness check refers to; ``serial`` (the
#: ring's hops and compute, one after the other) separates what the ring's
#: collective buys from what the overlap buys (``report``).
ALGORITHMS = ("vanilla", "sliced:2", "sliced:4", "serial", "ring", "bidirectional", "auto")

#: ``--compile``: the ``torch.compile`` backends it takes (``inductor``, the default, generates kernels;
#: ``aot_eager`` traces forward and backward but runs them with eager kernels; ``eager`` is dynamo alone).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")

#: The workloads ``--compile`` times compiled against eager: the ``commfuse.nn`` layers that compile whole
#: (``fullgraph=True``; ``torch.ops.commfuse``, see ``commfuse.library``) and the bare ops inside a compiled
#: function. Ulysses' all-to-all and the Llama block's DTensor plans are not among them.
COMPILE_WORKLOADS = ("mlp", "attention", "fsdp_linear", "ag_matmul", "matmul_rs")

#: What ``--compile`` runs without ``-w`` and ``-a`` (vanilla is always added): one compile per layer and
#: algorithm, each 1-20 s on a CPU.
COMPILE_DEFAULT_WORKLOADS = ("mlp", "attention", "fsdp_linear")
COMPILE_DEFAULT_ALGORITHMS = ("ring",)


@dataclasses.dataclass(frozen=True)
class WorkloadInfo:
    """One workload: what it computes, the collective it overlaps, what it needs."""

    name: str
    summary: str
    collective: str  # all_gather | reduce_scatter | all_to_all | mixed: decides which algorithms apply
    layer: str | None = None  # the commfuse.nn class it runs, None for a bare op
    backward: bool = False  # runs forward + backward unless --forward-only
    requires: str | None = None  # a distribution commfuse does not install (left out of ``-w all``)
    #: rows of its own, timed instead of the algorithms (-a does not apply; left out of ``-w all``)
    rows: tuple[str, ...] = ()


#: The ``strands`` workload's rows: name -> (the ops' algorithm, ``commfuse.strands.run``'s plan). ``ring`` is the
#: reference every other row is checked and compared against.
STRAND_ROWS = {
    "vanilla": ("vanilla", "sequential"),
    "ring": ("ring", "sequential"),
    "strands naive": ("ring", "alternate"),
    "strands searched": ("ring", "searched"),
}

#: The ``ring_attention`` workload's rows: name -> (whose attention, its algorithm or rotate method, the sequence
#: layout of the shards). ``ring`` is the row the targets judge; every row is checked against the unsharded
#: attention on the whole sequence. ``torch cp ...`` rows run torch's context-parallel ring
#: (``torch.distributed.tensor.experimental``; its head-tail load balancing is the zigzag layout at every world
#: size); ``ulysses`` is ``commfuse.nn.attention.ulysses_attention``.
RING_ATTENTION_ROWS = {
    "ring": ("commfuse", "ring", "zigzag"),
    "ring:2": ("commfuse", "ring:2", "zigzag"),
    "ring:4": ("commfuse", "ring:4", "zigzag"),
    "bidirectional": ("commfuse", "bidirectional", "zigzag"),
    "vanilla": ("commfuse", "vanilla", "zigzag"),
    "ring contiguous": ("commfuse", "ring", "contiguous"),
    "torch cp allgather": ("torch", "allgather", "zigzag"),
    "torch cp alltoall": ("torch", "alltoall", "zigzag"),
    "ulysses": ("ulysses", "ring", "contiguous"),
}


WORKLOADS = {
    w.name: w
    for w in (
        WorkloadInfo("ag_matmul", "all_gather(x) @ W: x (b*s/N, h) per rank, W (h, ffn/N); the column-parallel "
                     "(MLP up) projection", "all_gather"),
        WorkloadInfo("matmul_rs", "reduce_scatter(x @ W): x (b*s, ffn/N), W (ffn/N, h) -> (b*s/N, h); the "
                     "row-parallel (MLP down) projection", "reduce_scatter"),
        WorkloadInfo("mlp", "ParallelMLP(h, ffn) forward + backward on (b, s/N, h): up projection fused with the "
                     "all-gather, down projection with the reduce-scatter", "mixed", "ParallelMLP", True),
        WorkloadInfo("attention", "ParallelAttention(h, heads) forward + backward on (b, s/N, h): query-split "
                     "attention, each slice's output projection feeding the reduce-scatter", "mixed",
                     "ParallelAttention", True),
        WorkloadInfo("ulysses", "UlyssesAttention(h, heads) forward + backward on (b, s/N, h): all-to-all "
                     "decomposed pairwise, each arrived chunk's attention computed while the next travels",
                     "all_to_all", "UlyssesAttention", True),
        WorkloadInfo("fsdp_linear", "ShardedLinear(h, ffn) forward + backward on (b, s/N, h): the weight "
                     "all-gather fused into the forward GEMM, the gradient reduce-scatter into the wgrad GEMM",
                     "mixed", "ShardedLinear", True),
        WorkloadInfo("llama_block", "a Llama-style block (RMSNorm, attention with RoPE and GQA, SwiGLU; "
                     "commfuse.models.llama) forward + backward on (b, s/N, h): vanilla is torch's own styles "
                     "(DTensor's collectives, then the GEMMs), every other algorithm commfuse.tp's block styles",
                     "mixed", None, True),
        WorkloadInfo("torchtitan", "torchtitan 0.3's own Llama 3 block (commfuse.integrations.torchtitan) forward + "
                     "backward on (b, s/N, h), plain local tensors: vanilla is torchtitan's stock tensor-parallel plan, "
                     "every other algorithm the block with commfuse's fused modules (needs torchtitan installed)",
                     "mixed", None, True, requires="torchtitan"),
        WorkloadInfo("moe", "MoE(h, ffn, experts, topk) forward + backward on (b, s/N, h) under expert parallelism: "
                     "the token dispatch (an uneven all-to-all) fused with the experts' gate/up GEMM per arriving "
                     "source, the down GEMM with the combine per destination; checked against moe_reference",
                     "all_to_all", "MoE", True),
        WorkloadInfo("strands", "two micro-batches of a block (the Llama block at TP N, the MoE block at EP N; "
                     "commfuse.models) forward + backward through commfuse.strands: vanilla and ring one micro-batch "
                     "after the other, then two strands (the second forward beside the first backward) paired "
                     "naively and by the plan search over figures measured on the group; its own rows, no -a",
                     "mixed", None, True, rows=tuple(STRAND_ROWS)),
        WorkloadInfo("ring_attention", "causal grouped-query attention (heads, kv_heads, head dim hidden/heads) "
                     "forward + backward on a sequence sharded over the ranks (context parallelism): "
                     "commfuse.ring_attention (ring, bidirectional, vanilla; zigzag, and contiguous ring), torch's "
                     "context_parallel ring (allgather, alltoall) and commfuse's Ulysses, each checked against the "
                     "unsharded attention; its own rows, no -a", "mixed", None, True,
                     rows=tuple(RING_ATTENTION_ROWS)),
    )
}

#: The ``moe`` workload's expert count and top-k (``--experts``, ``--topk``); its expert FFN size is ``ffn``.
MOE_EXPERTS = 4
MOE_TOPK = 2


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seq: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int | None = None

    def text(self) -> str:
        kv = f", kv_heads={self.kv_heads}" if self.kv_heads else ""
        return f"b={self.batch} s={self.seq} h={self.hidden} ffn={self.ffn} heads={self.heads}{kv}"


#: Presets. The paper's layer-level settings (PAPER.md, Tables 1 and 4) are
#: far beyond a CPU: ``--scale F`` divides b, s, h and ffn by F (heads are
#: kept while the head dim stays >= 16). ``small`` is what the main job runs.
PRESETS = {
    "tiny": Shape(batch=1, seq=32, hidden=32, ffn=64, heads=4),
    "small": Shape(batch=4, seq=512, hidden=512, ffn=2048, heads=8),
    "paper-mlp": Shape(batch=32, seq=4096, hidden=4096, ffn=16384, heads=32),
    "paper-attention": Shape(batch=16, seq=4096, hidden=4096, ffn=16384, heads=32),
    "paper-attention-long": Shape(batch=4, seq=8192, hidden=4096, ffn=16384, heads=32),
}

MIN_HEAD_DIM = 16


def scaled(shape: Shape, factor: int) -> Shape:
    """``shape`` with b, s, h and ffn divided by ``factor`` (at least 1); heads kept while h/heads >= 16."""
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise CommfuseValueError(f"--scale must be an integer >= 1, got {factor!r}")
    if factor == 1:
        return shape
    hidden = max(1, shape.hidden // factor)
    heads = shape.heads if hidden // shape.heads >= MIN_HEAD_DIM else max(1, hidden // MIN_HEAD_DIM)
    kv = shape.kv_heads
    if kv is not None:
        kv = max(1, min(kv, heads))
    return Shape(
        batch=max(1, shape.batch // factor),
        seq=max(1, shape.seq // factor),
        hidden=hidden,
        ffn=max(1, shape.ffn // factor),
        heads=heads,
        kv_heads=kv,
    )


def check_algorithm(text: str) -> AlgorithmSpec:
    """``text`` parsed by the library's one algorithm grammar (:func:`commfuse.schedule.parse_algorithm`).

    Raises ``CommfuseValueError`` naming the text (also for a text that is not a string).
    """
    if not isinstance(text, str):
        raise CommfuseValueError(f"algorithm {text!r} is not a string such as 'ring' or 'sliced:4'")
    try:
        return parse_algorithm(text)
    except CommfuseValueError:
        raise
    except CommfuseError as e:  # the grammar's other errors, still naming the text
        raise CommfuseValueError(f"algorithm {text!r}: {e}") from None


def applies(workload: str, algorithm: str) -> bool:
    """Whether ``algorithm`` is defined for the workload's collectives (all_to_all has no bidirectional)."""
    spec = parse_algorithm(algorithm)
    return not (WORKLOADS[workload].collective == "all_to_all" and spec.name == "bidirectional")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Everything a run needs; picklable and torch-free so it travels to the ranks."""

    workloads: tuple[str, ...] = ("ag_matmul", "matmul_rs")
    algorithms: tuple[str, ...] = ALGORITHMS
    shape: Shape = PRESETS["small"]
    preset: str | None = "small"
    scale: int = 1
    world_size: int = 2
    threads: int = 1
    repeats: int = 10
    warmup: int = 2
    dtype: str = "float32"
    device: str | None = None  # None: cpu when launching ranks, the accelerator under torchrun
    backward: bool = True  # layer workloads run forward + backward
    fingerprint: bool = False  # time the ops' fingerprint exchange too (COMMFUSE_CHECK)
    link_rate: str | None = None
    trace: bool = False
    timeout: float = 1800.0
    seed: int = 0
    #: ``--compile``: time each workload eager against ``torch.compile(..., fullgraph=True, backend=this)``
    #: instead of the algorithms against each other (``commfuse.bench.compiled``); None: the overlap benchmark
    compile_backend: str | None = None
    #: ``moe``: experts over the ranks (experts / N on each) and experts per token
    experts: int = MOE_EXPERTS
    topk: int = MOE_TOPK

    def __post_init__(self) -> None:
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if unknown or not self.workloads:
            raise CommfuseValueError(
                f"unknown workload(s) {unknown or '(none given)'}: expected some of {', '.join(WORKLOADS)}"
            )
        if self.compile_backend is not None:
            if self.compile_backend not in COMPILE_BACKENDS:
                raise CommfuseValueError(f"--compile takes one of {', '.join(COMPILE_BACKENDS)}, got "
                                         f"{self.compile_backend!r}")
            refused = [w for w in self.workloads if w not in COMPILE_WORKLOADS]
            if refused:
                raise CommfuseValueError(
                    f"--compile times the workloads that compile whole with fullgraph=True "
                    f"({', '.join(COMPILE_WORKLOADS)}), not {', '.join(refused)}: drop "
                    f"{'it' if len(refused) == 1 else 'them'} from -w"
                )
        specs = [check_algorithm(a) for a in self.algorithms]
        if "vanilla" not in self.algorithms:  # the baseline of every comparison
            object.__setattr__(self, "algorithms", ("vanilla", *self.algorithms))
            specs.insert(0, parse_algorithm("vanilla"))
        if len(set(specs)) != len(specs):  # the same algorithm written twice, also 'sliced' and 'sliced:2'
            raise CommfuseValueError(f"algorithms {list(self.algorithms)} name one algorithm twice")
        for name in ("world_size", "threads", "repeats", "experts", "topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CommfuseValueError(f"{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise CommfuseValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if self.trace and all(WORKLOADS[w].rows for w in self.workloads):
            raise CommfuseValueError(f"--trace and --plot draw one iteration per algorithm; workload "
                                     f"{' and '.join(self.workloads)} times rows of its own and traces none: add a "
                                     "workload such as -w mlp, or drop them")
        if not self.backward and "strands" in self.workloads:
            raise CommfuseValueError("workload strands runs forward + backward (a backward beside the next forward "
                                     "is what it times): drop --forward-only")
        if not self.backward and "ring_attention" in self.workloads:
            raise CommfuseValueError("workload ring_attention times forward + backward (the backward's ring is half "
                                     "of what it compares): drop --forward-only")
        if self.topk > self.experts:
            raise CommfuseValueError(f"topk must be at most experts, got topk={self.topk} with {self.experts} experts")
        if self.dtype not in ("float32", "float64", "bfloat16", "float16"):
            raise CommfuseValueError(f"dtype must be float32, float64, bfloat16 or float16, got {self.dtype!r}")
        for f in dataclasses.fields(Shape):
            value = getattr(self.shape, f.name)
            if value is None and f.name == "kv_heads":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CommfuseValueError(f"{f.name} must be an integer >= 1, got {value!r}")

    def check_world(self, n: int) -> None:
        """Raise if a workload's sizes do not split over ``n`` ranks, naming the dim and sizes."""
        s = self.shape
        for w in self.workloads:
            needs = []
            if w in ("ag_matmul", "matmul_rs"):
                needs.append(("b*s (tokens)", s.batch * s.seq))
                needs.append(("ffn", s.ffn))
            else:
                needs.append(("seq", s.seq))
            if w in ("mlp", "llama_block", "strands"):
                needs.append(("ffn", s.ffn))
            if w in ("attention", "ulysses", "llama_block", "strands"):
                needs.append(("heads", s.heads))
                if s.hidden % s.heads:
                    raise CommfuseValueError(
                        f"workload {w}: hidden {s.hidden} is not divisible by heads {s.heads}")
                if s.kv_heads is not None:
                    needs.append(("kv_heads", s.kv_heads))
            if w == "fsdp_linear":
                needs.append(("ffn (the sharded weight's rows)", s.ffn))
            if w in ("moe", "strands"):
                needs.append(("experts (--experts)", self.experts))
            if w == "ring_attention":
                if s.hidden % s.heads:
                    raise CommfuseValueError(
                        f"workload {w}: hidden {s.hidden} is not divisible by heads {s.heads}")
                kv = s.kv_heads or s.heads
                if s.heads % kv:
                    raise CommfuseValueError(f"workload {w}: heads {s.heads} is not a multiple of kv_heads {kv}")
                if s.seq % (2 * n):  # zigzag cuts the sequence in 2N chunks
                    raise CommfuseValueError(
                        f"workload {w}: seq = {s.seq} does not divide into 2 x world size = {2 * n} chunks (the "
                        f"zigzag layout); pick --seq a multiple of {2 * n}")
                needs += [("heads (ulysses spreads them over the ranks)", s.heads),
                          ("kv_heads (ulysses spreads them over the ranks)", kv)]
            for what, size in needs:
                if size % n:
                    raise CommfuseValueError(
                        f"workload {w}: {what} = {size} does not divide over world size {n}; pick sizes that are "
                        f"multiples of {n} (--batch/--seq/--hidden/--ffn/--heads) or another --world-size"
                    )


def describe_rate(rate: str | None) -> str:
    return f"loopback shaped to {rate}" if rate else "plain loopback"


__all__ = [
    "ALGORITHMS", "COMPILE_BACKENDS", "MOE_EXPERTS", "MOE_TOPK", "COMPILE_DEFAULT_ALGORITHMS", "COMPILE_DEFAULT_WORKLOADS", "COMPILE_WORKLOADS",
    "PRESETS", "RING_ATTENTION_ROWS", "STRAND_ROWS", "WORKLOADS", "BenchConfig", "Shape", "WorkloadInfo", "applies", "check_algorithm",
    "scaled", "describe_rate",
]
