"""The embedded default model, used when no `--model` is given.

For now it is a small random-weight Llama (about 1M parameters) with a byte-level BPE tokenizer,
built locally on first use in about a second: it shows the whole path working, and its text is
not meant to read well. It lives under $TORCH_SHIFT_HOME (default ~/.cache/torch_shift).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from torch_shift.models.toy import build_tokenizer, tiny_llama_config, write_random_checkpoint

DEFAULT_MODEL_NAME = "default-random-llama-v1"


def default_model_dir() -> Path:
    home = Path(os.environ.get("TORCH_SHIFT_HOME", Path.home() / ".cache" / "torch_shift"))
    target = home / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    home.mkdir(parents=True, exist_ok=True)
    # build in a temporary directory and rename, so an interrupted build never looks complete
    staging = Path(tempfile.mkdtemp(prefix=DEFAULT_MODEL_NAME, dir=home))
    try:
        build_tokenizer(staging, vocab_size=512)
        write_random_checkpoint(staging, tiny_llama_config(), seed=0, init_std=0.1)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
