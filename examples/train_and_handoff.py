"""Train a tiny Llama with FSDP2 + TP under torchrun, hand it to the engine, generate, train on.

    torchrun --standalone --nproc-per-node 4 examples/train_and_handoff.py --train-tp 2 --sp 2 --tp 2

Training: transformers' LlamaForCausalLM, tensor parallel (`parallelize_module`) over the mesh
axis "tp" and FSDP2 (`fully_shard`) over "dp", AdamW, on CPU with gloo. The text is this
repository's own documentation, tokenized with the embedded default model's tokenizer.
Inference: `torch_shift.handoff` redistributes the training weights into shift parallelism's
(SP, TP) layout on the same ranks, with nothing written to disk; rank 0 prints the
generations, then training resumes from where it stopped. Needs `pip install transformers`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import torch_shift
from torch_shift.models.default import default_model_dir
from torch_shift.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent


def corpus_ids(tokenizer: Tokenizer) -> torch.Tensor:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return torch.tensor([t for f in files for t in tokenizer.encode(f.read_text())], dtype=torch.long)


def build_model(vocab_size: int, mesh, train_tp: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same initial weights on every rank
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        if train_tp > 1:
            parallelize_module(layer.self_attn, mesh["tp"], {
                "q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
                "o_proj": RowwiseParallel()})
            parallelize_module(layer.mlp, mesh["tp"], {
                "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def train(model, optimizer, ids: torch.Tensor, steps: int, generator: torch.Generator, args) -> float:
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        starts = torch.randint(0, ids.numel() - args.seq_len, (args.batch_size,), generator=generator)
        batch = torch.stack([ids[s: s + args.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if dist.get_rank() == 0 and (step % 50 == 0 or step == steps - 1):
            print(f"[train] step {step:4d}  loss {loss.item():.3f}", flush=True)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--resume-steps", type=int, default=20, help="training steps after the handoff")
    parser.add_argument("--train-tp", type=int, default=1, help="tensor-parallel degree of training")
    parser.add_argument("--sp", type=int, default=None, help="inference SP (default: world size / --tp)")
    parser.add_argument("--tp", type=int, default=1, help="inference TP")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("prompts", nargs="*", default=["torch_shift is", "Shift parallelism"])
    args = parser.parse_args()
    if importlib.util.find_spec("transformers") is None:
        parser.error("the model trained here is transformers' Llama: pip install transformers")

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    sp = args.sp or world // args.tp
    mesh = init_device_mesh("cpu", (world // args.train_tp, args.train_tp), mesh_dim_names=("dp", "tp"))
    tokenizer_dir = default_model_dir()
    ids = corpus_ids(Tokenizer.from_dir(tokenizer_dir))
    model = build_model(Tokenizer.from_dir(tokenizer_dir).vocab_size, mesh, args.train_tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # one batch per TP group

    start = time.perf_counter()
    train(model, optimizer, ids, args.steps, generator, args)
    trained_s = time.perf_counter() - start

    start = time.perf_counter()
    llm = torch_shift.handoff(model, model.config.to_dict(), tokenizer=tokenizer_dir, sp=sp, tp=args.tp)
    handoff_s = time.perf_counter() - start
    params = torch_shift.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    outputs = llm.generate(args.prompts, params, use_tqdm=False)
    if dist.get_rank() == 0:
        print(f"[handoff] {args.steps} steps in {trained_s:.0f} s; handoff to sp={sp} tp={args.tp} "
              f"in {handoff_s:.1f} s")
        for out in outputs:
            print(f"[generate] {out.prompt!r} -> {out.outputs[0].text!r}")
    del llm  # the engine's copy of the weights; the training model was only read

    train(model, optimizer, ids, args.resume_steps, generator, args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
