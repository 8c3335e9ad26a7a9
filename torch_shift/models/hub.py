"""Resolve a model argument: a local checkpoint directory or a Hugging Face hub id."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

_CHECKPOINT_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                     "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.*"]
# fetched only where a snapshot has no safetensors (an older checkpoint), as vLLM falls back to them
_PICKLED_FILES = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".gguf")


def looks_like_path(model: str | Path) -> bool:
    """A path, not a hub id: absolute, relative to . or ~, more than one "/", a file's name, or an existing
    file."""
    name = str(model)
    return (isinstance(model, Path) or name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
            or Path(name).suffix in _FILE_SUFFIXES or Path(name).expanduser().exists())


def resolve_model_dir(model: str | Path, revision: str | None = None) -> Path:
    """A directory as given, else the hub id's snapshot: the local cache first, then a download.

    Without a network (or with HF_HUB_OFFLINE=1) and nothing cached, the ValueError names the
    id and the cache that was searched.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    repo_id = str(model)
    if looks_like_path(repo_id):
        what = ("a model is a checkpoint directory (config.json, *.safetensors or pytorch_model*.bin) or a Hugging "
                "Face hub id such as Qwen/Qwen2.5-0.5B-Instruct")
        if path.is_file():
            raise ValueError(f"{path} is a file: {what}; pass its directory, {path.parent}")
        if path.suffix in _FILE_SUFFIXES:
            raise ValueError(f"no such file: {path} (and {what}, not a file in it)")
        raise ValueError(f"no such directory: {path} ({what})")
    try:
        validate_repo_id(repo_id)  # dots are fine: Qwen2.5-0.5B, Llama-3.2-1B, Mistral-7B-v0.1
    except HFValidationError as e:
        raise ValueError(f"model {repo_id!r}: no such directory, and not a Hugging Face hub id ({e})") from None
    try:
        return _snapshot(repo_id, revision, local_files_only=True)
    except Exception:
        pass
    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            f"model {repo_id!r}: no such directory, and not in the Hugging Face cache {constants.HF_HUB_CACHE} "
            "(HF_HUB_OFFLINE is set, so nothing was downloaded)"
        )
    try:
        return _snapshot(repo_id, revision, etag_timeout=5)
    except Exception as e:
        raise ValueError(
            f"model {repo_id!r}: no such directory, not in the Hugging Face cache {constants.HF_HUB_CACHE}, "
            f"and could not be downloaded ({type(e).__name__}: {e})"
        ) from None


def _snapshot(repo_id: str, revision: str | None, **kwargs) -> Path:
    """The snapshot's checkpoint files: safetensors, else PyTorch's pickled ones."""
    path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=_CHECKPOINT_FILES, **kwargs))
    if not any(path.glob("*.safetensors")):
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=_PICKLED_FILES, **kwargs))
    return path
