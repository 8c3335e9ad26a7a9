"""Where a batch-1 decode step goes (issue 20): one process, the peer benchmark's model (bench_peers.py) or a
model of the same shape whose weights read in microseconds (`--small`: hidden 256), a 512-token prompt, then
`--tokens` generated tokens with timers around the step's parts:

- the packed matmuls (`PackedWeight.run`: the GEMV kernel at batch 1; the LM head among them), with their bytes
  and the rate they read at, against the machine's streaming read measured in the same run;
- the attention calls (`CpuPagedAttention.__call__`);
- the rest of the compiled (or eager) forward: its fused kernels, its wrapper, the custom operators' Python;
- the runner around the forward (inputs, attention metadata, sampling) and the engine around the runner.

    python bench/bench_step.py [--dtype bfloat16] [--tokens 256] [--small] [--compile true|false]

The timers wrap methods of this process only (a few microseconds of their own per call, so the parts add up to a
little more than a plain step); TPOT without them is printed first, from an engine as a user starts it, whose small
steps the C++ decoder runs whole (torch_shift.models.native_decoder). Timers need Python: the timed steps run in a
second engine without that decoder, on the packed linear operator's and the attention operator's Python
implementations where their CPU implementations are C++ (kernels/cpu_ops.cpp).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench_peers import INIT_STD, MODEL, machine_limits


class Timers:
    """Nanoseconds and calls per part, accumulated by wrapping methods of their classes."""

    def __init__(self):
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.bytes_read = 0
        self.skipping = False  # skip_first_step: the next step's figures are dropped

    def wrap(self, cls, name: str, part: str, count_bytes: bool = False) -> None:
        original = getattr(cls, name)

        def timed(obj, *args, **kwargs):
            start = time.perf_counter_ns()
            result = original(obj, *args, **kwargs)
            self.ns[part] = self.ns.get(part, 0) + time.perf_counter_ns() - start
            self.calls[part] = self.calls.get(part, 0) + 1
            if count_bytes:
                self.bytes_read += obj.nbytes
            return result

        setattr(cls, name, timed)

    def reset(self) -> None:
        self.ns.clear()
        self.calls.clear()
        self.bytes_read = 0

    def skip_first_step(self, core_cls) -> None:
        """Drop what the next EngineCore.step measured (a prompt's prefill), once."""
        original = core_cls.step
        timers = self

        def step(core):
            result = original(core)
            if timers.skipping:
                timers.reset()
                timers.skipping = False
            return result

        self.skipping = True
        core_cls.step = step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--small", action="store_true", help="hidden 256 (MLP 512, 4 / 1 heads): fixed cost only")
    parser.add_argument("--compile", choices=["true", "false"], default="true")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    import torch

    from torch_shift import LLM, SamplingParams
    from torch_shift.attention.cpu import CpuPagedAttention
    from torch_shift.compilation import CompiledForward
    from torch_shift.engine.core import EngineCore
    from torch_shift.engine.model_runner import ModelRunner
    from torch_shift.models.decoder import DecoderLM
    from torch_shift.models.linear import PackedWeight, _packed_by_handle, packed_weight
    from torch_shift.models.toy import tiny_llama_config, write_random_checkpoint

    config = dict(MODEL)
    if args.small:
        config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1)
    limits = machine_limits([torch.get_num_threads()])
    bandwidth = next(iter(limits["read_bandwidth"].values()))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_checkpoint(Path(tmp) / "model", tiny_llama_config(**config), init_std=INIT_STD)
        llm = LLM(str(model_dir), dtype=args.dtype, max_num_batched_tokens=2048,
                  max_model_len=config["max_position_embeddings"], enable_prefix_caching=False, seed=0,
                  compile=args.compile == "true")
        prompt = {"prompt_token_ids": [(7 * i) % (config["vocab_size"] - 2) + 2 for i in range(512)]}

        def generate(num_tokens: int) -> float:
            params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            return time.perf_counter() - start

        generate(4)
        # the fastest of each kind of run, told apart: the smallest difference of pairs took a slow one-token run for a
        # fast decode (a CI run read -128 ms a token)
        firsts, fulls = [], []
        for _ in range(3):
            firsts += [generate(1) for _ in range(2)]
            fulls.append(generate(args.tokens + 1))
        tpot = (min(fulls) - min(firsts)) / args.tokens

        # the timers wrap Python: the timed steps run the model's forward (an engine without the C++ decoder, which
        # runs the untimed steps above whole) and the packed linear operator's Python implementation where its CPU
        # implementation is C++ (kernels/cpu_ops.cpp)
        llm.shutdown()
        llm = LLM(str(model_dir), dtype=args.dtype, max_num_batched_tokens=2048,
                  max_model_len=config["max_position_embeddings"], enable_prefix_caching=False, seed=0,
                  compile=args.compile == "true", native_decode=False)
        python_linear = torch.library.Library("torch_shift", "IMPL")  # noqa: TOR901 (kept until the process ends)
        python_linear.impl("packed_linear", lambda x, handle, out_features, bias: packed_weight(handle).run(
            x.contiguous(), bias), "CPU")
        for weight in list(_packed_by_handle.values()):
            weight.native = False
        # and the attention calls their Python path (a compiled CPU forward's run in C++ otherwise)
        CpuPagedAttention.install_native = lambda self: False
        timers = Timers()
        timers.wrap(PackedWeight, "run", "matmul", count_bytes=True)
        timers.wrap(CpuPagedAttention, "__call__", "attention")
        if args.compile == "true":
            timers.wrap(CompiledForward, "__call__", "forward")
        else:  # a compiled forward traced DecoderLM.forward: wrapped, it would not be the code the graph holds
            timers.wrap(DecoderLM, "forward", "forward")
        timers.wrap(DecoderLM, "compute_logits", "logits")
        timers.wrap(ModelRunner, "execute", "runner")
        timers.wrap(EngineCore, "step", "step")
        generate(2)
        timers.skip_first_step(EngineCore)  # the prompt's prefill: the steps after it decode one token each
        generate(args.tokens + 1)
        llm.shutdown()

    ns, calls = timers.ns, timers.calls
    steps = calls["step"]
    per_step = {part: ns.get(part, 0) / steps / 1e6 for part in ("matmul", "attention", "forward", "logits",
                                                                   "runner", "step")}  # ms
    # the LM head runs after the forward (compute_logits), its matmul among the packed matmuls
    model_ms = per_step["forward"] + per_step["logits"]
    parts = [
        ("packed matmuls (the LM head's included)", per_step["matmul"]),
        ("attention", per_step["attention"]),
        ("rest of the forward and the LM head", model_ms - per_step["matmul"] - per_step["attention"]),
        ("runner around the model", per_step["runner"] - model_ms),
        ("engine around the runner", per_step["step"] - per_step["runner"]),
    ]
    read_gbps = timers.bytes_read / (ns["matmul"] / 1e9) / 1e9
    print(f"model: hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, {args.dtype}, "
          f"compile {args.compile}; {steps} steps of one token after the prompt's")
    print(f"TPOT without timers: {tpot * 1e3:.2f} ms; with timers: {per_step['step']:.2f} ms a step")
    print(f"streaming read of this machine: {bandwidth / 1e9:.1f} GB/s; the matmuls read "
          f"{timers.bytes_read / steps / 1e6:.0f} MB a step at {read_gbps:.1f} GB/s "
          f"({bandwidth / 1e9 / read_gbps:.2f}x the streaming read's time)")
    print("| part | ms a step | share |\n| --- | --- | --- |")
    for name, ms in parts:
        print(f"| {name} | {ms:.2f} | {ms / per_step['step']:.0%} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"tpot_s": tpot, "per_step_ms": dict(parts),
                                               "matmul_gbps": read_gbps, "read_bandwidth": bandwidth,
                                               "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
