"""Model presets: a whole model's tensor-parallel layers, for ``commfuse simulate --model``.

A model is its layers' parts, each a workload of this simulator
(``commfuse.sim._workloads``) that one TP group runs, times how many of it a
step has. Under TP with sequence parallelism over ``tp`` ranks:

* ``attention``: the query-split attention of every layer, causal, with the
  model's query and K/V heads (grouped-query for Llama 3) or its latent
  attention (MLA, DeepSeek-V3), its all-gather fused with the QKV (or latent)
  projection and its reduce-scatter with the out-projection;
* ``mlp``: Llama's SwiGLU MLP (the gate and up projections in one gathered
  GEMM); DeepSeek-V3's first dense layers (``dense mlp``);
* ``moe`` (DeepSeek-V3): the routed experts under expert parallelism over
  ``ep`` ranks (default: the TP ranks), each rank's T/tp tokens dispatched to
  and combined from them (the ``moe`` workload); ``shared expert``: a SwiGLU
  MLP on the rank's own T/tp tokens, its weights on every rank (no
  communication);
* ``lm head``: the output projection to the vocabulary, a column-parallel
  linear whose all-gather of the sequence is fused with it.

One layer of each kind is simulated and its time multiplied by its count: the
layers run one after another, each starting when the previous ends. Left out
(the same under every algorithm, or outside the TP group): the embedding,
norms, residual adds, RoPE, the softmax's and the loss's elementwise work,
DeepSeek-V3's multi-token-prediction module, data-parallel gradient
reduction, pipeline stages and the optimizer. The shapes are the models'
published configurations (each preset names its source).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from commfuse.errors import CommfuseValueError
from commfuse.sim._predict import Prediction, predict
from commfuse.sim._profile import Profile, load_profile
from commfuse.sim._workloads import MLA, Workload, parse_algorithm

__all__ = ["MODELS", "Model", "ModelPart", "ModelPrediction", "compare_model", "model_parts"]


@dataclass(frozen=True)
class Model:
    """A transformer's shapes. Dense: every layer has ``ffn``. With ``experts``: the first ``dense_layers``
    layers are dense, the others have a mixture of ``experts`` routed experts of ``expert_ffn`` (``topk`` per
    token) and ``shared_experts`` shared ones. ``mla``: latent attention (then ``kv_heads`` is ``heads`` and
    ``head_dim`` is unused). ``seq``: the context the model was pretrained at (the default sequence)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    seq: int
    source: str
    experts: int = 0
    topk: int = 0
    shared_experts: int = 0
    expert_ffn: int = 0
    dense_layers: int = 0
    mla: MLA | None = None

    def parameters(self) -> tuple[int, int]:
        """The model's parameters, all of them and those one token uses (the routed experts it is sent to):
        the embedding and the untied output projection, per layer the attention's projections and the MLP's or
        MoE's (router included), and the norms (two per layer, MLA's two latent norms, the final one)."""
        h, m = self.hidden, self.mla
        if m is not None:
            attention = (h * m.q_lora + m.q_lora * self.heads * (m.nope + m.rope) + h * (m.kv_lora + m.rope)
                         + m.kv_lora * self.heads * (m.nope + m.v) + self.heads * m.v * h + m.q_lora + m.kv_lora)
        else:
            attention = h * self.heads * self.head_dim + 2 * h * self.kv_heads * self.head_dim \
                + self.heads * self.head_dim * h
        expert = 3 * h * self.expert_ffn
        dense = self.dense_layers if self.experts else self.layers
        moe = self.layers - dense
        fixed = 2 * self.vocab * h + h + self.layers * (attention + 2 * h) + dense * 3 * h * self.ffn \
            + moe * (self.shared_experts * expert + self.experts * h)
        return fixed + moe * self.experts * expert, fixed + moe * self.topk * expert

    def describe(self) -> str:
        if self.mla is not None:
            m = self.mla
            attention = (f"{self.heads} heads of MLA (latents q {m.q_lora}, kv {m.kv_lora}; head dims {m.nope} + "
                         f"{m.rope} rope, v {m.v})")
        else:
            attention = f"{self.heads} query heads, {self.kv_heads} K/V heads, head dim {self.head_dim}"
        text = f"{self.name}: hidden {self.hidden}, {self.layers} layers, {attention}, "
        if self.experts:
            text += (f"{self.dense_layers} dense layers of ffn {self.ffn} then MoE: {self.experts} routed experts "
                     f"(top-{self.topk}) and {self.shared_experts} shared, expert ffn {self.expert_ffn} (SwiGLU)")
        else:
            text += f"ffn {self.ffn} (SwiGLU)"
        total, used = self.parameters()
        params = f"{total / 1e9:.1f}B parameters" + (f" ({used / 1e9:.1f}B a token)" if used != total else "")
        return text + f", vocab {self.vocab}; {params}"


_LLAMA3 = "Llama 3 (Meta, 'The Llama 3 Herd of Models', 2024) and its released config.json"

#: The presets. Llama 3.1 405B has Llama 3's shapes; all four Llama 3 models were pretrained at 8192 tokens.
#: DeepSeek-V3: the DeepSeek-V3 technical report (2024) and its released config.json (first_k_dense_replace 3,
#: moe_intermediate_size 2048, n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1; pretrained at
#: 4096 tokens).
MODELS: dict[str, Model] = {
    "llama3-8b": Model("llama3-8b", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336,
                       vocab=128256, seq=8192, source=_LLAMA3),
    "llama3-70b": Model("llama3-70b", hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128, ffn=28672,
                        vocab=128256, seq=8192, source=_LLAMA3),
    "llama3-405b": Model("llama3-405b", hidden=16384, layers=126, heads=128, kv_heads=8, head_dim=128, ffn=53248,
                         vocab=128256, seq=8192, source=_LLAMA3 + " (Llama 3.1 405B)"),
    "deepseek-v3": Model("deepseek-v3", hidden=7168, layers=61, heads=128, kv_heads=128, head_dim=128, ffn=18432,
                         vocab=129280, seq=4096, experts=256, topk=8, shared_experts=1, expert_ffn=2048,
                         dense_layers=3, mla=MLA(q_lora=1536, kv_lora=512, nope=128, rope=64, v=128),
                         source="DeepSeek-V3 technical report (DeepSeek-AI, 2024) and its released config.json"),
}


@dataclass(frozen=True)
class ModelPart:
    """One kind of layer part of a model: its workload and how many of it one step has."""

    name: str
    workload: Workload
    count: int


def model_parts(model: Model | str, *, tp: int, seq: int | None = None, batch: int = 1, ep: int | None = None,
                dtype: str = "bfloat16", passes: str = "both") -> list[ModelPart]:
    """``model``'s parts under TP with sequence parallelism over ``tp`` ranks, ``batch`` x ``seq`` tokens (default
    the model's ``seq``) per TP group; the routed experts over ``ep`` ranks (default ``tp``)."""
    m = _model(model)
    seq = m.seq if seq is None else seq
    if seq % tp:
        raise CommfuseValueError(f"{m.name}: seq {seq} must divide by tp {tp} (sequence parallelism gives each rank "
                                 f"seq / tp tokens)")
    if m.vocab % tp:
        raise CommfuseValueError(f"{m.name}: vocab {m.vocab} does not divide by tp {tp}")
    shape = dict(tp=tp, seq=seq, hidden=m.hidden, batch=batch, dtype=dtype, passes=passes)
    if m.mla is not None:
        attention = Workload("attention", heads=m.heads, mla=m.mla, **shape)
    else:
        attention = Workload("attention", heads=m.heads, kv_heads=m.kv_heads, head_dim=m.head_dim, **shape)
    parts = [ModelPart("attention", attention, m.layers)]
    dense = m.dense_layers if m.experts else m.layers
    if dense:
        parts.append(ModelPart("dense mlp" if m.experts else "mlp",
                               Workload("mlp", ffn=m.ffn, gated=True, **shape), dense))
    if m.experts:
        ep = tp if ep is None else ep
        local = dict(shape, tp=1, seq=seq // tp)  # each rank's own tokens, after the attention's reduce-scatter
        moe = Workload("moe", ep=ep, experts=m.experts, topk=m.topk, ffn=m.expert_ffn, **local)
        parts.append(ModelPart("moe", moe, m.layers - m.dense_layers))
        parts.append(ModelPart("shared expert", Workload("mlp", ffn=m.expert_ffn * m.shared_experts, gated=True,
                                                         **local), m.layers - m.dense_layers))
    elif ep is not None:
        raise CommfuseValueError(f"{m.name} has no experts: ep applies to a mixture-of-experts model")
    parts.append(ModelPart("lm head", Workload("ag_matmul", ffn=m.vocab, **shape), 1))
    return parts


def _model(model: Model | str) -> Model:
    if isinstance(model, Model):
        return model
    found = MODELS.get(model)
    if found is None:
        raise CommfuseValueError(f"no model preset named {model!r}; there are {', '.join(MODELS)}")
    return found


def _part_algorithm(part: ModelPart, algorithm: str) -> str:
    """What ``algorithm`` means for one part: a part without communication (one rank) runs as it is (vanilla);
    the all-to-all has no bidirectional form (each pairwise step already uses another link), so MoE runs it
    as ``ring``."""
    if part.workload.world_size == 1:
        return "vanilla"
    name, parts, _ = parse_algorithm(algorithm)
    if part.workload.name == "moe" and name == "bidirectional":
        return "ring" if parts == 1 else f"ring:{parts}"
    return algorithm


@dataclass(frozen=True)
class ModelPrediction:
    """One algorithm's prediction of a model's step: per part, the prediction of one of it (``parts``, beside
    the parts' list); the step's time, compute-only time and flops per rank sum each part times its count."""

    model: Model
    algorithm: str
    profile: str
    parts: tuple[tuple[ModelPart, Prediction], ...]
    speedup_vs_vanilla: float | None = None

    @property
    def time(self) -> float:
        return sum(part.count * p.time for part, p in self.parts)

    @property
    def compute_only(self) -> float:
        return sum(part.count * p.compute_only for part, p in self.parts)

    @property
    def exposed(self) -> float:
        """Communication not hidden: the step's time beyond its compute-only time."""
        return self.time - self.compute_only

    @property
    def flops(self) -> float:
        return sum(part.count * p.flops for part, p in self.parts)

    @property
    def mfu(self) -> float:
        peak = self.parts[0][1].peak_flops
        return self.flops / (self.time * peak) if self.time > 0 else 0.0

    def record(self) -> dict:
        def ms(t: float) -> float:
            return round(1e3 * t, 6)

        w = self.parts[0][0].workload
        return {
            "model": self.model.name,
            "algorithm": self.algorithm,
            "tp": w.tp,
            "batch": w.batch,
            "seq": w.seq,
            "passes": w.passes,
            "dtype": w.dtype,
            "step_ms": ms(self.time),
            "compute_only_ms": ms(self.compute_only),
            "exposed_ms": ms(self.exposed),
            "speedup_vs_vanilla": None if self.speedup_vs_vanilla is None else round(self.speedup_vs_vanilla, 4),
            "mfu": round(self.mfu, 4),
            "parts": {part.name: {"count": part.count, "algorithm": p.algorithm, "ms_each": ms(p.time),
                                  "ms": ms(part.count * p.time), "exposed_ms_each": ms(p.exposed)}
                      for part, p in self.parts},
            "predicted": True,
            "profile": self.profile,
        }


def compare_model(profile: Profile | str, model: Model | str, algorithms: Sequence[str], *, tp: int,
                  seq: int | None = None, batch: int = 1, ep: int | None = None, dtype: str | None = None,
                  passes: str = "both", symmetric: bool | None = None, check: bool = False) -> list[ModelPrediction]:
    """Predict one step of ``model``'s TP layers (:func:`model_parts`) under every algorithm in ``algorithms``
    (vanilla added if missing); ``speedup_vs_vanilla`` filled in."""
    profile = load_profile(profile)
    m = _model(model)
    parts = model_parts(m, tp=tp, seq=seq, batch=batch, ep=ep, dtype=dtype or profile.compute.dtype, passes=passes)
    names = list(dict.fromkeys(algorithms))
    if "vanilla" not in names:
        names.insert(0, "vanilla")
    for a in names:  # refuse an algorithm a part has no model of before running any
        for part in parts:
            part.workload.check_algorithm(_part_algorithm(part, a))
    memo: dict[tuple[int, str], Prediction] = {}
    out = []
    for a in names:
        predicted = []
        for i, part in enumerate(parts):
            key = (i, _part_algorithm(part, a))
            if key not in memo:
                memo[key] = predict(profile, part.workload, key[1], symmetric=symmetric, check=check)
            predicted.append((part, memo[key]))
        out.append(ModelPrediction(m, a, profile.name, tuple(predicted)))
    vanilla = next(p for p in out if p.algorithm == "vanilla")
    return [replace(p, speedup_vs_vanilla=vanilla.time / p.time if p.time > 0 else None) for p in out]
