"""`torch-shift convert`: a Hugging Face checkpoint -> a torch_shift checkpoint.

The output is safetensors laid out for sharded loading on any (SP, TP) mesh:
- tensors under torch_shift's parameter names, one per part of a fused parameter
  (`layers.0.attn.qkv_proj.weight.q`), so loading needs no name matching;
- the row-parallel weights (o_proj, down_proj, sharded on dim 1) stored transposed, so every
  rank's shard is one contiguous run of rows read straight from the memory map;
- the tied LM head stored once, in the requested dtype;
- MXFP4 experts (GPT-OSS) stored dequantized, so the output is an unquantized checkpoint;
- `torch_shift_checkpoint.json` listing every tensor (file, parameter, part, transposed), plus
  config.json, the tokenizer files, the chat template and generation_config.json.

The output is written under a hidden sibling directory and renamed into place at the end, so an
interrupted or failed conversion never leaves a directory that looks like a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from torch_shift.config import ModelConfig, resolve_dtype
from torch_shift.models.loader import (
    CONVERTED_FORMAT_VERSION,
    CONVERTED_MANIFEST,
    ROW_PARALLEL,
    CheckpointReader,
)

# Copied unchanged when present (config.json is rewritten for the dtype).
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
               "chat_template.jinja", "chat_template.json")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def stored_name(param: str, part: str | None) -> str:
    return param if part is None else f"{param}.{part}"


def convert_checkpoint(model_dir: str | Path, out_dir: str | Path, dtype: str | None = None,
                       max_shard_bytes: int = 2 << 30, overwrite: bool = False, progress: bool = True) -> Path:
    """Convert the Hugging Face checkpoint in `model_dir` into a torch_shift checkpoint at `out_dir`.

    `dtype` (None or "auto": the checkpoint's own) is the dtype of the stored weights. Raises
    ValueError, before writing anything, for an unsupported architecture, a missing shard or
    tensor, or a tensor whose shape does not match config.json.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not model_dir.is_dir():
        raise ValueError(f"{model_dir} is not a directory")
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError("--out must differ from --model")
    if out_dir.exists() and not overwrite:
        raise ValueError(f"{out_dir} already exists (pass overwrite=True / --overwrite to replace it)")
    if (model_dir / CONVERTED_MANIFEST).is_file():
        raise ValueError(f"{model_dir} is already a torch_shift checkpoint")
    config = ModelConfig.from_dir(model_dir)  # unsupported architectures end here
    hf_config = json.loads((model_dir / "config.json").read_text())
    reader = CheckpointReader(model_dir, config)  # missing shards, tensors and wrong shapes end here
    target_dtype = resolve_dtype(dtype, config.torch_dtype) if dtype not in (None, "auto") else None

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        entries: dict[str, dict] = {}
        shard: dict[str, torch.Tensor] = {}
        shard_bytes = num_files = 0
        stored_dtypes = set()

        def flush() -> None:
            nonlocal shard, shard_bytes, num_files
            if shard:
                file = f"model-{num_files:05d}.safetensors"
                save_file(shard, staging / file, metadata={"format": "pt"})
                for name in shard:
                    entries[name]["file"] = file
                shard, shard_bytes, num_files = {}, 0, num_files + 1

        for (param, part), _ in tqdm(sorted(reader.index.items(), key=lambda kv: _param_order(kv[0])),
                                     desc="convert", unit="tensor", disable=not progress):
            tensor = reader(param, part, None)
            if target_dtype is not None:
                tensor = tensor.to(target_dtype)
            transposed = ROW_PARALLEL.fullmatch(param) is not None
            if transposed:
                tensor = tensor.t()
            name = stored_name(param, part)
            shard[name] = tensor.contiguous()
            stored_dtypes.add(tensor.dtype)
            entries[name] = {"param": param, "part": part, "transposed": transposed}
            shard_bytes += tensor.numel() * tensor.element_size()
            if shard_bytes >= max_shard_bytes:
                flush()
        flush()
        reader.close()

        for f in _SIDE_FILES:
            if (model_dir / f).is_file():
                shutil.copy2(model_dir / f, staging / f)
        hf_config.pop("quantization_config", None)  # MXFP4 experts are stored dequantized (CheckpointReader)
        if len(stored_dtypes) == 1:
            (stored,) = stored_dtypes
            hf_config["dtype"] = hf_config["torch_dtype"] = _DTYPE_NAMES[stored]
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2))
        manifest = {"format": "torch_shift", "version": CONVERTED_FORMAT_VERSION,
                    "source": str(model_dir.resolve()), "tensors": entries}
        # the manifest goes last: a directory without it is not a torch_shift checkpoint
        (staging / CONVERTED_MANIFEST).write_text(json.dumps(manifest, indent=1))
        # safetensors creates its files owner-only: the shards take the mode the umask gave the files written here
        mode = (staging / "config.json").stat().st_mode & 0o777
        for i in range(num_files):
            os.chmod(staging / f"model-{i:05d}.safetensors", mode)
        os.chmod(staging, 0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        reader.close()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _param_order(key: tuple[str, str | None]) -> tuple:
    """Layer by layer, so shards hold whole layers and a rank's reads stay close together."""
    param, part = key
    pieces = param.split(".")
    layer = int(pieces[1]) if pieces[0] == "layers" else (-1 if param.startswith("embed") else 1 << 30)
    return layer, param, part or ""
