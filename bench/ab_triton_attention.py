"""This tree's paged decode attention against another version of torch_shift/attention/triton_paged.py, as the
engine's decode graphs launch it (capacity 4,096 keys: contexts in chunks of 256), us per layer and the largest
difference of the outputs (bit for bit expected).

    git show REV:torch_shift/attention/triton_paged.py > /tmp/other_triton_paged.py
    PYTHONPATH=. python bench/ab_triton_attention.py /tmp/other_triton_paged.py

On the CPU (TRITON_INTERPRET=1, DEVICE=cpu) it only checks the outputs, on two small cases.
"""
import dataclasses
import importlib.util
import os
import sys

import bench_triton_attention as bta
import torch

from torch_shift.attention import triton_paged as this

DEVICE = os.environ.get("DEVICE", "cuda")
CAPACITY = 4096


def load(path: str):
    spec = importlib.util.spec_from_file_location("baseline_triton_paged", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_triton_paged"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    baseline = load(sys.argv[1])
    variants = [("baseline", baseline), ("this", this), ("baseline", baseline), ("this", this)]
    cases = [(1, 160), (1, 1000), (1, 2048), (8, 160), (64, 160), (64, 2048), (256, 512)]
    if DEVICE == "cpu":
        cases, bta.LAYERS = [(1, 160), (2, 700)], 1
    for seqs, context in cases:
        cache, md, q = bta.make_step([(context - 1, 1)] * seqs, DEVICE)
        row, outs = [], {}
        for name, module in variants:
            fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(md)}
            fields["partials"] = {}
            metadata = module.TritonMetadata(**fields)
            metadata.decode_splits, metadata.split_keys = module.split_plan(CAPACITY, CAPACITY)
            out = torch.empty(bta.LAYERS, *q.shape, dtype=q.dtype, device=q.device)

            def run_layers(cache, md_, q_, out_, module=module, metadata=metadata):
                for layer in range(bta.LAYERS):
                    module.paged_attention(out_[layer], q_, cache, layer, metadata, None, None)

            bta.run_layers = run_layers
            if DEVICE == "cpu":
                run_layers(cache, metadata, q, out)
                seconds = 0.0
            else:
                seconds = bta.timed(cache, metadata, q, out, replays=50)
            outs.setdefault(name, out.clone())
            difference = (out.float() - outs["baseline"].float()).abs().max().item()
            row.append(f"{name} {seconds * 1e6:6.2f} ({difference:.0e})")
        print(f"{seqs:4d} x {context:5d}: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
