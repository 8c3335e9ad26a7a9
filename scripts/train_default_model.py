"""Train the embedded default model (torch_shift/default_model/) from scratch on CPU.

Corpus: the King James Version of the Bible (1611; public domain), as packaged by Debian in
`bible-kjv` (`apt-get install bible-kjv`; the packaging says "Users may copy, modify or
distribute this file at will"). The script reads it through the package's `bible` command, or
from `--corpus FILE` (the same text, one verse per line).

Steps: normalise the text to one verse per line and one document per chapter, train a
byte-level BPE tokenizer with `tokenizers`, train a Llama (transformers' LlamaForCausalLM) with
AdamW for a fixed number of steps from a fixed seed, and write a Hugging Face directory:
config.json, model.safetensors (bfloat16), tokenizer files with a chat template,
generation_config.json and a README with the run's facts.

    python scripts/train_default_model.py --out torch_shift/default_model

The committed model came from this command on the 2-core CPU machine; the run time is printed
at the end and recorded in the model's README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import tokenizers
import tokenizers.decoders
import tokenizers.models
import tokenizers.pre_tokenizers
import tokenizers.processors
import tokenizers.trainers
import torch

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
# The model was never trained on dialogue: a chat is laid out as plain lines of text, and the
# model continues after the last one.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{{ message['content'] | trim }}\n{% endfor %}"
)
VERSE = re.compile(r"^\s+(\d+) (.*)$")


def read_chapters(corpus: Path | None) -> list[str]:
    """The corpus as chapters, each a string with one verse per line."""
    if corpus is not None:
        return [c for c in corpus.read_text().split("\n\n") if c.strip()]
    if shutil.which("bible") is None:
        raise SystemExit("the `bible` command is missing: apt-get install bible-kjv, or pass --corpus FILE")
    text = subprocess.run(["bible", "-l100000", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                          text=True, env={"COLUMNS": "100000"}).stdout
    chapters, verses = [], []
    for line in text.splitlines():
        m = VERSE.match(line)
        if m:
            verses.append(m.group(2).strip())
        elif line.strip() and verses:  # a chapter heading ("Genesis 2") closes the previous chapter
            chapters.append("\n".join(verses))
            verses = []
    if verses:
        chapters.append("\n".join(verses))
    return chapters


def train_tokenizer(chapters: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(chapters, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", bos)])
    return tokenizer


def write_tokenizer(tokenizer: tokenizers.Tokenizer, out: Path) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": True,
        "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE}, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def token_stream(tokenizer: tokenizers.Tokenizer, chapters: list[str]) -> torch.Tensor:
    """bos chapter eos bos chapter eos ... as one long tensor of ids."""
    eos = tokenizer.token_to_id("</s>")
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(chapters):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def model_config(vocab_size: int, args: argparse.Namespace) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size, "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads, "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.hidden_size // args.num_heads, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "dtype": "bfloat16",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("torch_shift/default_model"))
    parser.add_argument("--corpus", type=Path, default=None, help="text file, chapters separated by blank lines")
    parser.add_argument("--vocab-size", type=int, default=3072)
    parser.add_argument("--hidden-size", type=int, default=192)
    parser.add_argument("--intermediate-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=6)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    chapters = read_chapters(args.corpus)
    tokenizer = train_tokenizer(chapters, args.vocab_size)
    stream = token_stream(tokenizer, chapters)
    print(f"corpus: {len(chapters)} chapters, {sum(map(len, chapters)) / 1e6:.2f} M characters, "
          f"{stream.numel() / 1e6:.2f} M tokens")

    config = model_config(tokenizer.get_vocab_size(), args)
    model = LlamaForCausalLM(LlamaConfig(**{**config, "dtype": "float32"}))
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f} M parameters")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.steps))))
    generator = torch.Generator().manual_seed(args.seed)
    window = args.seq_len
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, stream.numel() - window, (args.batch_size,), generator=generator)
        batch = torch.stack([stream[s: s + window] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss  # transformers shifts the labels by one
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.perf_counter() - start:7.0f} s", flush=True)
    train_seconds = time.perf_counter() - start

    model.eval()
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied to the embedding
    staging = Path(tempfile.mkdtemp(prefix=".default_model-", dir=args.out.parent))
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    (staging / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}, indent=2))
    write_tokenizer(tokenizer, staging)
    (staging / "README.md").write_text(
        f"# torch_shift default model\n\n"
        f"A {num_params / 1e6:.1f} M-parameter Llama trained from scratch by `scripts/train_default_model.py` "
        f"on the King James Version of the Bible (public domain; Debian package `bible-kjv`).\n\n"
        f"- tokenizer: byte-level BPE, {tokenizer.get_vocab_size()} tokens, trained with `tokenizers`\n"
        f"- training: {args.steps} AdamW steps of {args.batch_size} x {args.seq_len} tokens, seed {args.seed}, "
        f"final loss {loss.item():.3f}, {train_seconds / 60:.1f} min with {torch.get_num_threads()} torch "
        f"thread(s)\n"
        f"- weights: bfloat16 safetensors, embedding tied to the LM head\n\n"
        f"It writes KJV-style English; it knows nothing else and was never trained on dialogue.\n")
    if args.out.exists():
        shutil.rmtree(args.out)
    staging.rename(args.out)
    print(f"wrote {args.out} in {train_seconds / 60:.1f} min")


if __name__ == "__main__":
    main()
