"""Weights held in memory, as weight sources (`loader.WeightSource`): a state dict of tensors or
DTensors (any placements), a model object whose config is read from the model itself, or a
torch.distributed.checkpoint directory. `torch_shift.parallelize` and `torch_shift.handoff` read
through them; the engine copies each part (or the slice of it a plan asks for) into its own
buffers, so the model's storage is only read and no rank ever holds the full weights twice.

A DTensor is read as a whole (`full_tensor`, a collective over its mesh: every rank reads the
parts in one order), one parameter at a time, and then sliced.

Names: Hugging Face (`model.layers.0.self_attn.q_proj.weight`), torchtitan's Llama 3
(`layers.0.attention.wq.weight`, mapped explicitly below; torchtitan's ComplexRoPE rotates
interleaved pairs, so its wq/wk rows are permuted to the half-split RoPE the decoder uses), or
torch_shift's own (a DecoderLM).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

from torch_shift.config import SUPPORTED_ARCHITECTURES, ModelConfig
from torch_shift.models.decoder import DecoderLM
from torch_shift.models.loader import (
    STACKED_INTERLEAVED,
    WeightSource,
    check_tied_head,
    fused_part_rows,
    hf_name_mapper,
    index_tensors,
    read_part,
)

# torchtitan Llama 3 name -> Hugging Face name. torchtitan >= 0.3 nests q/k/v under
# `attention.qkv_linear`; earlier releases put them on `attention` and call the head `output`.
TORCHTITAN_LLAMA3_NAMES: list[tuple[str, str]] = [
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"(?:output|lm_head)\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wq\.weight", "model.layers.{}.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wk\.weight", "model.layers.{}.self_attn.k_proj.weight"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wv\.weight", "model.layers.{}.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", "model.layers.{}.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", "model.layers.{}.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", "model.layers.{}.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", "model.layers.{}.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", "model.layers.{}.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "model.layers.{}.post_attention_layernorm.weight"),
]
_TORCHTITAN = [(re.compile(p), hf) for p, hf in TORCHTITAN_LLAMA3_NAMES]
# torchtitan's FusedQKVLinear (the default in 0.3): one `wqkv` whose rows are, per KV head, its
# query heads, then its K head, then its V head. Read as the wq/wk/wv its state-dict hook names.
_TORCHTITAN_FUSED_QKV = re.compile(r"(layers\.\d+\.attention\.qkv_linear\.)wqkv\.weight")
# Wrappers that training code puts around modules; they change the state-dict names only.
_WRAPPER_PREFIXES = re.compile(r"(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")
NAMINGS = ("auto", "hf", "torchtitan")


def torchtitan_to_hf_name(name: str) -> str | None:
    for pattern, hf in _TORCHTITAN:
        m = pattern.fullmatch(name)
        if m:
            return hf.format(*m.groups())
    return None


def half_split_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a q/k projection for interleaved RoPE (pairs 2i, 2i+1; torchtitan, Meta's Llama)
    reordered for half-split RoPE (pairs i, i + head_dim/2; Hugging Face): within each head, row
    2i + j moves to j * head_dim/2 + i."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


class _WholeTensors:
    """A plain tensor as it is; a DTensor as the whole tensor (`full_tensor`). The last one is kept:
    the parts of a fused parameter are read one after another."""

    def __init__(self) -> None:
        self._last: tuple[DTensor, torch.Tensor] | None = None

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        # a DTensor exists only once its module was imported (importing it here would cost 1.5 s at start-up)
        dtensor_module = sys.modules.get("torch.distributed.tensor")
        if dtensor_module is None or not isinstance(tensor, dtensor_module.DTensor):
            return tensor.detach()
        if self._last is None or self._last[0] is not tensor:
            self._last = None  # drop the previous whole tensor before gathering the next
            with torch.no_grad():
                self._last = (tensor, tensor.full_tensor())
        return self._last[1]

    def clear(self) -> None:
        self._last = None


class _NamedSource:
    """What the state-dict and DCP sources share: the name index and the RoPE row order."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], config: ModelConfig, naming: str, where: str,
                 same_tensor: Callable[[str, str], bool], rope_interleaved: bool | None = None):
        """`same_tensor(a, b)`: whether the source's tensors `a` and `b` hold the same values (a tied head beside the
        embedding)."""
        if naming not in NAMINGS:
            raise ValueError(f"naming must be one of {', '.join(NAMINGS)}, got {naming!r}")
        if naming == "auto":
            naming = "torchtitan" if "tok_embeddings.weight" in shapes else "hf"
        self.naming = naming
        self.config = config
        # torchtitan's default RoPE (ComplexRoPE) rotates interleaved pairs; its CosSinRoPE rotates halves
        self.rope_interleaved = naming == "torchtitan" if rope_interleaved is None else rope_interleaved
        hf_map = hf_name_mapper(config.family)

        def map_name(name: str):
            if naming == "hf":
                return hf_map(name)
            hf_name = torchtitan_to_hf_name(name)
            return hf_map(hf_name) if hf_name is not None else None

        self.index = index_tensors(shapes, config, where, map_name)
        check_tied_head(config, self.index, shapes, map_name, same_tensor, where)
        self.interleaved = {n for n in shapes if (map_name(n) or (None, None))[1] == STACKED_INTERLEAVED}
        self.fused_rows = fused_part_rows(self.index, config, map_name)

    def _read(self, tensor: torch.Tensor, name: str, part: str | None, part_slice, source_name: str) -> torch.Tensor:
        """`part_slice` of `tensor` (the whole part as the source holds it, every expert's parts stacked, or every
        part of a fused parameter), in the decoder's row order."""
        tensor = read_part(tensor, part, part_slice, interleaved=source_name in self.interleaved,
                           rows=self.fused_rows.get((name, part)))
        if self.rope_interleaved and part in ("q", "k"):
            # a plan slices q and k in whole heads along the rows, so the slice is permuted head by head
            assert part_slice is None or (part_slice.dim == 0 and part_slice.length % self.config.head_dim == 0)
            return half_split_rope_rows(tensor, tensor.shape[0] // self.config.head_dim)
        return tensor

    def close(self) -> None:
        pass


class StateDictSource(_NamedSource):
    """Reads parameter parts from a state dict of tensors or DTensors (any placements)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], config: ModelConfig, naming: str = "auto",
                 rope_interleaved: bool | None = None):
        self.tensors = {_WRAPPER_PREFIXES.sub("", name): t for name, t in state_dict.items()
                        if isinstance(t, torch.Tensor)}
        # a part of a fused tensor: name -> (fused tensor, its row blocks of head_dim rows)
        self.fused_parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name in [n for n in self.tensors if _TORCHTITAN_FUSED_QKV.fullmatch(n)]:
            fused = self.tensors.pop(name)
            prefix = _TORCHTITAN_FUSED_QKV.fullmatch(name).group(1)
            for wname, blocks in _torchtitan_qkv_blocks(config).items():
                self.fused_parts[prefix + wname + ".weight"] = (fused, blocks)
        shapes = {n: tuple(t.shape) for n, t in self.tensors.items()}
        shapes |= {n: (len(blocks) * config.head_dim, fused.shape[1])
                   for n, (fused, blocks) in self.fused_parts.items()}
        self._whole = _WholeTensors()
        super().__init__(shapes, config, naming, "state dict", self._same_tensor, rope_interleaved)

    def __call__(self, name: str, part: str | None, part_slice=None) -> torch.Tensor:
        source_name = self.index[(name, part)]
        if source_name in self.fused_parts:
            fused, blocks = self.fused_parts[source_name]
            hd = self.config.head_dim
            if part_slice is not None:  # whole heads of this part (see _read): only those rows are copied
                assert part_slice.dim == 0 and part_slice.start % hd == 0 and part_slice.length % hd == 0
                blocks = blocks[part_slice.start // hd: (part_slice.start + part_slice.length) // hd]
            whole = self._whole(fused)
            tensor = whole.view(-1, hd, whole.shape[1]).index_select(0, blocks.to(whole.device)).flatten(0, 1)
            return self._read(tensor, name, part, None, source_name)
        # the engine copies what this returns into its own buffers: the source's storage is only read
        return self._read(self._whole(self.tensors[source_name]), name, part, part_slice, source_name)

    def _same_tensor(self, a: str, b: str) -> bool:
        tensor_a, tensor_b = self.tensors[a], self.tensors[b]
        if tensor_a is tensor_b:  # a tied model's parameter under both names
            return True
        # every rank builds its source (the handoff is collective): a DTensor's whole is gathered on each
        return torch.equal(self._whole(tensor_a), self._whole(tensor_b))

    def close(self) -> None:
        self._whole.clear()


def _torchtitan_qkv_blocks(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Row blocks (of head_dim rows) of wq, wk and wv in torchtitan's fused wqkv, which holds per KV
    head g its query heads, its K head and its V head: [g * r + i for i < h/h_kv], g * r + h/h_kv,
    g * r + h/h_kv + 1, with r = h/h_kv + 2."""
    per_kv = config.num_attention_heads // config.num_key_value_heads
    r = per_kv + 2
    groups = torch.arange(config.num_key_value_heads) * r
    return {"wq": (groups[:, None] + torch.arange(per_kv)).flatten(), "wk": groups + per_kv,
            "wv": groups + per_kv + 1}


class DCPSource(_NamedSource):
    """Reads parameter parts from a torch.distributed.checkpoint directory (no collectives)."""

    def __init__(self, checkpoint_dir: str | Path, config: ModelConfig, naming: str = "auto", key_prefix: str = ""):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.checkpoint_dir = Path(checkpoint_dir)
        if not (self.checkpoint_dir / ".metadata").is_file():
            raise ValueError(f"{self.checkpoint_dir} is not a torch.distributed.checkpoint directory (no .metadata)")
        metadata = FileSystemReader(str(self.checkpoint_dir)).read_metadata().state_dict_metadata
        # model name (wrappers stripped) -> (key in the checkpoint, its metadata)
        self.entries = {_WRAPPER_PREFIXES.sub("", k[len(key_prefix):]): (k, md) for k, md in metadata.items()
                        if k.startswith(key_prefix) and isinstance(md, TensorStorageMetadata)}
        shapes = {n: tuple(md.size) for n, (_, md) in self.entries.items()}
        super().__init__(shapes, config, naming, str(self.checkpoint_dir), self._same_tensor)

    def __call__(self, name: str, part: str | None, part_slice=None) -> torch.Tensor:
        source_name = self.index[(name, part)]
        return self._read(self._load(source_name), name, part, part_slice, source_name)

    def _load(self, source_name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        key, md = self.entries[source_name]
        tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        dcp.load({key: tensor}, checkpoint_id=str(self.checkpoint_dir), no_dist=True)
        return tensor

    def _same_tensor(self, a: str, b: str) -> bool:
        return torch.equal(self._load(a), self._load(b))


class DecoderSource:
    """Reads parameter parts from a torch_shift DecoderLM (plain or DTensor parameters)."""

    def __init__(self, model: DecoderLM):
        self.model = model
        self.config = c = model.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        # part -> (first row, rows) in its fused parameter (gate and up: each half of a gate/up projection's rows, a
        # dense MLP's or a shared expert's)
        self._part_rows = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        self._whole = _WholeTensors()

    def __call__(self, name: str, part: str | None, part_slice=None) -> torch.Tensor:
        tensor = self._whole(self.model.get_parameter(name))
        if ".experts." in name:  # a stacked experts' parameter (weights or biases) is split by read_part
            return read_part(tensor, part, part_slice, stacked=True)
        if part in ("gate", "up"):
            half = tensor.shape[0] // 2
            tensor = tensor.narrow(0, 0 if part == "gate" else half, half)
        elif part is not None:
            tensor = tensor.narrow(0, *self._part_rows[part])
        return read_part(tensor, part, part_slice)

    def close(self) -> None:
        self._whole.clear()


def module_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters by name: what its state dict holds, without running state-dict hooks
    (torchtitan's fused q/k/v hook would gather every layer's q/k/v at once)."""
    return dict(model.named_parameters())


SUPPORTED_MODELS = (f"transformers' {', '.join(SUPPORTED_ARCHITECTURES)}; torchtitan's Llama 3 (Llama3Model, "
                    "torchtitan >= 0.3); torch_shift's DecoderLM")


def _class_named(model: nn.Module, names, module_prefix: str) -> str | None:
    """The name of the first class of `model` (its own or a base: FSDP2 subclasses the model's class)
    among `names` and defined under `module_prefix`."""
    for cls in type(model).__mro__:
        if cls.__name__ in names and cls.__module__.startswith(module_prefix):
            return cls.__name__
    return None


def model_source(model: nn.Module) -> WeightSource:
    """The weight source of a supported model object, with its config read from the model.
    Raises TypeError for any other object."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if isinstance(model, DecoderLM):
        return DecoderSource(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a model (nn.Module), got {type(model).__name__}")
    arch = _class_named(model, SUPPORTED_ARCHITECTURES, "transformers.")
    if arch is not None:
        config = ModelConfig.from_hf_dict({**model.config.to_dict(), "architectures": [arch]})
        return StateDictSource(module_tensors(model), config, "hf")
    if _class_named(model, ("Llama3Model",), "torchtitan.models.llama3") is not None:
        hf_config, interleaved = torchtitan_llama3_config(model)
        return StateDictSource(module_tensors(model), ModelConfig.from_hf_dict(hf_config), "torchtitan", interleaved)
    raise TypeError(f"{type(model).__module__}.{type(model).__name__} is not supported; supported: {SUPPORTED_MODELS}")


def torchtitan_llama3_config(model: nn.Module) -> tuple[dict[str, Any], bool]:
    """(the Hugging Face config.json of a torchtitan Llama 3, whether its RoPE rotates interleaved
    pairs), read from the model's own config."""
    config = model.config
    block = config.layers[0]
    attention, feed_forward = block.attention, block.feed_forward
    if feed_forward is None or getattr(block, "moe", None) is not None:
        raise ValueError("torchtitan models with MoE layers are not supported")
    if attention.qk_norm is not None:
        raise ValueError("torchtitan Llama 3 with q/k norm is not supported")
    rope = attention.rope
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope.theta}
    if rope.scaling == "llama":
        rope_parameters = {"rope_type": "llama3", "rope_theta": rope.theta, "factor": rope.scaling_factor,
                           "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
                           "original_max_position_embeddings": rope.original_max_position_embeddings}
    elif rope.scaling != "none" and not (rope.scaling == "yarn" and rope.rope_factor <= 1.0):
        raise ValueError(f"torchtitan RoPE scaling {rope.scaling!r} is not supported; supported: none, llama")
    rope_class = type(model.layers["0"].attention.rope).__name__
    if rope_class not in ("ComplexRoPE", "CosSinRoPE"):
        raise ValueError(f"torchtitan RoPE {rope_class} is not supported; supported: ComplexRoPE, CosSinRoPE")
    num_heads = attention.n_heads
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.dim, "intermediate_size": feed_forward.w1.out_features,
        "num_hidden_layers": len(config.layers), "num_attention_heads": num_heads,
        "num_key_value_heads": attention.n_kv_heads or num_heads,
        "head_dim": attention.head_dim or config.dim // num_heads, "max_position_embeddings": rope.max_seq_len,
        "rms_norm_eps": config.norm.eps, "rope_parameters": rope_parameters,
        "tie_word_embeddings": config.enable_weight_tying,
    }
    return hf, rope_class == "ComplexRoPE"
