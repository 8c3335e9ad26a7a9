"""The embedded default model, used when no `--model` is given.

A 2.2M-parameter Llama with a 3072-token byte-level BPE tokenizer, trained from scratch by
`scripts/train_default_model.py` on the King James Version of the Bible (public domain), shipped
in the package as a Hugging Face directory (bfloat16 safetensors, 4.3 MB). It writes simple
KJV-style English; see torch_shift/default_model/README.md for how it was made.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model_dir() -> Path:
    missing = [f for f in _FILES if not (DEFAULT_MODEL_DIR / f).is_file()]
    if missing:
        raise ValueError(f"the embedded default model at {DEFAULT_MODEL_DIR} lacks {', '.join(missing)}; "
                         "reinstall torch_shift or pass --model")
    return DEFAULT_MODEL_DIR
