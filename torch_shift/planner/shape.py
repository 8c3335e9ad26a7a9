"""A model's shape from its config.json alone, and the FLOPs and bytes of each operation of a step.

No weights are read: planning a 70B model needs only its config.json. The operations are those of
`torch_shift.models.decoder.DecoderLM` run eagerly: per layer an RMSNorm, the fused q/k/v projection,
RoPE (and q/k norms for Qwen3), attention over the paged KV cache, o_proj, a residual add, an RMSNorm,
the fused gate/up projection, SiLU x up, down_proj and a residual add; then the final norm, the LM head
on the sampled rows only, and sampling. Counts are for one rank's shard: the caller (the cost model)
says how many tokens, heads and MLP columns the rank holds under its layout.

Bytes are those an ideal kernel moves (weights once, activations in and out once, each sequence's K and
V read once); what a real kernel moves beyond that shows up as a lower achievable rate in the hardware
profile (`torch-shift calibrate` measures the rates against these same counts).

A mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral, GPT-OSS) replaces the MLP of its sparse layers by a router and
the routed experts (`torch_shift.models.moe`): per token only its top-k experts run, and a step reads the weights of
the experts its tokens reach, expected E (1 - (1 - k/E)^T) of E for T tokens under balanced routing (one
token reads k experts' weights; a few hundred read them all). Qwen2-MoE's shared expert runs for every token, a dense
MLP beside them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

from torch_shift.config import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                  "float8": "fp8", "float8_e4m3fn": "fp8", **{d: d for d in DTYPE_BYTES}}


def canonical_dtype(dtype: str) -> str:
    """'bfloat16' -> 'bf16' etc.; a ValueError for a dtype the planner does not know."""
    if not isinstance(dtype, str) or dtype.lower() not in _DTYPE_ALIASES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPE_BYTES)}")
    return _DTYPE_ALIASES[dtype.lower()]


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a decoder (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts
    Qwen2-MoE, Qwen3-MoE, Mixtral and GPT-OSS: `num_experts` routed experts of `expert_intermediate_size` in
    `num_sparse_layers` of the layers, `experts_per_token` of them per token, and in each sparse layer a shared expert
    of `shared_expert_intermediate_size` that every token runs, where that is not 0) and its dtypes.

    `weight_dtype` sets the bytes of a weight and the FLOP rate of the linears (FP8 weights: FP8 matmuls
    where the hardware has them, as vLLM's FP8 W8A8 on Hopper; elsewhere weight-only FP8 at the 16-bit
    rate). Activations, logits and collectives are in `activation_dtype` (BF16 for FP8 weights); the KV
    cache in `kv_dtype` (the activation dtype unless set)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    weight_dtype: str = "bf16"
    kv_dtype: str | None = None
    name: str = "model"
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    num_sparse_layers: int = 0
    # GPT-OSS: an o_proj bias and a sink per head, a router bias and expert biases, and `sliding_window` on
    # only `num_window_layers` of the layers (0: on all of them)
    o_proj_bias: bool = False
    attention_sinks: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    num_window_layers: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_dtype", canonical_dtype(self.weight_dtype))
        if self.kv_dtype is not None:
            object.__setattr__(self, "kv_dtype", canonical_dtype(self.kv_dtype))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.num_experts or self.num_sparse_layers:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(f"experts_per_token={self.experts_per_token} must be between 1 and "
                                 f"num_experts={self.num_experts}")
            if self.expert_intermediate_size < 1 or not 1 <= self.num_sparse_layers <= self.num_layers:
                raise ValueError(f"a mixture of experts needs expert_intermediate_size >= 1 and 1 <= "
                                 f"num_sparse_layers <= num_layers={self.num_layers}, got "
                                 f"{self.expert_intermediate_size} and {self.num_sparse_layers}")

    @classmethod
    def from_config(cls, config: ModelConfig, dtype: str = "auto", kv_dtype: str | None = None,
                    name: str = "model") -> ModelShape:
        """`dtype`: 'auto' (the checkpoint's, fp32 when it names none), fp32, bf16, fp16 or fp8."""
        weight_dtype = canonical_dtype(config.torch_dtype or "fp32") if dtype == "auto" else dtype
        windows = [w for w in config.layer_windows if w is not None]
        return cls(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, vocab_size=config.vocab_size,
            tie_word_embeddings=config.tie_word_embeddings, attention_bias=config.attention_bias,
            qk_norm=config.qk_norm, sliding_window=max(windows) if windows else config.sliding_window,
            weight_dtype=weight_dtype,
            kv_dtype=kv_dtype, name=name, num_experts=config.num_experts,
            experts_per_token=config.num_experts_per_tok, expert_intermediate_size=config.moe_intermediate_size,
            num_sparse_layers=len(config.sparse_layers), o_proj_bias=config.o_proj_bias,
            attention_sinks=config.attention_sinks, router_bias=config.router_bias, expert_bias=config.expert_bias,
            num_window_layers=len(windows), shared_expert_intermediate_size=config.shared_expert_intermediate_size,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str = "auto", kv_dtype: str | None = None) -> ModelShape:
        """From a model directory or a config.json file; weights, if any, are not read."""
        path = Path(path)
        name = path.name if path.is_dir() else path.parent.name
        return cls.from_config(ModelConfig.from_dir(path), dtype, kv_dtype, name=name)

    @property
    def activation_dtype(self) -> str:
        return "bf16" if self.weight_dtype == "fp8" else self.weight_dtype

    @property
    def weight_bytes(self) -> int:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def activation_bytes(self) -> int:
        return DTYPE_BYTES[self.activation_dtype]

    @property
    def kv_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype or self.activation_dtype]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_sparse_layers

    def attention_parameters(self) -> int:
        """q/k/v (with bias), o (with bias), the q/k norms and the sinks of one layer."""
        h, d = self.hidden_size, self.head_dim
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * d
        bias = (self.num_heads + 2 * self.num_kv_heads) * d if self.attention_bias else 0
        extras = (2 * d if self.qk_norm else 0) + (h if self.o_proj_bias else 0) + (
            self.num_heads if self.attention_sinks else 0)
        return qkv + bias + self.q_size * h + extras

    def mlp_parameters(self, sparse: bool, experts: int | None = None) -> int:
        """A dense layer's gated MLP, or a sparse layer's router, `experts` of its experts (all by default) and its
        shared expert with that expert's gate."""
        h = self.hidden_size
        if not sparse:
            return 3 * h * self.intermediate_size
        experts = self.num_experts if experts is None else experts
        router = (h + (1 if self.router_bias else 0)) * self.num_experts
        per_expert = 3 * h * self.expert_intermediate_size + (2 * self.expert_intermediate_size + h
                                                              if self.expert_bias else 0)
        return router + experts * per_expert + self.shared_expert_parameters()

    def shared_expert_parameters(self) -> int:
        """A sparse layer's shared expert (a gated MLP) and its gate (one output), or 0 where it has none."""
        width = self.shared_expert_intermediate_size
        return 3 * self.hidden_size * width + self.hidden_size if width else 0

    def num_parameters(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        layers = self.num_layers * (self.attention_parameters() + 2 * self.hidden_size)
        layers += self.num_dense_layers * self.mlp_parameters(False)
        layers += self.num_sparse_layers * self.mlp_parameters(True)
        return embed + head + layers + self.hidden_size

    def num_active_parameters(self) -> int:
        """The parameters one token runs through: its top-k experts of each sparse layer, not all of them."""
        unused_experts = self.mlp_parameters(True) - self.mlp_parameters(True, self.experts_per_token)
        inactive = self.num_sparse_layers * unused_experts
        return self.num_parameters() - inactive

    def expected_experts(self, tokens: int) -> float:
        """Distinct experts of one sparse layer that `tokens` tokens reach, in expectation under balanced routing
        (each token picks its top-k uniformly): E (1 - (1 - k/E)^T)."""
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens) if tokens else 0.0


@dataclass(frozen=True)
class Seq:
    """One sequence of a step: `num_new_tokens` computed now after `num_computed_tokens` already in the
    KV cache (the scheduler's names); `logits_rows` of them go through the LM head (1 when it samples,
    0 for a prompt chunk that does not reach the end, the chunk's length with prompt logprobs)."""

    num_new_tokens: int
    num_computed_tokens: int = 0
    logits_rows: int = 1

    def __post_init__(self) -> None:
        if self.num_new_tokens < 1 or self.num_computed_tokens < 0 or not 0 <= self.logits_rows <= self.num_new_tokens:
            raise ValueError(f"a sequence needs num_new_tokens >= 1, num_computed_tokens >= 0 and 0 <= logits_rows "
                             f"<= num_new_tokens, got {self}")

    @classmethod
    def from_scheduled(cls, entry) -> Seq:
        """From a `torch_shift.engine.scheduler.ScheduledRequest` of a step plan."""
        rows = entry.num_tokens if entry.prompt_logprobs else int(entry.sample)
        return cls(entry.num_tokens, entry.num_computed_tokens, rows)


@dataclass(frozen=True)
class Op:
    """One operation on one rank: `flops` at the FLOP rate and `bytes` at the bandwidth of `rate`
    ("matmul", "attention" or "copy") in `dtype`; a matmul has `rows` rows of input."""

    name: str
    flops: float
    bytes: float
    rate: str
    dtype: str
    rows: int = 1


def _window_keys(first: int, count: int, window: int | None) -> int:
    """sum of min(v, window) for v = first .. first + count - 1: keys attended by `count` queries."""
    last = first + count - 1
    if window is None or last <= window:
        return (first + last) * count // 2
    if first > window:
        return count * window
    below = window - first + 1  # values first .. window
    return (first + window) * below // 2 + (count - below) * window


def linear(name: str, shape: ModelShape, tokens: int, in_features: int, out_features: int,
           bias: bool = False) -> Op:
    """x[tokens, in] @ W[out, in]^T: the weight read once, the input read and the output written once."""
    a, w = shape.activation_bytes, shape.weight_bytes
    nbytes = in_features * out_features * w + tokens * (in_features + out_features) * a
    if bias:
        nbytes += out_features * w
    return Op(name, 2.0 * tokens * in_features * out_features, nbytes, "matmul", shape.weight_dtype, tokens)


def attention(shape: ModelShape, seqs: list[Seq], q_heads: int, kv_heads: int, name: str = "attention",
              window: int | None | bool = True) -> Op:
    """Causal attention of the new tokens over each sequence's context (the batch's KV read once, the new
    K/V written once): QK^T and PV are 2 FLOPs per (query head, key, dim) each. `window`: the layer's
    (True: the model's `sliding_window`)."""
    d = shape.head_dim
    window = shape.sliding_window if window is True else window
    keys = sum(_window_keys(s.num_computed_tokens + 1, s.num_new_tokens, window) for s in seqs)
    # keys read: the whole context, or the last window + chunk - 1 positions under a sliding window
    read = sum(min(s.num_computed_tokens + s.num_new_tokens,
                   s.num_new_tokens - 1 + window if window else 1 << 62) for s in seqs)
    new = sum(s.num_new_tokens for s in seqs)
    kv = 2 * kv_heads * d * shape.kv_bytes * (read + new)
    qo = 2 * new * q_heads * d * shape.activation_bytes
    return Op(name, 4.0 * d * q_heads * keys, kv + qo, "attention", shape.activation_dtype)


def experts(shape: ModelShape, tokens: int, columns: int, ranks: int = 1) -> Op:
    """A sparse layer's routed experts on `tokens` tokens, `columns` of each expert's FFN on this rank: each
    token's k experts run gate/up and down (2 x 3 x h x columns FLOPs per token-expert pair), the weights of
    the experts reached read once (`ModelShape.expected_experts`), each pair's input and output moved once;
    the pairs of one expert are one matmul's rows."""
    h, k = shape.hidden_size, shape.experts_per_token
    reached, pairs = shape.expected_experts(tokens), tokens * k
    if ranks > 1:  # expert parallelism: the busiest rank's share of the pairs and of the experts reached
        share = busiest_rank_pairs(shape, tokens, ranks) / pairs if tokens else 0.0
        reached, pairs = min(reached * share, shape.num_experts / ranks), pairs * share
    nbytes = reached * 3 * h * columns * shape.weight_bytes + pairs * 2 * h * shape.activation_bytes
    rows = max(1, math.ceil(pairs / reached)) if reached else 1
    return Op("experts", 2.0 * pairs * 3 * h * columns, nbytes, "matmul", shape.weight_dtype, rows)


def busiest_rank_pairs(shape: ModelShape, tokens: int, ranks: int) -> float:
    """Token-expert pairs of the busiest of `ranks` ranks holding E / ranks experts each (expert parallelism),
    in expectation under balanced routing: a token's pairs on one rank are hypergeometric (k draws of E, E / ranks
    of them the rank's), a step's sum over its tokens about normal, and the largest of `ranks` such sums about
    mean + c_n x sd (c_n: the expected largest of n standard normals). For one token of top-2 of 8 experts on 2
    ranks: 1.37 against the exact 10/7; the busiest rank sets a step's time, as all wait for it."""
    e, k = shape.num_experts, shape.experts_per_token
    mean = tokens * k / ranks
    variance = tokens * k * (1 / ranks) * (1 - 1 / ranks) * ((e - k) / (e - 1) if e > 1 else 0.0)
    most = tokens * min(k, e // ranks)  # every token's pairs on one rank, at most E / ranks per token
    return min(most, mean + _expected_max_normal(ranks) * math.sqrt(variance))


@functools.lru_cache(maxsize=None)
def _expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] = integral of x n phi(x) Phi(x)^(n-1) dx (0.564 for 2, 1.029 for
    4, 1.424 for 8)."""
    step, total = 1e-3, 0.0
    for i in range(-8000, 8001):
        x = i * step
        total += x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * math.erfc(-x / math.sqrt(2))) ** (n - 1)
    return total * step


def layer_elementwise(shape: ModelShape, tokens: int, q_heads: int, kv_heads: int, mlp_columns: int) -> Op:
    """The memory-bound rest of a layer, each pass reading its inputs and writing its output once: two
    RMSNorms (2 x [T, h]), two residual adds (3 x [T, h]), RoPE on q and k (read, write, cos/sin), q/k
    norms for Qwen3, SiLU(gate) * up (3 x [T, I])."""
    h, d = shape.hidden_size, shape.head_dim
    qk = (q_heads + kv_heads) * d
    elements = tokens * (2 * 2 * h + 2 * 3 * h + 2 * qk + 2 * d + 3 * mlp_columns)
    if shape.qk_norm:
        elements += tokens * 2 * qk
    return Op("elementwise", 0.0, elements * shape.activation_bytes, "copy", shape.activation_dtype)


def embedding(shape: ModelShape, tokens: int) -> Op:
    """Rows gathered from the (replicated) embedding table."""
    h = shape.hidden_size
    return Op("embedding", 0.0, tokens * h * (shape.weight_bytes + shape.activation_bytes), "copy",
              shape.activation_dtype)


def final_norm(shape: ModelShape, tokens: int) -> Op:
    return Op("final_norm", 0.0, 2 * tokens * shape.hidden_size * shape.activation_bytes, "copy",
              shape.activation_dtype)


def lm_head(shape: ModelShape, rows: int, vocab_rows: int) -> Op:
    """The vocabulary shard `vocab_rows` x hidden applied to the sampled rows only."""
    return linear("lm_head", shape, rows, shape.hidden_size, vocab_rows)


def sampling(shape: ModelShape, rows: int) -> Op:
    """Rank 0 reads the gathered logits [rows, vocab] twice (softmax/argmax and the chosen token's logprob)."""
    return Op("sampling", 0.0, 2 * rows * shape.vocab_size * shape.activation_bytes, "copy", shape.activation_dtype)
