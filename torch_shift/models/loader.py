"""Build a model on the meta device and load it from Hugging Face safetensors files.

Each family has one name map: Hugging Face tensor name -> (parameter name, shard), where
the shard names the slot of a fused parameter (q/k/v in `qkv_proj`, gate/up in
`gate_up_proj`). Tensors are read one at a time with `safe_open`, so only one tensor is
ever in memory beside the model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from torch_shift.config import ModelConfig
from torch_shift.models.decoder import DecoderLM

# (pattern on the Hugging Face name, parameter name template, shard of a fused parameter)
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
_QK_NORM_NAMES = [
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "layers.{}.attn.q_norm.weight", None),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "layers.{}.attn.k_norm.weight", None),
]
NAME_MAPS: dict[str, list[tuple[str, str, str | None]]] = {
    "llama": _LLAMA_NAMES + _QKV_BIAS_NAMES,  # attention_bias=True Llama variants carry q/k/v bias
    "mistral": _LLAMA_NAMES,
    "qwen2": _LLAMA_NAMES + _QKV_BIAS_NAMES,
    "qwen3": _LLAMA_NAMES + _QKV_BIAS_NAMES + _QK_NORM_NAMES,
}
# Tensors some checkpoints carry that the model recomputes.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def fused_shard_rows(model: DecoderLM, param_name: str, shard: str) -> tuple[int, int]:
    """(row offset, row count) of `shard` inside a fused parameter, from the module's local sizes."""
    module = model.get_submodule(param_name.rsplit(".", 1)[0].rsplit(".", 1)[0])
    if shard in ("q", "k", "v"):
        q_rows = module.num_heads * module.head_dim
        kv_rows = module.num_kv_heads * module.head_dim
        return {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}[shard]
    half = module.gate_up_proj.weight.shape[0] // 2
    return {"gate": (0, half), "up": (half, half)}[shard]


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it (single file or sharded index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        if missing:
            raise ValueError(f"{model_dir}: shard files listed in {index.name} are missing: {', '.join(missing)}")
        return {name: model_dir / f for name, f in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no *.safetensors file (pickled .bin checkpoints are not loaded)")
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():
                names[name] = f
    return names


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """Yield (tensor name, reader); each reader loads one tensor when called."""
    by_file: dict[Path, list[str]] = {}
    for name, f in checkpoint_files(model_dir).items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(f, framework="pt") as fh:
            present = set(fh.keys())
            for name in names:
                if name not in present:
                    raise ValueError(f"{f.name} does not contain {name!r}, which its index names")
                yield name, lambda fh=fh, name=name: fh.get_tensor(name)


def _compile_name_map(family: str) -> list[tuple[re.Pattern, str, str | None]]:
    return [(re.compile(p), target, shard) for p, target, shard in NAME_MAPS[family]]


def load_weights(model: DecoderLM, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor into the (already materialised) model parameters."""
    model_dir = Path(model_dir)
    config = model.config
    name_map = _compile_name_map(config.family)
    params = dict(model.named_parameters(remove_duplicate=False))
    expected: set[tuple[str, str | None]] = set()
    for name, p in params.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            expected |= {(name, s) for s in "qkv"}
        elif name.endswith("gate_up_proj.weight"):
            expected |= {(name, "gate"), (name, "up")}
        else:
            expected.add((name, None))
    loaded: set[tuple[str, str | None]] = set()
    for hf_name, read in iter_checkpoint(model_dir):
        if _IGNORED.match(hf_name):
            continue
        target = _map_name(name_map, hf_name)
        if target is None:
            raise ValueError(f"{model_dir}: tensor {hf_name!r} is not part of a {config.architecture}")
        param_name, shard = target
        if config.tie_word_embeddings and param_name == "lm_head.weight":
            continue  # tied: the embedding is the head
        if param_name not in params:
            raise ValueError(f"{model_dir}: tensor {hf_name!r} has no place in this model (check config.json)")
        param = params[param_name]
        dest = param.data
        if shard is not None:
            offset, rows = fused_shard_rows(model, param_name, shard)
            dest = dest.narrow(0, offset, rows)
        tensor = read()
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"{model_dir}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        loaded.add((param_name, shard))
    missing = expected - loaded
    if missing:
        names = sorted(f"{n}[{s}]" if s else n for n, s in missing)
        raise ValueError(f"{model_dir}: checkpoint lacks tensors for {', '.join(names[:8])}"
                         + (f" and {len(names) - 8} more" if len(names) > 8 else ""))


def _map_name(name_map: list[tuple[re.Pattern, str, str | None]], hf_name: str) -> tuple[str, str | None] | None:
    for pattern, target, shard in name_map:
        m = pattern.fullmatch(hf_name)
        if m:
            return target.format(*m.groups()), shard
    return None


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DecoderLM:
    """Build on the meta device, materialise empty parameters on `device`, fill them from safetensors."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = DecoderLM(config).to(dtype)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.materialize(torch.device(device))
    with torch.no_grad():
        load_weights(model, model_dir)
    return model.eval().requires_grad_(False)
