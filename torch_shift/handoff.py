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
FSDP2/TP) or torchtitan's Llama 3 (`layers.0.attention.wq.weight`); the sources and their name
maps are in `torch_shift.models.sources`, shared with `torch_shift.parallelize`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_shift.config import ModelConfig
from torch_shift.engine.llm import LLM
from torch_shift.models.loader import WeightSource
from torch_shift.models.sources import DCPSource, StateDictSource, model_source, module_tensors


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


def _engine(source: WeightSource, tokenizer: str | Path | None, name: str, engine_args: dict) -> LLM:
    return LLM(name, weights=source, tokenizer=None if tokenizer is None else str(tokenizer), **engine_args)


def handoff(model: nn.Module | Mapping[str, torch.Tensor],
            config: ModelConfig | Mapping[str, Any] | str | Path | None = None, *, tokenizer: str | Path | None = None,
            naming: str = "auto", name: str = "handoff", **engine_args) -> LLM:
    """An engine serving `model`'s current weights (a module or its state dict) in the inference
    layout given by `engine_args` (sp, tp, shift_threshold, ...). Under torchrun every rank calls it.
    Without `config`, the model must be one `torch_shift.parallelize` takes, and its config is read from it."""
    _check_world(engine_args)
    if config is None:
        if not isinstance(model, nn.Module):
            raise TypeError("a handoff of a state dict needs the model's config")
        source = model_source(model)
    else:
        tensors = module_tensors(model) if isinstance(model, nn.Module) else model
        source = StateDictSource(tensors, model_config(config), naming)
    return _engine(source, tokenizer, name, engine_args)


def handoff_from_dcp(checkpoint_dir: str | Path, config: ModelConfig | Mapping[str, Any] | str | Path,
                     *, tokenizer: str | Path | None = None, naming: str = "auto", key_prefix: str = "",
                     name: str = "handoff", **engine_args) -> LLM:
    """An engine serving the model a training job saved with `torch.distributed.checkpoint.save`
    (`key_prefix`: where the model's entries sit in it, e.g. "model." for {"model": sd, ...})."""
    _check_world(engine_args)
    return _engine(DCPSource(checkpoint_dir, model_config(config), naming, key_prefix), tokenizer, name, engine_args)
