"""Resolve a model argument: a local checkpoint directory or a Hugging Face hub id."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import constants, snapshot_download

_CHECKPOINT_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                     "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.*"]


def resolve_model_dir(model: str | Path, revision: str | None = None) -> Path:
    """A directory as given, else the hub id's snapshot: the local cache first, then a download.

    Without a network (or with HF_HUB_OFFLINE=1) and nothing cached, the ValueError names the
    id and the cache that was searched.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    repo_id = str(model)
    if repo_id.count("/") > 1 or path.suffix or repo_id.startswith((".", "/", "~")):
        raise ValueError(f"model {repo_id!r} is neither a local directory nor a Hugging Face hub id")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_CHECKPOINT_FILES,
                                      local_files_only=True))
    except Exception:
        pass
    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            f"model {repo_id!r} is not a local directory and is not in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE} (HF_HUB_OFFLINE is set, so nothing was downloaded)"
        )
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_CHECKPOINT_FILES, etag_timeout=5))
    except Exception as e:
        raise ValueError(
            f"model {repo_id!r} is not a local directory, is not in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE}, and could not be downloaded ({type(e).__name__}: {e})"
        ) from None
