"""Shift parallelism under torchrun: every rank runs this program, rank 0 schedules.

    torchrun --standalone --nproc-per-node 2 examples/shift_generate.py --sp 2   # the embedded default model
    torchrun --standalone --nproc-per-node 4 examples/shift_generate.py --model DIR --sp 2 --tp 2

Each rank prints what `generate` returned (the same on every rank) as one JSON line.
"""

import argparse
import json

import torch.distributed as dist

from torch_shift import LLM, SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None, help="a checkpoint directory or hub id (default: the embedded model)")
parser.add_argument("--sp", type=int, default=2)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--shift-threshold", type=int, default=16)
parser.add_argument("--max-tokens", type=int, default=8)
parser.add_argument("prompts", nargs="*", default=["And God said", "In the beginning"])
args = parser.parse_args()

llm = LLM(args.model, sp=args.sp, tp=args.tp, shift_threshold=args.shift_threshold)
outputs = llm.generate(args.prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=False)
line = json.dumps({"rank": dist.get_rank(), "layouts": dict(llm.engine.model.layout_counts),
                   "outputs": [o.outputs[0].token_ids for o in outputs],
                   "texts": [o.outputs[0].text for o in outputs]})
print(line + "\n", end="", flush=True)  # one write: the lines of ranks printing at once stay whole
dist.barrier()  # no rank leaves while another still talks to it
dist.destroy_process_group()
