"""Frozen configuration dataclasses: model (from a Hugging Face config.json), cache, scheduler."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

# architectures entry -> family name; one decoder implementation serves all of them.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3_text",
    # vision-language models: their language model, text in and text out (the vision tower left out)
    "Gemma3ForConditionalGeneration": "gemma3_text",
    "Qwen2VLForConditionalGeneration": "qwen2",
    "Qwen2_5_VLForConditionalGeneration": "qwen2",
}
# a config.json without `architectures`: its model_type's causal LM (transformers' AutoModelForCausalLM mapping)
_CAUSAL_LM_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                            "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                            "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                            "gpt_oss": "GptOssForCausalLM", "phi3": "Phi3ForCausalLM",
                            "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration"}
# the vision-language architectures above -> whether their config class ties the LM head by default (transformers 5's
# composite configs, where the top level's tie_word_embeddings decides)
_VISION_LANGUAGE_TIED = {"Gemma3ForConditionalGeneration": True, "Qwen2VLForConditionalGeneration": False,
                         "Qwen2_5_VLForConditionalGeneration": False}
# transformers' defaults for the keys a config.json leaves out (its config classes), Llama's for every family and
# where a family's own differ
_HF_DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768, "head_dim": 128},
    "qwen2_moe": {"max_position_embeddings": 32768, "qkv_bias": True, "num_experts": 60, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"max_position_embeddings": 32768},
    "phi3": {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    # with the sizes: the hub's Gemma 3 4B-27B configs (transformers 4.50) write text_config as its difference from
    # Gemma3TextConfig, leaving some of them out
    "gemma3_text": {"max_position_embeddings": 131072, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
                    "head_dim": 256, "sliding_window": 4096, "query_pre_attn_scalar": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "vocab_size": 262208,
                    "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                    "num_key_value_heads": 4},
    "mixtral": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "gpt_oss": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "head_dim": 64,
                "sliding_window": 128, "attention_bias": True,
                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096}},
}
# ... and where an architecture's text config differs from its family's (Qwen2-VL's language model is a Qwen2; a
# text_config saved by transformers 4 holds only its difference from Qwen2VLTextConfig's, sizes included)
_ARCHITECTURE_DEFAULTS: dict[str, dict[str, Any]] = {
    arch: {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "vocab_size": 152064, "hidden_size": 8192,
           "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}
    for arch in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")}
# Families whose attention takes transformers' `attention_bias` (q, k, v and o projections; Qwen2's q, k and v always
# have a bias, Qwen2-MoE's where `qkv_bias`, Mistral's and Mixtral's never) and the families whose MLP is (in some or
# all layers) a sparse mixture of experts.
ATTENTION_BIAS_FAMILIES = ("llama", "qwen3", "qwen3_moe", "gpt_oss")
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device an engine runs on: the one given, else CUDA where there is a GPU, else the CPU."""
    try:
        resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: torch_shift runs on 'cpu' or 'cuda' (optionally 'cuda:N')")
    return resolved


def check_device_present(device: torch.device) -> None:
    """A CUDA device the engine is to run on exists (a device only named, as the planner's, need not)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: this torch ({torch.__version__}) sees no CUDA device"
                             + ("" if torch.backends.cuda.is_built() else " (a CPU-only build)"))
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: there are {torch.cuda.device_count()} CUDA devices")


def dtype_name(name: str) -> str:
    """A dtype's full name for any name `resolve_dtype` takes ('bf16', 'half', ...: 'bfloat16', 'float16'); other
    text as given (the command line's choices then list the names)."""
    dtype = _DTYPES.get(name)
    return name if dtype is None else str(dtype).removeprefix("torch.")


def resolve_dtype(dtype: str | torch.dtype | None, config_dtype: str | None = None) -> torch.dtype:
    """`"auto"`/None takes the checkpoint's dtype (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if dtype is None or dtype == "auto":
        return _DTYPES.get(str(config_dtype), torch.float32) if config_dtype else torch.float32
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of 'auto', 'float32', 'bfloat16', 'float16'")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default", "linear", "llama3", "yarn" or "longrope"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (GPT-OSS): the ramp's bounds in rotations, whether they are rounded to whole dimensions, and the
    # factor cos and sin are scaled by (None: from `factor`, or from mscale / mscale_all_dim where both are set)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # LongRoPE (Phi-3, arXiv 2402.13753): a factor per frequency for contexts up to the original length and one for
    # longer ones; `long`: the long factors for every position, where the engine's context (max_model_len) exceeds
    # the original length (vLLM's choice; transformers switches per forward, by its longest position)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    long: bool = False

    def for_context(self, max_model_len: int) -> RopeConfig:
        """As used for contexts of up to `max_model_len` tokens (LongRoPE's long or short factors)."""
        if self.rope_type != "longrope":
            return self
        return replace(self, long=max_model_len > self.original_max_position_embeddings)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], family: str | None = None) -> RopeConfig:
        """As transformers 5 reads a config.json (`convert_rope_params_to_dict`, `standardize_rope_params`):
        rope_parameters holds rope_theta and the scaling (transformers 5), or rope_theta sits at the top level
        beside an optional rope_scaling (transformers 4), which wins where both are written. `hf`: with its
        family's defaults for keys left out (rope_theta, max_position_embeddings)."""
        params = dict(hf.get("rope_parameters") or {})
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            params = dict(params["full_attention"])
        merged = dict(hf.get("rope_scaling") or params)
        theta = merged.get("rope_theta", hf["rope_theta"])
        rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
        if family == "phi3" and rope_type in ("su", "yarn"):
            rope_type = "longrope"  # Phi-3's older names for it (transformers' Phi3Config)
        if rope_type == "mrope":  # Qwen2-VL's M-RoPE: a text token's three position ids are one, the plain rotation
            rope_type = "default"
        if rope_type not in ("default", "linear", "llama3", "yarn", "longrope"):
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: default, linear, llama3, yarn, "
                             "longrope")
        partial = float(merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported (rotary over every dimension only)")
        # the length the scaled types were pretrained at: a top-level key first (Phi-3's), the model's own last
        original = int(hf.get("original_max_position_embeddings")
                       or merged.get("original_max_position_embeddings") or hf["max_position_embeddings"])
        if rope_type == "yarn" and merged.get("factor") is None:
            merged["factor"] = hf["max_position_embeddings"] / original

        def optional(key: str) -> float | None:
            return None if merged.get(key) is None else float(merged[key])

        longrope = {}
        if rope_type == "longrope":
            longrope = _longrope_fields(merged, hf, original)

        return cls(**{
            "theta": float(theta),
            "rope_type": rope_type,
            "factor": float(merged.get("factor", 1.0)),
            "low_freq_factor": float(merged.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(merged.get("high_freq_factor", 4.0)),
            "original_max_position_embeddings": original,
            "beta_fast": float(merged.get("beta_fast") or 32.0),
            "beta_slow": float(merged.get("beta_slow") or 1.0),
            "truncate": bool(merged.get("truncate", True)),
            "attention_factor": optional("attention_factor"),
            "mscale": optional("mscale"),
            "mscale_all_dim": optional("mscale_all_dim"),
            **longrope,
        })


def _longrope_fields(merged: dict[str, Any], hf: dict[str, Any], original: int) -> dict[str, Any]:
    """LongRoPE's factors, as transformers' _compute_longrope_parameters reads them: `factor` the model's length
    over the original one where not given, cos and sin scaled by sqrt(1 + log(factor) / log(original)) unless
    `attention_factor` is given; the long factors where the model's whole length exceeds the original one (the
    engine's own context then decides: RopeConfig.for_context)."""
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    fields: dict[str, Any] = {}
    for key in ("short_factor", "long_factor"):
        values = merged.get(key)
        if not isinstance(values, list) or len(values) != head_dim // 2:
            raise ValueError(f"longrope: {key} must be a list of head_dim / 2 = {head_dim // 2} numbers, got "
                             f"{values!r}")
        fields[key] = tuple(float(v) for v in values)
    factor = merged.get("factor")
    factor = float(factor) if factor is not None else int(hf["max_position_embeddings"]) / original
    attention_factor = merged.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return fields | {"factor": factor, "attention_factor": float(attention_factor),
                     "long": int(hf["max_position_embeddings"]) > original}


def context_scale(rope: RopeConfig, family: str) -> float:
    """What config.json's max_position_embeddings is multiplied by for the model's longest context, as vLLM 0.32
    derives it (`_get_and_verify_max_len`): a linear scaling's factor, but Gemma 3's length (131,072 with a factor
    of 8) is already scaled; YaRN's, LongRoPE's and llama3's configs write their whole length (transformers'
    _compute_yarn_parameters assumes so too)."""
    return rope.factor if rope.rope_type == "linear" and family != "gemma3_text" else 1.0


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder needs from a Hugging Face config.json, normalised across families."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int  # the longest context: config.json's, scaled where its rotation is (context_scale)
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v bias (Qwen2)
    qk_norm: bool  # RMSNorm on q and k per head (Qwen3)
    sliding_window: int | None
    hidden_act: str = "silu"
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    # Mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral, GPT-OSS); a dense model has no experts and no sparse layers.
    num_experts: int = 0  # routed experts of each sparse layer
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # the top-k routing weights are renormalised to sum to 1
    float32_routing_weights: bool = False  # they scale the experts' outputs in float32, not the model dtype
    sparse_layers: tuple[int, ...] = ()  # layers whose MLP is the mixture of experts (the others are dense)
    # Qwen2-MoE: beside the routed experts, a shared expert that every token runs (a gated SiLU MLP this wide),
    # its output scaled by sigmoid(shared_expert_gate(x)); 0: none
    shared_expert_intermediate_size: int = 0
    # GPT-OSS: the router's top-k of its logits, then a softmax over them ("topk_softmax"; the others:
    # "softmax_topk"), biases on the router and the experts, each expert's SwiGLU clamped at swiglu_limit
    moe_routing: str = "softmax_topk"
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    # GPT-OSS's attention: an o_proj bias, a sink logit per head, and windows that differ per layer
    o_proj_bias: bool = False
    attention_sinks: bool = False
    layer_windows: tuple[int | None, ...] = ()  # per layer, where layers differ; empty: `sliding_window` for all
    # Gemma 3: RMSNorm scaling by (1 + weight) in float32, norms after attention and after the MLP too (beside the
    # ones before), the embedding times sqrt(hidden_size) in the model dtype, and the windowed layers' rotary tables
    # of their own (`local_rope`)
    gemma_norms: bool = False
    embed_scale: float | None = None
    local_rope: RopeConfig | None = None
    # attention scores scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5 (Gemma 3 27B): queries are
    # multiplied by this, sqrt(head_dim / query_pre_attn_scalar), before the attention backend's own scale
    query_scale: float | None = None
    # how the checkpoint stores its quantized weights, each dequantized as it is read (torch_shift.models.quantized,
    # torch_shift.models.mxfp4); None: every weight as it is computed with
    quantization: WeightQuantization | None = None

    def layer_window(self, layer_idx: int) -> int | None:
        """Layer `layer_idx`'s own window, or None where every layer has the step's (`sliding_window`)."""
        return self.layer_windows[layer_idx] if self.layer_windows else None

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        architectures = hf.get("architectures") or []
        if not architectures and hf.get("model_type") in _CAUSAL_LM_OF_MODEL_TYPE:  # transformers' auto class's way
            architectures = [_CAUSAL_LM_OF_MODEL_TYPE[hf["model_type"]]]
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not architectures:
            raise ValueError(f"config.json names no architectures, and its model_type {hf.get('model_type')!r} is "
                             f"none of {', '.join(sorted(_CAUSAL_LM_OF_MODEL_TYPE))}")
        if arch is None:
            raise ValueError(
                f"unsupported architectures {architectures!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        if arch in _VISION_LANGUAGE_TIED and hf.get("text_config") is not None:  # else flat (Qwen2-VL's hub configs)
            hf = _language_model_config(hf, _VISION_LANGUAGE_TIED[arch])
        hf = {**_HF_DEFAULTS, **_FAMILY_DEFAULTS.get(family, {}), **_ARCHITECTURE_DEFAULTS.get(arch, {}), **hf}
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            layers = int(hf["num_hidden_layers"])
            vocab = int(hf["vocab_size"])
            inter = int(hf["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"config.json lacks {e.args[0]!r}") from None
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        act = hf.get("hidden_activation" if family == "gemma3_text" else "hidden_act", "silu")
        if act == "swish" or (family == "gemma3_text" and act in ("gelu_pytorch_tanh", "gelu_new")):
            act = "silu" if act == "swish" else "gelu_pytorch_tanh"  # the same functions under other names
        elif act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; supported: silu (gelu_pytorch_tanh for Gemma 3)")
        if hf.get("mlp_bias"):
            raise ValueError(f"{arch} with mlp_bias=true is not supported")
        sliding_window = hf.get("sliding_window")
        if family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
            if hf.get("use_sliding_window"):
                raise ValueError(f"{arch} with use_sliding_window=true is not supported")
            sliding_window = None
        quantization = _quantization(hf, arch, family)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        extra = _moe_fields(hf, arch, family, layers, inter) if family in MOE_FAMILIES else {}  # a family's own
        if family == "gpt_oss":
            extra |= _gpt_oss_fields(hf, layers, sliding_window)
            sliding_window = None  # per layer (layer_windows)
        if family == "gemma3_text":
            extra |= _gemma3_fields(hf, layers, sliding_window, hidden, head_dim)
            sliding_window = None  # per layer (layer_windows)
        rope = RopeConfig.from_hf(hf, family)
        return cls(
            architecture=arch,
            family=family,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=round(int(hf["max_position_embeddings"]) * context_scale(rope, family)),
            rms_norm_eps=float(hf["rms_norm_eps"]),
            rope=rope,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=(family == "qwen2" or family == "qwen2_moe" and bool(hf["qkv_bias"])
                            or family in ATTENTION_BIAS_FAMILIES and bool(hf.get("attention_bias"))),
            o_proj_bias=family in ATTENTION_BIAS_FAMILIES and bool(hf.get("attention_bias")),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
            sliding_window=int(sliding_window) if sliding_window else None,
            hidden_act=act,
            torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_ids,
            quantization=quantization,
            **extra,
        )

    def for_context(self, max_model_len: int) -> ModelConfig:
        """This model as run with contexts of up to `max_model_len` tokens (LongRoPE's factors depend on it)."""
        rope = self.rope.for_context(max_model_len)
        return self if rope == self.rope else replace(self, rope=rope)

    @property
    def is_moe(self) -> bool:
        return bool(self.sparse_layers)

    @property
    def num_parameters(self) -> int:
        """Parameters of the model (an untied LM head counted apart from the embedding; every expert)."""
        return self._count_parameters(self.num_experts)

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token is computed with: as `num_parameters`, with only its top-k experts of each
        sparse layer (the router counted whole). Equal to `num_parameters` for a dense model."""
        return self._count_parameters(self.num_experts_per_tok)

    def _count_parameters(self, experts: int) -> int:
        h, d = self.hidden_size, self.head_dim
        attention = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * d + self.num_attention_heads * d * h
        if self.attention_bias:
            attention += (self.num_attention_heads + 2 * self.num_key_value_heads) * d
        if self.qk_norm:
            attention += 2 * d
        if self.o_proj_bias:
            attention += h
        if self.attention_sinks:
            attention += self.num_attention_heads
        num_sparse = len(self.sparse_layers)
        dense_mlps = (self.num_hidden_layers - num_sparse) * 3 * h * self.intermediate_size
        router = h * self.num_experts + (self.num_experts if self.router_bias else 0)
        expert = 3 * h * self.moe_intermediate_size + (2 * self.moe_intermediate_size + h if self.expert_bias else 0)
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        sparse_mlps = num_sparse * (router + experts * expert + shared)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        norms = (4 if self.gemma_norms else 2) * h
        return self.num_hidden_layers * (attention + norms) + dense_mlps + sparse_mlps + embeddings + h

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """From a model directory (weights optional) or its config.json file."""
        path = Path(model_dir)
        if path.is_dir():
            path = path / "config.json"
            if not path.is_file():
                raise ValueError(f"{model_dir} has no config.json")
        elif not path.is_file():
            raise ValueError(f"{model_dir}: no such model directory or config.json file")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(hf)


def _moe_fields(hf: dict[str, Any], arch: str, family: str, num_layers: int, intermediate_size: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen2-MoE, Qwen3-MoE, Mixtral or GPT-OSS config.json, as transformers reads
    them."""
    num_experts = hf.get("num_local_experts", hf.get("num_experts"))  # transformers 5 writes the first
    if num_experts is None:
        raise ValueError(f"{arch}: config.json lacks 'num_local_experts' (or 'num_experts')")
    if "num_experts_per_tok" not in hf:
        raise ValueError(f"{arch}: config.json lacks 'num_experts_per_tok'")
    num_experts, top_k = int(num_experts), int(hf["num_experts_per_tok"])
    if num_experts == 0 and family in ("qwen2_moe", "qwen3_moe"):  # as transformers builds it: every layer dense
        return {}
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"{arch}: num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
    if family == "mixtral":  # every layer sparse, experts as wide as intermediate_size, weights renormalised
        return {"num_experts": num_experts, "num_experts_per_tok": top_k, "moe_intermediate_size": intermediate_size,
                "norm_topk_prob": True, "float32_routing_weights": True, "sparse_layers": tuple(range(num_layers))}
    if family == "gpt_oss":  # every layer sparse, experts as wide as intermediate_size, weights in the model dtype
        return {"num_experts": num_experts, "num_experts_per_tok": top_k, "moe_intermediate_size": intermediate_size,
                "sparse_layers": tuple(range(num_layers))}
    dense_layers = set(hf.get("mlp_only_layers") or ())
    step = int(hf.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"{arch}: decoder_sparse_step must be >= 1, got {step}")
    if "moe_intermediate_size" not in hf:
        raise ValueError(f"{arch}: config.json lacks 'moe_intermediate_size'")
    sparse_layers = tuple(i for i in range(num_layers) if i not in dense_layers and (i + 1) % step == 0)
    shared = {}
    if family == "qwen2_moe" and sparse_layers:  # a shared expert in each sparse layer
        shared_width = int(hf["shared_expert_intermediate_size"])
        if shared_width < 1:
            raise ValueError(f"{arch}: shared_expert_intermediate_size must be >= 1, got {shared_width}")
        shared = {"shared_expert_intermediate_size": shared_width}
    return shared | {"num_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(hf["moe_intermediate_size"]),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "float32_routing_weights": False,
            "sparse_layers": sparse_layers}


@dataclass(frozen=True)
class WeightQuantization:
    """A checkpoint's `quantization_config`, as far as reading its weights needs it. Every method is weight-only
    here: the weights are dequantized as they load and the activations stay in the engine's dtype."""

    method: str  # "gptq", "awq", "fp8", "compressed-tensors" or "mxfp4"
    bits: int = 0
    # integer formats: input columns per scale and zero point; 0: one per output row (a channel)
    group_size: int = 0
    # GPTQ's original format stores each zero point minus one (AutoGPTQ; "gptq_v2" does not)
    zero_offset: int = 0
    # FP8 and compressed-tensors' "block" strategy: (rows, columns) of the weight under one scale
    block: tuple[int, int] | None = None
    # compressed-tensors: how the weights are stored ("pack-quantized", "int-quantized", "naive-quantized",
    # "float-quantized") and what one scale covers ("tensor", "channel", "group", "block")
    format: str = ""
    strategy: str = ""


def _quantization(hf: dict[str, Any], arch: str, family: str) -> WeightQuantization | None:
    """The checkpoint's quantized format, where torch_shift reads it; any other `quantization_config` is refused,
    before a tensor is read."""
    quant = hf.get("quantization_config")
    if not quant:
        if hf.get("compression_config"):
            raise ValueError(f"{arch}: config.json's 'compression_config' (compressed-tensors' name before "
                             "'quantization_config') is not read; rename it to 'quantization_config'")
        return None
    if not isinstance(quant, dict):
        raise ValueError(f"{arch}: config.json's 'quantization_config' is not an object")
    method = quant.get("quant_method", "?")
    where = f"{arch}: {method} checkpoint"
    if method == "mxfp4":
        if family != "gpt_oss":
            raise ValueError(f"{where}s are read for GPT-OSS's experts only")
        return WeightQuantization("mxfp4")
    if method == "gptq":
        checkpoint_format = "marlin" if quant.get("is_marlin_format") else quant.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"{where}: checkpoint_format {checkpoint_format!r} is not supported; supported: gptq, "
                             "gptq_v2")
        if quant.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            raise ValueError(f"{where}: pack_dtype {quant['pack_dtype']!r} is not supported; supported: int32")
        if quant.get("dynamic"):
            raise ValueError(f"{where}: per-module overrides (dynamic) are not supported")
        return WeightQuantization("gptq", bits=_packed_bits(quant, where), group_size=_group_size(quant, where),
                                  zero_offset=1 if checkpoint_format == "gptq" else 0)
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}: version {version!r} is not supported; supported: gemm (AutoAWQ's default)")
        if _packed_bits(quant, where, key="w_bit" if "w_bit" in quant else "bits") != 4:
            raise ValueError(f"{where}: AWQ's GEMM layout packs 4-bit weights only")
        if not quant.get("zero_point", True):
            raise ValueError(f"{where}: zero_point false is not supported")
        return WeightQuantization("awq", bits=4, group_size=_group_size(quant, where, key="q_group_size"
                                                                         if "q_group_size" in quant else "group_size"))
    if method == "fp8":
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"{where}: activation_scheme {quant['activation_scheme']!r} is not supported; "
                             "supported: dynamic")
        if quant.get("expert_dtype", "fp8") != "fp8":
            raise ValueError(f"{where}: expert_dtype {quant['expert_dtype']!r} is not supported; supported: fp8")
        block = quant.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{where}: weight_block_size {block!r} is not two positive integers")
        return WeightQuantization("fp8", bits=8, block=tuple(block) if block else None)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, where)
    raise ValueError(f"{arch}: {method} checkpoints are not supported (torch_shift reads GPTQ, AWQ, FP8, "
                     "compressed-tensors and GPT-OSS's MXFP4 experts); use a checkpoint in bf16 or fp32, e.g. one "
                     "dequantized with transformers' from_pretrained(...) and save_pretrained")


def _packed_bits(quant: dict[str, Any], where: str, key: str = "bits") -> int:
    bits = quant.get(key)
    if bits not in (2, 4, 8):
        raise ValueError(f"{where}: {key}={bits!r} is not supported; supported: 2, 4, 8")
    return bits


def _group_size(quant: dict[str, Any], where: str, key: str = "group_size") -> int:
    group_size = quant.get(key, 128)
    if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
        raise ValueError(f"{where}: {key}={group_size!r} is not a positive integer or -1")
    return max(group_size, 0)


_COMPRESSED_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


def _compressed_tensors(quant: dict[str, Any], where: str) -> WeightQuantization:
    """compressed-tensors' config (llm-compressor's checkpoints): one scheme for every quantized linear layer,
    compressed, its weights' quantization read and its activations' left to the engine's dtype."""
    sparsity = quant.get("sparsity_config") or {}
    if sparsity and sparsity.get("format") != "dense" and sparsity.get("targets"):  # a dense one: llm-compressor 2024
        raise ValueError(f"{where}: sparsity_config is not supported")
    for key in ("transform_config", "kv_cache_scheme", "moe_sparsity_config"):
        if quant.get(key):
            raise ValueError(f"{where}: {key} is not supported")
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{where}: quantization_status {status!r} is not supported; supported: compressed")
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{where}: {len(groups)} config_groups; supported: one scheme for every quantized layer")
    (name, scheme), = groups.items()
    fmt = scheme.get("format") or quant.get("format")
    if fmt not in _COMPRESSED_FORMATS:
        raise ValueError(f"{where}: format {fmt!r} is not supported; supported: {', '.join(_COMPRESSED_FORMATS)}")
    weights = scheme.get("weights") or {}
    if weights.get("dynamic"):
        raise ValueError(f"{where}: {name}'s weights are quantized dynamically, which no checkpoint stores")
    activations = scheme.get("input_activations")
    if activations and not activations.get("dynamic"):
        raise ValueError(f"{where}: {name}'s activations are quantized with static scales, which is not supported "
                         "(dynamic ones are left in the engine's dtype)")
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if (kind, bits) not in (("int", 2), ("int", 4), ("int", 8), ("float", 8)):
        raise ValueError(f"{where}: {name}'s {bits}-bit {kind} weights are not supported; supported: int 2, 4, 8 "
                         "and float 8")
    if fmt == "float-quantized" and kind != "float" or fmt in ("pack-quantized", "int-quantized") and kind != "int":
        raise ValueError(f"{where}: {kind} weights in format {fmt!r}")
    strategy = weights.get("strategy", "tensor")
    group_size, block = 0, None
    if strategy == "group":
        group_size = weights.get("group_size")
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"{where}: {name}'s group strategy with group_size {group_size!r}")
    elif strategy == "block":
        block = weights.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{where}: {name}'s block strategy with block_structure {block!r}")
        block = tuple(block)
    elif strategy not in ("tensor", "channel"):
        raise ValueError(f"{where}: {name}'s strategy {strategy!r} is not supported; supported: tensor, channel, "
                         "group, block")
    return WeightQuantization("compressed-tensors", bits=bits, group_size=group_size, block=block, format=fmt,
                              strategy=strategy)


def _language_model_config(hf: dict[str, Any], tied_by_default: bool) -> dict[str, Any]:
    """A vision-language config.json's language model (its `text_config`), with the keys transformers reads from
    the top level where the text config leaves them out, and the top level's `tie_word_embeddings`, which decides
    (transformers 5's composite configs; where it is left out, the class's default, or a text config that ties, as
    Qwen2-VL's configs read configs saved before transformers 5)."""
    text = hf["text_config"]
    if not isinstance(text, dict):
        raise ValueError(f"{hf['architectures']}: config.json's 'text_config' is not an object")
    inherited = {k: hf[k] for k in ("dtype", "torch_dtype", "bos_token_id", "eos_token_id", "quantization_config")
                 if k in hf and k not in text}
    tied = hf.get("tie_word_embeddings", tied_by_default) or (not tied_by_default and text.get("tie_word_embeddings"))
    return {**text, **inherited, "tie_word_embeddings": bool(tied), "architectures": hf["architectures"]}


def _gemma3_fields(hf: dict[str, Any], num_layers: int, sliding_window: int | None, hidden: int,
                   head_dim: int) -> dict[str, Any]:
    """Gemma 3's fields, as transformers' Gemma3TextConfig reads them; what its model computes and torch_shift's
    does not is refused."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError(f"Gemma3ForCausalLM: {key}={hf[key]} is not supported")
    for key in ("use_bidirectional_attention", "attention_bias"):
        if hf.get(key):
            raise ValueError(f"Gemma3ForCausalLM: {key}=true is not supported")
    query_pre_attn_scalar = float(hf["query_pre_attn_scalar"])
    if not query_pre_attn_scalar > 0:
        raise ValueError(f"Gemma3ForCausalLM: query_pre_attn_scalar must be > 0, got {query_pre_attn_scalar}")
    pattern = int(hf.get("sliding_window_pattern", 6))
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"Gemma3ForCausalLM: layer_types must be {num_layers} of 'sliding_attention' or "
                         f"'full_attention', got {layer_types!r}")
    if "sliding_attention" in layer_types and not sliding_window:
        raise ValueError("Gemma3ForCausalLM: sliding_attention layers without a sliding_window")
    local = dict((hf.get("rope_parameters") or {}).get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma3ForCausalLM: rope type {local['rope_type']!r} of the sliding layers is not supported")
    theta = float(local.get("rope_theta", hf["rope_local_base_freq"]))
    query_scale = None if query_pre_attn_scalar == head_dim else math.sqrt(head_dim / query_pre_attn_scalar)
    return {"gemma_norms": True, "embed_scale": hidden ** 0.5, "local_rope": RopeConfig(theta=theta),
            "query_scale": query_scale,
            "layer_windows": tuple(int(sliding_window) if t == "sliding_attention" else None for t in layer_types)}


def _gpt_oss_fields(hf: dict[str, Any], num_layers: int, sliding_window: int | None) -> dict[str, Any]:
    """GPT-OSS's fields beyond the experts' counts, as transformers' GptOssConfig reads them."""
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"GptOssForCausalLM: layer_types must be {num_layers} of 'sliding_attention' or "
                         f"'full_attention', got {layer_types!r}")
    if "sliding_attention" in layer_types and not sliding_window:
        raise ValueError("GptOssForCausalLM: sliding_attention layers without a sliding_window")
    return {"moe_routing": "topk_softmax", "router_bias": True, "expert_bias": True,
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)), "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
            "attention_sinks": True,
            "layer_windows": tuple(int(sliding_window) if t == "sliding_attention" else None for t in layer_types)}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size; otherwise sized from memory
    kv_cache_memory_bytes: int | None = None  # explicit budget in bytes
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the engine may use in all
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256
    max_model_len: int = 2048
    policy: str = "fcfs"  # "fcfs" or "priority"
    # the next step is scheduled and launched before this one's tokens reach the host (torch_shift.engine.core);
    # None: where the runner launches the C++ decoder's steps on the CPU (decided once the engine has its runner)
    async_scheduling: bool | None = False
    max_logprobs: int = 20  # the most logprobs a request may ask for a token (vLLM's; -1: the whole vocabulary)
    # decode steps one plan runs where every running request decodes greedily (vLLM v0's multi-step scheduling;
    # torch_shift.engine.scheduler)
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an int >= -1 (-1: the whole vocabulary), got {self.max_logprobs!r}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 1:
            raise ValueError(
                "max_num_batched_tokens, max_num_seqs and max_model_len must be >= 1, got "
                f"{self.max_num_batched_tokens}, {self.max_num_seqs}, {self.max_model_len}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
