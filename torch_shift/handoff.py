"""Training -> inference inside one job: the engine takes a model's weights in their training
placements (DTensors under FSDP2 `fully_shard` and/or TP `parallelize_module`, or plain
tensors) and loads them into its own layout without writing to disk.

    llm = torch_shift.handoff(model, config=hf_config, tokenizer=tokenizer_dir, sp=2, tp=2)
    outputs = llm.generate(prompts, params)   # every rank calls it; rank 0 schedules
    ...                                       # training goes on: its weights were only read

Each parameter part is redistributed from its training placements to Replicate (`full_tensor`,
one tensor at a time, in the same order on every rank) and each rank keeps the slice its base
and shift plans give it; the training tensors are never written. `handoff_from_dcp` reads the
same names from a torch.distributed.checkpoint directory the training job saved.

Names: Hugging Face (`model.layers.0.self_attn.q_proj.weight`, e.g. transformers' Llama under
FSDP2/TP) or torchtitan's Llama 3 (`layers.0.attention.wq.weight`, mapped explicitly below;
torchtitan rotates interleaved pairs, so its wq/wk rows are permuted to the half-split RoPE the
decoder uses).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torch_shift.config import ModelConfig
from torch_shift.engine.llm import LLM
from torch_shift.models.loader import hf_name_mapper, index_tensors, slice_window

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


class _NamedSource:
    """What the state-dict and DCP sources share: the name index and the RoPE row order."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], config: ModelConfig, naming: str, where: str):
        if naming not in NAMINGS:
            raise ValueError(f"naming must be one of {', '.join(NAMINGS)}, got {naming!r}")
        if naming == "auto":
            naming = "torchtitan" if "tok_embeddings.weight" in shapes else "hf"
        self.naming = naming
        self.config = config
        hf_map = hf_name_mapper(config.family)

        def map_name(name: str):
            if naming == "hf":
                return hf_map(name)
            hf_name = torchtitan_to_hf_name(name)
            return hf_map(hf_name) if hf_name is not None else None

        self.index = index_tensors(shapes, config, where, map_name)

    def _to_model_order(self, tensor: torch.Tensor, name: str, part: str | None) -> torch.Tensor:
        if self.naming == "torchtitan" and part in ("q", "k"):
            heads = self.config.num_attention_heads if part == "q" else self.config.num_key_value_heads
            return half_split_rope_rows(tensor, heads)
        return tensor

    def close(self) -> None:
        pass


class StateDictSource(_NamedSource):
    """Reads parameter parts from a state dict of tensors or DTensors (any placements)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], config: ModelConfig, naming: str = "auto"):
        self.tensors = {_WRAPPER_PREFIXES.sub("", name): t for name, t in state_dict.items()
                        if isinstance(t, torch.Tensor)}
        super().__init__({n: tuple(t.shape) for n, t in self.tensors.items()}, config, naming, "state dict")

    def __call__(self, name: str, part: str | None, part_slice=None) -> torch.Tensor:
        tensor = self.tensors[self.index[(name, part)]]
        with torch.no_grad():
            if isinstance(tensor, DTensor):
                # a collective over the training mesh: every rank reads the parts in one order
                tensor = tensor.full_tensor()
            # the engine copies what this returns into its own buffers: training storage is only read
            return slice_window(self._to_model_order(tensor.detach(), name, part), part_slice)


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
        super().__init__(shapes, config, naming, str(self.checkpoint_dir))

    def __call__(self, name: str, part: str | None, part_slice=None) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        key, md = self.entries[self.index[(name, part)]]
        tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        dcp.load({key: tensor}, checkpoint_id=str(self.checkpoint_dir), no_dist=True)
        return slice_window(self._to_model_order(tensor, name, part), part_slice)


def model_config(config: ModelConfig | Mapping[str, Any] | str | Path) -> ModelConfig:
    """A ModelConfig from itself, a Hugging Face config dict (e.g. `model.config.to_dict()`) or a
    directory holding config.json."""
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, Mapping):
        return ModelConfig.from_hf_dict(dict(config))
    if isinstance(config, (str, Path)):
        return ModelConfig.from_dir(Path(config))
    raise TypeError(f"config must be a ModelConfig, a Hugging Face config dict or a directory, "
                    f"got {type(config).__name__}")


def _check_world(engine_args: dict) -> None:
    world = engine_args.get("sp", 1) * engine_args.get("tp", 1)
    if world == 1:
        return
    if not dist.is_initialized() or dist.get_world_size() != world:
        have = dist.get_world_size() if dist.is_initialized() else "no process group"
        raise ValueError(f"a handoff runs on the training job's ranks: sp * tp = {world} must equal the "
                         f"world size of the initialised process group ({have})")


def _engine(source: _NamedSource, tokenizer: str | Path | None, name: str, engine_args: dict) -> LLM:
    return LLM(name, weights=source, tokenizer=None if tokenizer is None else str(tokenizer), **engine_args)


def handoff(model: nn.Module | Mapping[str, torch.Tensor], config: ModelConfig | Mapping[str, Any] | str | Path,
            *, tokenizer: str | Path | None = None, naming: str = "auto", name: str = "handoff",
            **engine_args) -> LLM:
    """An engine serving `model`'s current weights (a module or its state dict) in the inference
    layout given by `engine_args` (sp, tp, shift_threshold, ...). Under torchrun every rank calls it."""
    _check_world(engine_args)
    state_dict = model.state_dict() if isinstance(model, nn.Module) else model
    return _engine(StateDictSource(state_dict, model_config(config), naming), tokenizer, name, engine_args)


def handoff_from_dcp(checkpoint_dir: str | Path, config: ModelConfig | Mapping[str, Any] | str | Path,
                     *, tokenizer: str | Path | None = None, naming: str = "auto", key_prefix: str = "",
                     name: str = "handoff", **engine_args) -> LLM:
    """An engine serving the model a training job saved with `torch.distributed.checkpoint.save`
    (`key_prefix`: where the model's entries sit in it, e.g. "model." for {"model": sd, ...})."""
    _check_world(engine_args)
    return _engine(DCPSource(checkpoint_dir, model_config(config), naming, key_prefix), tokenizer, name, engine_args)
