"""Small Hugging Face style model directories built locally (no hub access): a byte-level BPE
tokenizer trained in milliseconds and random Llama-family checkpoints. Tests and benchmarks use them as
fixtures."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import tokenizers
import tokenizers.decoders
import tokenizers.models
import tokenizers.pre_tokenizers
import tokenizers.processors
import tokenizers.trainers
import torch

# ChatML turns that start with bos, like Llama 3 / Qwen templates; exercises tools, tojson and raise_exception.
CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "<|im_start|>system\nYou may call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# In the style of Qwen2.5's template: tools listed in the system turn, calls written as <tool_call> JSON (vLLM's
# "hermes" format), earlier calls rendered back from their arguments (objects), tool results as <tool_response>
# in a user turn. A test checkpoint with it serves tool calling end to end.
TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
    "{% if tools %}"
    "<|im_start|>system\n{{ system if system is not none else 'You are a helpful assistant.' }}\n\n# Tools\n\n"
    "You may call one or more functions. Their signatures, within <tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "Write each call as a JSON object within <tool_call></tool_call>:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif system is not none %}<|im_start|>system\n{{ system }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "<|im_start|>assistant{% if message['content'] %}{{ '\\n' }}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{{ '\\n' }}<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message['role'] in ['system', 'user', 'assistant'] %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% else %}{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TOKENIZER_SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]

_CORPUS_WORDS = (
    "the a an of to and in is it that for on with as was at by be this from or have not are but "
    "model token cache engine request batch prompt layer attention tensor memory decode prefill "
    "quick brown fox jumps over lazy dog river mountain city music light window garden morning "
    "run runs running ran write writes writing wrote read reads reading small large fast slow "
    "café naïve résumé déjà über straße façade jalapeño crème brûlée"
).split()
_CORPUS_CJK_AND_EMOJI = ["你好", "世界", "语言模型", "東京", "こんにちは", "한국어", "😀", "🚀", "👍🏽", "∑", "→"]
_CORPUS_CODE_LINES = [
    "def forward(self, x: torch.Tensor) -> torch.Tensor:",
    "    return self.proj(torch.nn.functional.silu(x))",
    "for i in range(10):",
    "    print(f\"step {i}: loss={loss:.3f}\")",
    "if __name__ == \"__main__\":",
    "import numpy as np",
    "    cache = {k: v for k, v in items.items() if v is not None}",
    "class Tokenizer:",
]


def _tokenizer_training_corpus(num_lines: int = 400) -> list[str]:
    rng = random.Random(1234)
    lines = []
    for i in range(num_lines):
        if i % 8 == 0:
            lines.append(_CORPUS_CODE_LINES[(i // 8) % len(_CORPUS_CODE_LINES)])
            continue
        words = [rng.choice(_CORPUS_WORDS) for _ in range(rng.randint(5, 15))]
        if i % 3 == 0:
            words.insert(rng.randrange(len(words)), rng.choice(_CORPUS_CJK_AND_EMOJI))
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "!", "?", ",", ": 42", " (1.5)"]))
    return lines


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512, chat_template: bool | str = True) -> Path:
    """Train a tiny deterministic byte-level BPE tokenizer and write it as a Hugging Face tokenizer directory.

    Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir and returns it as a Path.
    Takes about 20 ms for vocab_size=512.

    Ids 0-5 are the special tokens <s> (bos), </s> (eos), <unk>, <pad>, <|im_start|>, <|im_end|>; then come the 256
    byte-level symbols, then the BPE merges. The corpus yields about 740 tokens, so larger vocabularies are padded
    with dummy vocabulary entries "<extra_N>" (N is the id): len(tokenizer) == vocab_size exactly, to pair the
    tokenizer with a random checkpoint whose embedding has vocab_size rows. No merge produces the dummies, so
    encoding never does, but they decode to their visible text, so a random model that samples them streams readable
    output. They are not added tokens, which would make loading and streaming slow for large vocabularies.

    The post-processor prepends <s> and tokenizer_config.json says add_bos_token=true, so both agree. With
    chat_template=True, tokenizer_config.json carries a ChatML-style template that starts with bos_token; its turns
    end with <|im_end|>, which is an eos only where a generation_config.json lists it. A string is the template to
    carry instead (e.g. TOOLS_CHAT_TEMPLATE).
    """
    minimum = len(_TOKENIZER_SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (special tokens + 256 byte symbols), got {vocab_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_TOKENIZER_SPECIAL_TOKENS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tokenizer_training_corpus(), trainer=trainer)
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    tokenizer_json = json.loads(tokenizer.to_str())
    vocab = tokenizer_json["model"]["vocab"]
    for token_id in range(len(vocab), vocab_size):
        vocab[f"<extra_{token_id}>"] = token_id
    if tokenizers.Tokenizer.from_str(json.dumps(tokenizer_json)).get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError(f"built a tokenizer whose vocabulary is not {vocab_size} tokens")
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))

    special_tokens = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template:
        tokenizer_config["chat_template"] = chat_template if isinstance(chat_template, str) else CHATML_TEMPLATE
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_tokens, indent=2))
    return out_dir


def tiny_llama_config(**overrides: Any) -> dict[str, Any]:
    """A Hugging Face config.json (transformers 5 layout) for a small Llama."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "dtype": "float32",
    }
    config.update(overrides)
    return config


def write_random_checkpoint(
    out_dir: str | Path, config: dict[str, Any], seed: int = 0, init_std: float = 0.02,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write `config.json` and a `model.safetensors` of random weights (stored in `dtype`) under Hugging Face
    names (a mixture of experts' as its family writes them: Mixtral's `block_sparse_moe.experts.N.w1/w3/w2`,
    Qwen2-MoE's and Qwen3-MoE's `mlp.experts.N.gate_proj/up_proj/down_proj`, Qwen2-MoE's `mlp.shared_expert.*` and
    `mlp.shared_expert_gate`)."""
    from safetensors.torch import save_file

    from torch_shift.config import ModelConfig

    mc = ModelConfig.from_hf_dict(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    d, hd = mc.hidden_size, mc.head_dim

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * init_std).to(dtype)

    tensors = {"model.embed_tokens.weight": normal(mc.vocab_size, d), "model.norm.weight": torch.ones(d, dtype=dtype)}
    if not mc.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(mc.vocab_size, d)
    for i in range(mc.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(d, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(d, dtype=dtype),
            p + "self_attn.q_proj.weight": normal(mc.num_attention_heads * hd, d),
            p + "self_attn.k_proj.weight": normal(mc.num_key_value_heads * hd, d),
            p + "self_attn.v_proj.weight": normal(mc.num_key_value_heads * hd, d),
            p + "self_attn.o_proj.weight": normal(d, mc.num_attention_heads * hd),
        }
        if i in mc.sparse_layers:  # the router and every expert, under the family's names
            inter = mc.moe_intermediate_size
            mixtral = mc.family == "mixtral"
            moe = p + ("block_sparse_moe." if mixtral else "mlp.")
            tensors[moe + "gate.weight"] = normal(mc.num_experts, d)
            names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            for e in range(mc.num_experts):
                gate, up, down = (f"{moe}experts.{e}.{name}.weight" for name in names)
                tensors |= {gate: normal(inter, d), up: normal(inter, d), down: normal(d, inter)}
            if mc.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert and its gate
                shared = mc.shared_expert_intermediate_size
                tensors |= {moe + "shared_expert.gate_proj.weight": normal(shared, d),
                            moe + "shared_expert.up_proj.weight": normal(shared, d),
                            moe + "shared_expert.down_proj.weight": normal(d, shared),
                            moe + "shared_expert_gate.weight": normal(1, d)}
        else:
            tensors |= {
                p + "mlp.gate_proj.weight": normal(mc.intermediate_size, d),
                p + "mlp.up_proj.weight": normal(mc.intermediate_size, d),
                p + "mlp.down_proj.weight": normal(d, mc.intermediate_size),
            }
        if mc.attention_bias:
            tensors |= {p + f"self_attn.{x}_proj.bias": normal(r) for x, r in
                        (("q", mc.num_attention_heads * hd), ("k", mc.num_key_value_heads * hd),
                         ("v", mc.num_key_value_heads * hd))}
        if mc.o_proj_bias:
            tensors[p + "self_attn.o_proj.bias"] = normal(d)
        if mc.qk_norm:
            tensors |= {p + "self_attn.q_norm.weight": torch.ones(hd, dtype=dtype),
                        p + "self_attn.k_norm.weight": torch.ones(hd, dtype=dtype)}
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


# -- quantized copies of a checkpoint (GPTQ, AWQ, FP8), as their tools write them ------------------------------
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column AutoAWQ packs into a word's nibble 0, 1, ...


def pack_words(codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Codes in [0, 2 ** bits) -> int32 words of 32 / bits codes along `dim`, code k of a word at bits k * bits
    (the k-th of `order` within each run), the last word filled with zeros."""
    per_word = 32 // bits
    codes = codes.to(torch.int64).movedim(dim, -1)
    codes = torch.nn.functional.pad(codes, (0, -codes.shape[-1] % per_word))
    runs = codes.reshape(*codes.shape[:-1], -1, per_word)
    if order is not None:
        runs = runs[..., list(order)]
    words = (runs << (torch.arange(per_word) * bits)).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # the same 32 bits as a signed int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def integer_codes(weight: torch.Tensor, bits: int, group: torch.Tensor, symmetric: bool = False
                  ) -> tuple[torch.Tensor, ...]:
    """Min-max codes of `weight` [out, in] in groups of input columns (`group`: each column's) -> codes [in, out],
    zero points [groups, out] (int32, in [1, 2 ** bits - 1]: GPTQ's original format stores them minus one;
    `symmetric`: 2 ** (bits - 1), the range symmetric about zero), scales [groups, out] (float16) and the weight
    they stand for [out, in], scales[g] * (code - zero[g]) in float16."""
    weight = weight.float()
    maxq, groups = 2 ** bits - 1, int(group.max()) + 1
    low = torch.stack([weight[:, group == g].amin(1) for g in range(groups)]).clamp(max=0)
    high = torch.stack([weight[:, group == g].amax(1) for g in range(groups)]).clamp(min=0)
    if symmetric:
        high = torch.maximum(high, -low)
        low = -high
    scales = ((high - low) / maxq).clamp(min=1e-6).half()
    zeros = torch.round(-low / scales.float()).clamp(1, maxq).to(torch.int32)
    if symmetric:
        zeros = torch.full_like(zeros, 2 ** (bits - 1))
    codes = torch.round(weight.t() / scales[group].float() + zeros[group]).clamp(0, maxq).to(torch.int32)
    return codes, zeros, scales, (scales[group] * (codes - zeros[group])).t()


def gptq_tensors(weight: torch.Tensor, bits: int = 4, group_size: int = 128, act_order: bool = False,
                 zero_offset: int = 1, seed: int = 0, symmetric: bool = False
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A weight [out, in] as GPTQ stores it ({"qweight", "qzeros", "scales", "g_idx"}) and the weight those stand
    for; `act_order`: groups of scattered columns (act-order's g_idx); `zero_offset` 1: zero points stored minus
    one (checkpoint_format "gptq"), 0 ("gptq_v2")."""
    columns = weight.shape[1]
    group = torch.arange(columns) // (group_size if group_size > 0 else columns)
    if act_order:
        group = group[torch.randperm(columns, generator=torch.Generator().manual_seed(seed))]
    codes, zeros, scales, dense = integer_codes(weight, bits, group, symmetric)
    return {"qweight": pack_words(codes, bits, 0), "qzeros": pack_words(zeros - zero_offset, bits, 1),
            "scales": scales, "g_idx": group.to(torch.int32)}, dense


def awq_tensors(weight: torch.Tensor, group_size: int = 128) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A weight [out, in] as AutoAWQ's GEMM layout stores it in 4 bits ({"qweight", "qzeros", "scales"}) and the
    weight those stand for."""
    codes, zeros, scales, dense = integer_codes(weight, 4, torch.arange(weight.shape[1]) // group_size)
    return {"qweight": pack_words(codes, 4, 1, AWQ_ORDER), "qzeros": pack_words(zeros, 4, 1, AWQ_ORDER),
            "scales": scales}, dense


def fp8_tensors(weight: torch.Tensor, block: tuple[int, int] = (128, 128)
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A weight [out, in] in float8_e4m3fn with a float32 scale per block [rows, columns] (the last ones cut at the
    edges), as transformers' FP8 stores it ({"weight", "weight_scale_inv"}: the factor that dequantizes), and the
    weight those stand for."""
    weight = weight.float()
    rows, cols = block
    blocks = torch.nn.functional.pad(weight.abs(), (0, -weight.shape[1] % cols, 0, -weight.shape[0] % rows))
    scales = blocks.unflatten(0, (-1, rows)).unflatten(2, (-1, cols)).amax((1, 3)).clamp(min=1e-12) / 448.0
    per_element = scales.repeat_interleave(rows, 0)[:weight.shape[0]].repeat_interleave(cols, 1)[:, :weight.shape[1]]
    values = (weight / per_element).to(torch.float8_e4m3fn)
    return {"weight": values, "weight_scale_inv": scales}, values.float() * per_element


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, method: str, bits: int = 4,
                        group_size: int = 128, act_order: bool = False, checkpoint_format: str = "gptq",
                        symmetric: bool = False, block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """Write a copy of the checkpoint in `model_dir` (its safetensors files and every other file) to `out_dir` with
    its linear layers' weights (QUANTIZED_LINEARS; embeddings, heads and routers as they are) quantized by
    `method` ("gptq", "awq" or "fp8"; `symmetric`: GPTQ's sym) and the matching `quantization_config` in
    config.json -> each quantized weight's name -> the weight it stands for."""
    from safetensors.torch import load_file, save_file

    if method not in ("gptq", "awq", "fp8"):
        raise ValueError(f"method {method!r}: one of gptq, awq, fp8")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stands_for, written = {}, {}  # each quantized weight's name -> the weight it stands for, its tensors' names
    for path in sorted(model_dir.iterdir()):
        if path.suffix != ".safetensors":
            if path.is_file():
                (out_dir / path.name).write_bytes(path.read_bytes())
            continue
        tensors = {}
        for name, weight in load_file(path).items():
            stem = name.removesuffix(".weight")
            if stem == name or stem.split(".")[-1] not in QUANTIZED_LINEARS or weight.dim() != 2:
                tensors[name] = weight
                continue
            if method == "gptq":
                packed, dense = gptq_tensors(weight, bits, group_size, act_order,
                                             1 if checkpoint_format == "gptq" else 0, len(stands_for), symmetric)
            elif method == "awq":
                packed, dense = awq_tensors(weight, group_size)
            else:
                packed, dense = fp8_tensors(weight, block)
            written[name] = [f"{stem}.{suffix}" for suffix in packed]
            tensors |= dict(zip(written[name], packed.values()))
            stands_for[name] = dense
        save_file(tensors, out_dir / path.name, metadata={"format": "pt"})
    index = out_dir / "model.safetensors.index.json"
    if index.is_file():  # each tensor of a quantized weight where the weight was
        entries = json.loads(index.read_text())
        weight_map = entries["weight_map"]
        for name, names in written.items():
            file = weight_map.pop(name)
            weight_map |= dict.fromkeys(names, file)
        index.write_text(json.dumps(entries, indent=2))
    quant = {"gptq": {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
                      "sym": symmetric, "checkpoint_format": checkpoint_format},
             "awq": {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm",
                     "zero_point": True},
             "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}}[method]
    config = json.loads((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quant}, indent=2))
    return stands_for
