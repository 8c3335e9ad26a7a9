"""Build a model on the meta device and load it from safetensors (or PyTorch's pickled `.bin` files): a Hugging Face
directory or a converted torch_shift checkpoint (`torch-shift convert`).

Each family has one name map: Hugging Face tensor name -> (parameter name, part), where the
part names the slot of a fused parameter (q/k/v in `qkv_proj`, gate/up in `gate_up_proj`) or of a
stacked experts' parameter (`"3.gate"`, `"3.up"`: expert 3's rows of `experts.gate_up_proj`; `"3"`:
expert 3 of `experts.down_proj`). A checkpoint holds an expert's projections one tensor each, or all
experts stacked in one tensor shaped as the parameter (transformers' in-memory layout; part `STACKED`).
`CheckpointReader` reads one part at a time, and only the slice a parallel plan asks for
(`safe_open(...).get_slice`), so no rank ever materialises the whole model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from torch_shift.config import ModelConfig, WeightQuantization
from torch_shift.models.decoder import DecoderLM
from torch_shift.models.moe import Experts
from torch_shift.models.mxfp4 import Mxfp4Experts
from torch_shift.models.quantized import QuantizedWeight, tensor_names

# An MXFP4 tensor X (GPT-OSS's experts) is stored as X_blocks and X_scales (torch_shift.models.mxfp4).
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"

# The part a name map gives a tensor that holds every part of a parameter, stacked as the parameter is.
STACKED = "*"
# ... stacked with each expert's projection transposed ([E, H, 2 * I], [E, I, H]) and its gate and up columns
# interleaved (gate_up_proj and its bias [E, 2 * I]): GPT-OSS's checkpoints.
STACKED_INTERLEAVED = "*T"
# The part of a tensor that holds every part of a fused parameter, concatenated on dim 0 as the parameter holds
# them (Phi-3's `qkv_proj` and `gate_up_proj`).
FUSED = "+"
PartKey = tuple[str, str | None]  # (parameter name, part)

# (pattern on the Hugging Face name, parameter name template, part template: the part of a fused parameter)
_LLAMA_NAMES: list[tuple[str, str, str | None]] = [
    (r"model\.embed_tokens\.weight", "embed_tokens.weight", None),
    (r"model\.norm\.weight", "norm.weight", None),
    (r"lm_head\.weight", "lm_head.weight", None),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{}.input_norm.weight", None),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{}.post_attention_norm.weight", None),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "layers.{}.attn.qkv_proj.weight", "q"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "layers.{}.attn.qkv_proj.weight", "k"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "layers.{}.attn.qkv_proj.weight", "v"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers.{}.attn.o_proj.weight", None),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "layers.{}.mlp.gate_up_proj.weight", "gate"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "layers.{}.mlp.gate_up_proj.weight", "up"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers.{}.mlp.down_proj.weight", None),
]
_QKV_BIAS_NAMES = [
    (rf"model\.layers\.(\d+)\.self_attn\.{p}_proj\.bias", "layers.{}.attn.qkv_proj.bias", p) for p in "qkv"
]
_O_BIAS_NAMES = [(r"model\.layers\.(\d+)\.self_attn\.o_proj\.bias", "layers.{}.attn.o_proj.bias", None)]
_QK_NORM_NAMES = [
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "layers.{}.attn.q_norm.weight", None),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "layers.{}.attn.k_norm.weight", None),
]
# Sparse layers (a part template's {1} is the expert): as save_pretrained writes them, one tensor per
# expert and projection, or as transformers 5 holds them in memory, every expert in one tensor.
_MOE_NAMES = [
    (r"model\.layers\.(\d+)\.mlp\.gate\.weight", "layers.{}.mlp.router.weight", None),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight", "layers.{}.mlp.experts.gate_up_proj", "{1}.gate"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.up_proj\.weight", "layers.{}.mlp.experts.gate_up_proj", "{1}.up"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight", "layers.{}.mlp.experts.down_proj", "{1}"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj", "layers.{}.mlp.experts.gate_up_proj", STACKED),
    (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj", "layers.{}.mlp.experts.down_proj", STACKED),
]
_SHARED_EXPERT_NAMES = [  # Qwen2-MoE's shared expert and its gate
    (r"model\.layers\.(\d+)\.mlp\.shared_expert\.gate_proj\.weight", "layers.{}.mlp.shared_expert.gate_up_proj.weight",
     "gate"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert\.up_proj\.weight", "layers.{}.mlp.shared_expert.gate_up_proj.weight",
     "up"),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert\.down_proj\.weight", "layers.{}.mlp.shared_expert.down_proj.weight",
     None),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight", "layers.{}.mlp.shared_expert_gate.weight", None),
]
_MIXTRAL_NAMES = [  # Mixtral's checkpoints: w1 the gate, w3 the up, w2 the down projection
    (r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight", "layers.{}.mlp.router.weight", None),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight", "layers.{}.mlp.experts.gate_up_proj",
     "{1}.gate"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w3\.weight", "layers.{}.mlp.experts.gate_up_proj",
     "{1}.up"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w2\.weight", "layers.{}.mlp.experts.down_proj",
     "{1}"),
]
_GPT_OSS_NAMES = [
    (r"model\.layers\.(\d+)\.self_attn\.sinks", "layers.{}.attn.sinks", None),
    (r"model\.layers\.(\d+)\.mlp\.router\.weight", "layers.{}.mlp.router.weight", None),
    (r"model\.layers\.(\d+)\.mlp\.router\.bias", "layers.{}.mlp.router.bias", None),
    (r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj", "layers.{}.mlp.experts.gate_up_proj", STACKED_INTERLEAVED),
    (r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj_bias", "layers.{}.mlp.experts.gate_up_bias",
     STACKED_INTERLEAVED),
    (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj", "layers.{}.mlp.experts.down_proj", STACKED_INTERLEAVED),
    (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj_bias", "layers.{}.mlp.experts.down_bias", STACKED_INTERLEAVED),
]
_PHI3_NAMES = _LLAMA_NAMES[:5] + [
    (r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight", "layers.{}.attn.qkv_proj.weight", FUSED),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers.{}.attn.o_proj.weight", None),
    (r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight", "layers.{}.mlp.gate_up_proj.weight", FUSED),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers.{}.mlp.down_proj.weight", None),
]
_GEMMA_NORM_NAMES = [
    (r"model\.layers\.(\d+)\.pre_feedforward_layernorm\.weight", "layers.{}.pre_feedforward_norm.weight", None),
    (r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight", "layers.{}.post_feedforward_norm.weight", None),
]
NAME_MAPS: dict[str, list[tuple[str, str, str | None]]] = {
    "llama": _LLAMA_NAMES + _QKV_BIAS_NAMES + _O_BIAS_NAMES,  # attention_bias=true: q, k, v and o biases
    "mistral": _LLAMA_NAMES,
    "qwen2": _LLAMA_NAMES + _QKV_BIAS_NAMES,
    "qwen3": _LLAMA_NAMES + _QKV_BIAS_NAMES + _O_BIAS_NAMES + _QK_NORM_NAMES,
    "qwen2_moe": _LLAMA_NAMES + _QKV_BIAS_NAMES + _MOE_NAMES + _SHARED_EXPERT_NAMES,
    "qwen3_moe": _LLAMA_NAMES + _QKV_BIAS_NAMES + _O_BIAS_NAMES + _QK_NORM_NAMES + _MOE_NAMES,
    "mixtral": _LLAMA_NAMES + _MIXTRAL_NAMES + _MOE_NAMES,
    "gpt_oss": _LLAMA_NAMES + _QKV_BIAS_NAMES + _O_BIAS_NAMES + _GPT_OSS_NAMES,
    "phi3": _PHI3_NAMES,
    "gemma3_text": _LLAMA_NAMES + _QK_NORM_NAMES + _GEMMA_NORM_NAMES,
}
# Tensors some checkpoints carry that the model recomputes, and a vision-language model's vision tower and projector
# (its language model is served alone: Gemma 3's, Qwen2-VL's).
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|freqs_cis)$|(model\.)?(vision_tower|multi_modal_projector|visual)\.")
# A vision-language model's language model, as its checkpoints (`language_model.model.`) and transformers 5's modules
# (`model.language_model.`) name it
_LANGUAGE_MODEL = re.compile(r"^(language_model\.model\.|model\.language_model\.)")

FUSED_PARTS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


def expert_part(expert: int, slot: str | None = None) -> str:
    """The part of a stacked experts' parameter: `slot` "gate"/"up" of `gate_up_proj`, None for `down_proj`."""
    return str(expert) if slot is None else f"{expert}.{slot}"


def expert_part_rows(part: str, rows_per_expert: int) -> tuple[int, int, int]:
    """(expert, first row, rows) of an expert part within its stacked parameter [E, rows_per_expert, cols]."""
    expert, _, slot = part.partition(".")
    if not slot:
        return int(expert), 0, rows_per_expert
    half = rows_per_expert // 2
    return int(expert), (0 if slot == "gate" else half), half


def source_shape(tensor_slice) -> tuple[int, ...]:
    """The shape of a safetensors slice or a tensor."""
    return tuple(tensor_slice.get_shape() if hasattr(tensor_slice, "get_shape") else tensor_slice.shape)


def stacked_expert_part(stacked, part: str) -> torch.Tensor:
    """One expert part of a stacked tensor [E, rows, cols] (a tensor, or a safetensors slice read only there)."""
    expert, first, rows = expert_part_rows(part, source_shape(stacked)[1])
    return stacked[expert, first:first + rows]


def stacked_expert_shape(config: ModelConfig, param: str, interleaved: bool = False) -> tuple[int, ...]:
    """The shape of a stacked experts' parameter (`...mlp.experts.gate_up_proj`, `down_proj`, `gate_up_bias` or
    `down_bias`); `interleaved`: as GPT-OSS's checkpoints store it (STACKED_INTERLEAVED)."""
    e, d, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
    projection = param.rsplit(".", 1)[1]
    if projection == "gate_up_bias":
        return (e, 2 * inter)
    if projection == "down_bias":
        return (e, d)
    if projection == "gate_up_proj":
        return (e, d, 2 * inter) if interleaved else (e, 2 * inter, d)
    return (e, inter, d) if interleaved else (e, d, inter)


def interleaved_expert_part(stacked, part: str) -> torch.Tensor:
    """One expert part of a STACKED_INTERLEAVED tensor (a tensor, or a safetensors slice read only at the
    expert), as the parameter holds it: gate or up columns separated, projections transposed back."""
    expert, _, slot = part.partition(".")
    tensor = stacked[int(expert)]
    if slot:
        tensor = tensor[..., 0::2] if slot == "gate" else tensor[..., 1::2]
    return tensor.t() if tensor.dim() == 2 else tensor


def expected_parts(config: ModelConfig) -> dict[tuple[str, str | None], tuple[int, ...]]:
    """(parameter name, part) -> full shape, for every tensor a checkpoint of `config` holds."""
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_rows, kv_rows = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[tuple[str, str | None], tuple[int, ...]] = {
        ("embed_tokens.weight", None): (config.vocab_size, d),
        ("norm.weight", None): (d,),
    }
    if not config.tie_word_embeddings:
        shapes[("lm_head.weight", None)] = (config.vocab_size, d)
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {
            (p + "input_norm.weight", None): (d,),
            (p + "post_attention_norm.weight", None): (d,),
            (p + "attn.qkv_proj.weight", "q"): (q_rows, d),
            (p + "attn.qkv_proj.weight", "k"): (kv_rows, d),
            (p + "attn.qkv_proj.weight", "v"): (kv_rows, d),
            (p + "attn.o_proj.weight", None): (d, q_rows),
        }
        if i in config.sparse_layers:
            expert_inter = config.moe_intermediate_size
            shapes[(p + "mlp.router.weight", None)] = (config.num_experts, d)
            for e in range(config.num_experts):
                shapes |= {
                    (p + "mlp.experts.gate_up_proj", expert_part(e, "gate")): (expert_inter, d),
                    (p + "mlp.experts.gate_up_proj", expert_part(e, "up")): (expert_inter, d),
                    (p + "mlp.experts.down_proj", expert_part(e)): (d, expert_inter),
                }
            if config.shared_expert_intermediate_size:
                shared_inter = config.shared_expert_intermediate_size
                shapes |= {
                    (p + "mlp.shared_expert.gate_up_proj.weight", "gate"): (shared_inter, d),
                    (p + "mlp.shared_expert.gate_up_proj.weight", "up"): (shared_inter, d),
                    (p + "mlp.shared_expert.down_proj.weight", None): (d, shared_inter),
                    (p + "mlp.shared_expert_gate.weight", None): (1, d),
                }
        else:
            shapes |= {
                (p + "mlp.gate_up_proj.weight", "gate"): (inter, d),
                (p + "mlp.gate_up_proj.weight", "up"): (inter, d),
                (p + "mlp.down_proj.weight", None): (d, inter),
            }
        if config.attention_bias:
            shapes |= {(p + "attn.qkv_proj.bias", "q"): (q_rows,), (p + "attn.qkv_proj.bias", "k"): (kv_rows,),
                       (p + "attn.qkv_proj.bias", "v"): (kv_rows,)}
        if config.o_proj_bias:
            shapes[(p + "attn.o_proj.bias", None)] = (d,)
        if config.attention_sinks:
            shapes[(p + "attn.sinks", None)] = (config.num_attention_heads,)
        if i in config.sparse_layers and config.router_bias:
            shapes[(p + "mlp.router.bias", None)] = (config.num_experts,)
        if i in config.sparse_layers and config.expert_bias:
            for e in range(config.num_experts):
                shapes |= {(p + "mlp.experts.gate_up_bias", expert_part(e, "gate")): (config.moe_intermediate_size,),
                           (p + "mlp.experts.gate_up_bias", expert_part(e, "up")): (config.moe_intermediate_size,),
                           (p + "mlp.experts.down_bias", expert_part(e)): (d,)}
        if config.qk_norm:
            shapes |= {(p + "attn.q_norm.weight", None): (hd,), (p + "attn.k_norm.weight", None): (hd,)}
        if config.gemma_norms:
            shapes |= {(p + f"{where}_feedforward_norm.weight", None): (d,) for where in ("pre", "post")}
    return shapes


def part_views(model: torch.nn.Module, name: str) -> dict[str | None, torch.Tensor]:
    """A (local) parameter of `model` split into its parts, as views; {None: param} if not fused."""
    param = model.get_parameter(name)
    owner, projection = name.rsplit(".", 1)
    if isinstance(model.get_submodule(owner), Experts):
        rows = param.shape[1]
        slots = ("gate", "up") if projection in ("gate_up_proj", "gate_up_bias") else (None,)
        views = {}
        first_expert = model.get_submodule(owner).first_expert  # a rank's run of experts: the model's numbering
        for e in range(param.shape[0]):
            for slot in slots:
                part = expert_part(first_expert + e, slot)
                _, first, length = expert_part_rows(part, rows)
                views[part] = param.data[e, first:first + length]
        return views
    leaf = name.split(".")[-2]
    if leaf not in FUSED_PARTS:
        return {None: param.data}
    module = model.get_submodule(name.rsplit(".", 2)[0])
    if leaf == "qkv_proj":
        sizes = [module.num_heads * module.head_dim] + [module.num_kv_heads * module.head_dim] * 2
    else:
        sizes = [param.shape[0] // 2] * 2
    return dict(zip(FUSED_PARTS[leaf], param.data.split(sizes, dim=0)))


# A checkpoint's weights: safetensors files, else (as vLLM falls back) PyTorch's pickled files, each form alone or
# sharded under its index
SAFETENSORS, PICKLED = ("*.safetensors", "model.safetensors.index.json"), ("pytorch_model*.bin",
                                                                            "pytorch_model.bin.index.json")


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the file that holds it (single file or sharded index): safetensors, else pickled
    `pytorch_model*.bin` files."""
    for pattern, index_name in (SAFETENSORS, PICKLED):
        index = model_dir / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map")
            missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
            if missing:
                raise ValueError(f"{model_dir}: shard files listed in {index.name} are missing: {', '.join(missing)}")
            return {name: model_dir / f for name, f in weight_map.items()}
        files = sorted(model_dir.glob(pattern))
        if files:
            names: dict[str, Path] = {}
            for f in files:
                with open_weights_file(f) as handle:
                    names |= dict.fromkeys(handle.keys(), f)
            return names
    raise ValueError(f"{model_dir} holds no *.safetensors or pytorch_model*.bin file")


class PickledWeights:
    """A `pytorch_model*.bin` file read as a safetensors handle reads: `keys()`, and `get_slice(name)`, whose reads
    are new tensors, from the file mapped where its format allows (a rank touches only the pages of its slices).
    Unpickled with `weights_only`: no code in the file runs."""

    def __init__(self, path: Path):
        try:
            tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # torch.save's legacy format (before 1.6) cannot be mapped: read whole
            tensors = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise ValueError(f"{path} holds no state dict of tensors")
        self.tensors: dict[str, torch.Tensor] = tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __enter__(self) -> PickledWeights:
        return self

    def __exit__(self, *exc) -> None:
        self.tensors = {}

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self.tensors[name])


class TensorSlice:
    """A tensor read as a safetensors slice: `get_shape()`, and each read (`[...]`) a copy of its own, never a view
    of the file's mapping."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index].clone(memory_format=torch.contiguous_format)


def open_weights_file(path: Path):
    """A safetensors handle, or PickledWeights for a pickled file."""
    return PickledWeights(path) if path.suffix == ".bin" else safe_open(path, framework="pt")


# A torch_shift checkpoint (`torch-shift convert`): this file lists every stored tensor.
CONVERTED_MANIFEST = "torch_shift_checkpoint.json"
CONVERTED_FORMAT_VERSION = 1
# Weights a tensor-parallel plan shards on dim 1 (Shard(1), the row-parallel layers). A converted
# checkpoint stores them transposed, so any rank's shard is one contiguous run of rows.
ROW_PARALLEL = re.compile(r"layers\.\d+\.(attn\.o_proj|mlp\.down_proj|mlp\.shared_expert\.down_proj)\.weight")


class WeightSource(Protocol):
    """Where a model's weights come from: a checkpoint directory (CheckpointReader), a training
    job's state dict or a DCP checkpoint (torch_shift.handoff)."""

    config: ModelConfig

    def __call__(self, name: str, part: str | None, part_slice=None) -> torch.Tensor: ...

    def close(self) -> None: ...


def index_tensors(shapes: dict[str, tuple[int, ...]], config: ModelConfig, where: str,
                  map_name: Callable[[str], tuple[str, str | None] | None],
                  name_in_source: Callable[[str, str | None], str | None] | None = None,
                  ) -> dict[tuple[str, str | None], str]:
    """(parameter name, part) -> source tensor name, checked against what `config` implies.

    `shapes` holds every tensor of the source (name -> shape as the model sees it); `map_name`
    places a source name in the model, or returns None for a name that has no place there;
    `name_in_source`, its inverse where there is one, names a missing tensor as the source would.
    Raises ValueError for a foreign tensor, a missing one, or a shape the config does not imply.
    """
    expected = expected_parts(config)
    parts_of: dict[str, list[str | None]] = {}
    for param, part in expected:
        parts_of.setdefault(param, []).append(part)
    index: dict[tuple[str, str | None], str] = {}
    for source_name, shape in shapes.items():
        if _IGNORED.match(source_name):
            continue
        target = map_name(source_name)
        if target is None:
            raise ValueError(f"{where}: tensor {source_name!r} is not part of a {config.architecture}")
        if config.tie_word_embeddings and target == ("lm_head.weight", None):
            continue  # tied: the embedding is the head
        param, part = target
        if part == FUSED:  # every part of a fused parameter in one tensor, each read from its rows
            if param not in parts_of:
                raise ValueError(f"{where}: tensor {source_name!r} has no place in this model (check config.json)")
            part_shapes = [expected[(param, p)] for p in parts_of[param]]
            implied = (sum(rows for rows, *_ in part_shapes), *part_shapes[0][1:])
            if tuple(shape) != implied:
                raise ValueError(f"{where}: tensor {source_name!r} has shape {tuple(shape)}, "
                                 f"config.json implies {implied}")
            index |= _new_parts(index, {(param, p): source_name for p in parts_of[param]}, where)
            continue
        if part in (STACKED, STACKED_INTERLEAVED):  # every expert's parts in one tensor, each read from it
            if param not in parts_of:
                raise ValueError(f"{where}: tensor {source_name!r} has no place in this model (check config.json)")
            implied = stacked_expert_shape(config, param, part == STACKED_INTERLEAVED)
            if tuple(shape) != implied:
                raise ValueError(f"{where}: tensor {source_name!r} has shape {tuple(shape)}, "
                                 f"config.json implies {implied}")
            index |= _new_parts(index, {(param, p): source_name for p in parts_of[param]}, where)
            continue
        if target not in expected:
            raise ValueError(f"{where}: tensor {source_name!r} has no place in this model (check config.json)")
        if tuple(shape) != expected[target]:
            raise ValueError(f"{where}: tensor {source_name!r} has shape {tuple(shape)}, "
                             f"config.json implies {expected[target]}")
        index |= _new_parts(index, {target: source_name}, where)
    absent = set(expected) - set(index)
    named = {key: name_in_source(*key) if name_in_source is not None else None for key in absent}
    missing = sorted({named[(n, p)] or (f"{n}[{p}]" if p else n) for n, p in absent})
    if missing:
        raise ValueError(f"{where}: checkpoint lacks tensors for {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return index


def check_tied_head(config: ModelConfig, index: dict[PartKey, str], names, map_name: Callable,
                    same: Callable[[str, str], bool], where: str) -> None:
    """The config ties the LM head to the embedding, which index_tensors reads for both: a head the source holds
    beside it (`names`) must be the embedding (`same(head, embedding)`; transformers unties a different one, with a
    warning), refused rather than dropped without a word, from a directory or a training job's tensors alike."""
    if not config.tie_word_embeddings:
        return
    embedding = index[("embed_tokens.weight", None)]
    for head in [n for n in names if map_name(n) == ("lm_head.weight", None)]:
        if not same(head, embedding):
            raise ValueError(f"{where}: the config ties the LM head to the embedding (tie_word_embeddings), but the "
                             f"source's {head!r} differs from {embedding!r}; set tie_word_embeddings to false in "
                             "the config to use it as the head")


def _new_parts(index: dict[PartKey, str], parts: dict[PartKey, str], where: str) -> dict[PartKey, str]:
    """`parts`, none of which another tensor of the source already holds (a vision-language checkpoint's language
    model under two namings, or per-expert tensors beside stacked ones)."""
    for key, source_name in parts.items():
        if key in index:
            raise ValueError(f"{where}: tensors {index[key]!r} and {source_name!r} both hold "
                             f"{key[0]}{f'[{key[1]}]' if key[1] else ''}")
    return parts


def fused_part_rows(index: dict[PartKey, str], config: ModelConfig,
                    map_name: Callable[[str], PartKey | None]) -> dict[PartKey, tuple[int, int]]:
    """(parameter name, part) -> (first row, rows) of the part within its FUSED source tensor (index_tensors'
    index), the parts in the parameter's order."""
    expected = expected_parts(config)
    rows: dict[PartKey, tuple[int, int]] = {}
    first_of: dict[str, int] = {}
    for key, source in index.items():  # a fused parameter's parts were indexed in its order
        if (map_name(source) or (None, None))[1] == FUSED:
            first = first_of.get(source, 0)
            rows[key] = (first, expected[key][0])
            first_of[source] = first + expected[key][0]
    return rows


def hf_name_mapper(family: str) -> Callable[[str], tuple[str, str | None] | None]:
    """Hugging Face tensor name -> (parameter name, part) for a model family (a vision-language model's language
    model under its text-only names)."""
    name_map = [(re.compile(p), target, part) for p, target, part in NAME_MAPS[family]]

    def language_model(hf_name: str) -> str:
        if hf_name == "language_model.lm_head.weight":
            return "lm_head.weight"
        return _LANGUAGE_MODEL.sub("model.", hf_name)

    return lambda hf_name: _map_name(name_map, language_model(hf_name))


def hf_tensor_name(family: str, param: str, part: str | None) -> str | None:
    """The Hugging Face tensor a (parameter, part) is read from (`hf_name_mapper`'s inverse): its own tensor where the
    family's names have one (a projection, an expert's), else the tensor that holds every part (Phi-3's fused
    projections, GPT-OSS's stacked experts); None where no name of the family places it."""
    whole = None
    for pattern, target, part_template in NAME_MAPS[family]:
        found = re.fullmatch(re.escape(target).replace(r"\{\}", r"(\d+)"), param)
        if found is None:
            continue
        groups = list(found.groups())
        if part_template in (FUSED, STACKED, STACKED_INTERLEAVED):
            whole = whole or _fill(pattern, groups)
            continue
        if part_template is None or part is None:
            if part_template is None and part is None:
                return _fill(pattern, groups)
            continue
        expert = re.fullmatch(re.escape(part_template).replace(r"\{1\}", r"(\d+)"), part)
        if expert is not None:
            return _fill(pattern, groups + list(expert.groups()))
    return whole


def _fill(pattern: str, groups: list[str]) -> str:
    """A name map's pattern with its number groups filled in, in order."""
    for group in groups:
        pattern = pattern.replace(r"(\d+)", group, 1)
    return pattern.replace("\\.", ".")


def read_part(tensor_slice, part: str | None, part_slice, transposed: bool = False,
              interleaved: bool = False, stacked: bool | None = None, rows: tuple[int, int] | None = None
              ) -> torch.Tensor:
    """`part_slice` of one part of a parameter from its source tensor (a safetensors slice or a tensor): the
    part itself, or a stacked experts' tensor holding it among the others (`stacked`; by default a tensor of
    three dims, see index_tensors); `interleaved`: a STACKED_INTERLEAVED tensor (GPT-OSS), whose expert is
    read whole, then sliced; `rows`: (first row, rows) of the part in a FUSED tensor (fused_part_rows)."""
    if rows is not None:
        return fused_part(tensor_slice, *rows, part_slice)
    if interleaved:
        return slice_window(interleaved_expert_part(tensor_slice, part), part_slice)
    if stacked or (stacked is None and len(source_shape(tensor_slice)) == 3):
        assert not transposed, "a converted checkpoint stores every expert part apart"
        tensor_slice = stacked_expert_part(tensor_slice, part)
    return slice_window(tensor_slice, part_slice, transposed)


def fused_part(tensor_slice, first_row: int, rows: int, part_slice) -> torch.Tensor:
    """`part_slice` of the part at rows [first_row, first_row + rows) of a FUSED tensor, read only there."""
    if part_slice is None:
        return tensor_slice[first_row:first_row + rows]
    if part_slice.dim == 0:
        return tensor_slice[first_row + part_slice.start:first_row + part_slice.start + part_slice.length]
    return tensor_slice[first_row:first_row + rows, part_slice.start:part_slice.start + part_slice.length]


def slice_window(tensor_slice, part_slice, transposed: bool = False) -> torch.Tensor:
    """Read `part_slice` of a safetensors slice (or any tensor); `transposed`: the stored tensor
    is the transpose of the parameter, whose dim-1 window is then a run of stored rows."""
    if part_slice is None:
        tensor = tensor_slice[:]
        return tensor.t() if transposed else tensor
    window = slice(part_slice.start, part_slice.start + part_slice.length)
    if transposed:
        rows = tensor_slice[window] if part_slice.dim == 1 else tensor_slice[:, window]
        return rows.t()
    return tensor_slice[window] if part_slice.dim == 0 else tensor_slice[:, window]


class CheckpointReader:
    """`reader(param_name, part, part_slice)` -> the tensor (or only the slice) from safetensors.

    Reads a Hugging Face directory (single or sharded safetensors) or a converted torch_shift
    checkpoint (`torch-shift convert`). Construction checks that the checkpoint holds exactly the
    tensors `config` implies, each with the implied shape, so a wrong checkpoint fails before
    anything is loaded.
    """

    def __init__(self, model_dir: str | Path, config: ModelConfig):
        self.model_dir = Path(model_dir)
        self.config = config
        self._handles: dict[Path, object] = {}
        self.transposed: set[str] = set()
        manifest_path = self.model_dir / CONVERTED_MANIFEST
        if manifest_path.is_file():
            manifest = read_manifest(manifest_path)
            files = {name: self.model_dir / entry["file"] for name, entry in manifest["tensors"].items()}
            absent = sorted({str(f.name) for f in files.values() if not f.is_file()})
            if absent:
                raise ValueError(f"{self.model_dir}: files listed in {CONVERTED_MANIFEST} are missing: "
                                 f"{', '.join(absent)}")
            self.transposed = {n for n, e in manifest["tensors"].items() if e.get("transposed")}
            places = {n: (e["param"], e["part"]) for n, e in manifest["tensors"].items()}
            map_name, name_in_source = places.get, None
        else:
            files = checkpoint_files(self.model_dir)
            map_name = hf_name_mapper(config.family)
            name_in_source = partial(hf_tensor_name, config.family)
        # a weight stored quantized, by the name of the weight it stands for -> read as that weight
        self.dequantized: dict[str, Mxfp4Experts | QuantizedWeight] = {}
        quant = config.quantization
        if quant is not None and quant.method == "mxfp4":
            for name in [n for n in files if n.endswith(MXFP4_BLOCKS)]:
                stem = name.removesuffix(MXFP4_BLOCKS)
                if stem + MXFP4_SCALES not in files:
                    raise ValueError(f"{self.model_dir}: tensor {name!r} has no {stem + MXFP4_SCALES!r} beside it")
                blocks, scales = files.pop(name), files.pop(stem + MXFP4_SCALES)
                self.dequantized[stem] = Mxfp4Experts(stem, self._handle(blocks).get_slice(name),
                                                      self._handle(scales).get_slice(stem + MXFP4_SCALES),
                                                      mxfp4_dtype(config),
                                                      reads=2 if stem.endswith("gate_up_proj") else 1)
                files[stem] = blocks
        elif quant is not None:
            self._pair_quantized(files, quant, map_name)
        self.files = files
        self.interleaved = {n for n in files if (map_name(n) or (None, None))[1] == STACKED_INTERLEAVED}
        shapes = {}
        for name in files:
            shape = source_shape(self._slice(name))
            shapes[name] = tuple(shape)[::-1] if name in self.transposed else tuple(shape)
        self.index = index_tensors(shapes, config, str(self.model_dir), map_name, name_in_source)
        self.fused_rows = fused_part_rows(self.index, config, map_name)
        check_tied_head(config, self.index, files, map_name, lambda a, b: torch.equal(self._slice(a)[:],
                                                                                     self._slice(b)[:]),
                        str(self.model_dir))

    def _pair_quantized(self, files: dict[str, Path], quant: WeightQuantization,
                        map_name: Callable[[str], PartKey | None]) -> None:
        """Each quantized linear layer's tensors (quantized.tensor_names) -> one QuantizedWeight in `files` under
        the name of the weight it stands for (`stem.weight`)."""
        mark, needed, optional = tensor_names(quant)
        if quant.method == "fp8" and (scale := next((n for n in files if n.endswith(".weight_scale")), None)):
            raise ValueError(f"{self.model_dir}: tensor {scale!r}: FP8 with one scale per tensor (AutoFP8's and "
                             "vLLM's own checkpoints) is not supported; supported: block scales (weight_scale_inv)")
        expected = expected_parts(self.config)
        for name in [n for n in files if n.endswith(mark)]:
            stem = name.removesuffix(mark)
            present = [s for s in needed if stem + s in files]
            if not present and mark == ".weight":
                continue  # a layer left unquantized
            if len(present) < len(needed):
                absent = ", ".join(repr(stem + s) for s in needed if s not in present)
                raise ValueError(f"{self.model_dir}: tensor {name!r} has no {absent} beside it")
            tensors = {s: self._handle(files.pop(stem + s)).get_slice(stem + s)
                       for s in (mark, *needed, *optional) if stem + s in files}
            self.dequantized[stem + ".weight"] = QuantizedWeight(stem + ".weight", tensors, quant)
            files[stem + ".weight"] = self.model_dir  # read through self.dequantized
            bias = stem + ".bias"
            if quant.method in ("gptq", "awq") and bias in files and map_name(bias) not in expected:
                # older AutoGPTQ gave every quantized layer a bias, zeros where the layer has none (vLLM skips them)
                if bool(self._handle(files[bias]).get_slice(bias)[:].any()):
                    raise ValueError(f"{self.model_dir}: tensor {bias!r} is not part of a "
                                     f"{self.config.architecture}, and not zero")
                files.pop(bias)

    def _slice(self, name: str):
        """The source tensor `name` as a safetensors slice (or a quantized weight read as one)."""
        if name in self.dequantized:
            return self.dequantized[name]
        return self._handle(self.files[name]).get_slice(name)

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = open_weights_file(path)
        return self._handles[path]

    def __call__(self, name: str, part: str | None, part_slice=None) -> torch.Tensor:
        source_name = self.index[(name, part)]
        return read_part(self._slice(source_name), part, part_slice, source_name in self.transposed,
                         source_name in self.interleaved, rows=self.fused_rows.get((name, part)))

    def close(self) -> None:
        self._handles.clear()
        self.dequantized.clear()


def mxfp4_dtype(config: ModelConfig) -> torch.dtype:
    """The dtype MXFP4 weights are dequantized into: the checkpoint's own where it is bfloat16 (as GPT-OSS's),
    else float32; both hold every MXFP4 value exactly."""
    return torch.bfloat16 if config.torch_dtype in ("bfloat16", "bf16") else torch.float32


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if manifest.get("format") != "torch_shift" or manifest.get("version") != CONVERTED_FORMAT_VERSION:
        raise ValueError(f"{path}: not a torch_shift checkpoint of format version {CONVERTED_FORMAT_VERSION}")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict) or not all(
            isinstance(e, dict) and {"file", "param", "part"} <= set(e) for e in tensors.values()):
        raise ValueError(f"{path}: the tensor list is malformed")
    return manifest


def _map_name(name_map: list[tuple[re.Pattern, str, str | None]], hf_name: str) -> tuple[str, str | None] | None:
    for pattern, target, part in name_map:
        m = pattern.fullmatch(hf_name)
        if m:
            return target.format(*m.groups()), part if part is None else part.format(*m.groups())
    return None


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    config: ModelConfig | None = None,
) -> DecoderLM:
    """Build on the meta device, materialise empty parameters on `device`, fill them from safetensors. `config`:
    the directory's as an engine runs it (`ModelConfig.for_context`); by default as config.json reads."""
    config = config or ModelConfig.from_dir(Path(model_dir))
    reader = CheckpointReader(model_dir, config)
    try:
        return build_model(config, reader, dtype, device)
    finally:
        reader.close()


def build_model(config: ModelConfig, read: Callable, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> DecoderLM:
    """The full model, each parameter part filled by `read(name, part, None)`."""
    with torch.device("meta"):
        model = DecoderLM(config).to(dtype)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.materialize(torch.device(device))
    with torch.no_grad():
        for name, _ in model.named_parameters():
            for part, dest in part_views(model, name).items():
                dest.copy_(read(name, part, None))
    return model.eval().requires_grad_(False)
