"""Speculative decoding (issue 22): TPOT at batch 1 and throughput at 64 running requests, with and without each
method, on the default model (trained), one process and two ranks under Shift, with the acceptance measured.

Workloads, repetition coming from the task:
- agent: a loop of turns, each prompt carrying the earlier turns' outputs and an observation (as an agent's does);
- edit: a document the model wrote, then "revise it" with its first line: the output is the document, edited;
- free: short prompts, sampled (temperature 0.8): no repetition to find.
Also the proposer's own cost at 256 running requests (every step proposes for every request).

The draft model (method "draft"): the default model's first `--draft-layers` layers with its final norm and head
(LayerSkip's early exit as a checkpoint of its own: the only smaller model with this tokenizer), unless
`--draft DIR` names another.

    python bench/bench_spec.py [--layouts one,shift] [--methods none,ngram,suffix,draft] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from torch_shift import LLM, SamplingParams

METHODS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 16},
}
DRAFT_K = 4
LAYOUTS = {"one": {}, "shift": {"sp": 2, "shift_threshold": 32}}
SEEDS = ["And God said", "In the beginning", "And it came to pass", "Then the LORD", "And Moses spake",
         "And the king", "Now the sons of", "And he said unto them"]


def truncated_draft(model_dir: Path, out: Path, num_layers: int) -> Path:
    """`model_dir`'s first `num_layers` layers, its embedding, final norm and head, as a checkpoint with its
    tokenizer."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    if not 1 <= num_layers < config["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers must be in [1, {config['num_hidden_layers'] - 1}]")
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tensors = load_file(model_dir / "model.safetensors")
    kept = {name: t for name, t in tensors.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out


def documents(llm: LLM, num: int) -> list[str]:
    params = SamplingParams(max_tokens=120, temperature=0.7, seed=1)
    return [o.outputs[0].text for o in llm.generate(SEEDS[:num], params, use_tqdm=False)]


def run_batch1(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[float], list[str]]:
    """Each prompt alone; TPOT of each (time after the first token over the tokens after it)."""
    tpots, texts = [], []
    for prompt in prompts:
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        end = time.monotonic()
        n = len(out.outputs[0].token_ids)
        if n > 1:
            tpots.append((end - out.metrics["first_token_time"]) / (n - 1))
        texts.append(out.outputs[0].text)
    return tpots, texts


def agent_loop(llm: LLM, turns: int = 4) -> list[float]:
    tpots = []
    params = SamplingParams(max_tokens=64, temperature=0.0)
    for seed in SEEDS[:3]:
        history = f"Task: continue the chronicle.\n{seed}"
        for turn in range(turns):
            t, (text,) = run_batch1(llm, [history], params)
            tpots += t
            history += text + f"\nObservation: step {turn} recorded.\n{seed}"
    return tpots


def throughput(llm: LLM, num: int = 64) -> float:
    prompts = [SEEDS[i % len(SEEDS)] + "," * (i // len(SEEDS)) for i in range(num)]
    params = SamplingParams(max_tokens=96, temperature=0.8, seed=7, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def proposer_cost(num_requests: int = 256, context: int = 1500) -> dict:
    """Speculator.propose over `num_requests` running requests of `context` tokens each, as after a decode step."""
    from torch_shift.engine.request import Request
    from torch_shift.engine.spec_decode import SpeculativeConfig, Speculator

    rng = np.random.default_rng(0)
    result = {}
    for name in ("ngram", "suffix"):
        speculator = Speculator(SpeculativeConfig.from_user(METHODS[name]), 1 << 20)
        requests = []
        for i in range(num_requests):
            phrase = rng.integers(10, 3000, 40).tolist()
            tokens = (phrase * (context // 40 + 1))[:context] if i % 2 else rng.integers(10, 3000, context).tolist()
            requests.append(Request(f"r{i}", tokens, SamplingParams(max_tokens=10_000), 10_000))
        if name == "suffix":  # a global tree of 2000 earlier outputs of 200 tokens
            for _ in range(2000):
                speculator.proposer.global_tree.add(rng.integers(10, 3000, 200).tolist())
        speculator.propose(requests, num_requests)  # first contact: buffers built
        times = []
        for step in range(20):
            for r in requests:
                r.all_token_ids.append(int(rng.integers(10, 3000)))
            start = time.perf_counter()
            speculator.propose(requests, num_requests)
            times.append(time.perf_counter() - start)
        result[name] = statistics.median(times)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="one,shift")
    parser.add_argument("--methods", default="none,ngram,suffix")
    parser.add_argument("--json", default=None)
    parser.add_argument("--draft", type=Path, default=None, help="the draft model of method 'draft'")
    parser.add_argument("--draft-layers", type=int, default=1)
    args = parser.parse_args()
    if "draft" in args.methods.split(","):
        from torch_shift.models.default import default_model_dir

        draft_dir = args.draft or truncated_draft(default_model_dir(), Path(tempfile.mkdtemp()) / "draft",
                                                  args.draft_layers)
        METHODS["draft"] = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": DRAFT_K}
    figures: dict = {"proposer_s_at_256": proposer_cost()}
    print("proposing for 256 running requests of 1500 tokens: "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in figures["proposer_s_at_256"].items()), flush=True)
    docs = documents(LLM(compile=False), 4)
    edit_prompts = [f"{doc}\n\nThe same, revised:\n{doc.split(chr(10))[0]}" for doc in docs]
    free_prompts = SEEDS[:6]
    rows = []
    for layout in args.layouts.split(","):
        for method in args.methods.split(","):
            llm = LLM(compile=False, speculative_config=METHODS[method], **LAYOUTS[layout])
            llm.generate(SEEDS[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
            row = {"layout": layout, "method": method}
            row["agent_tpot_ms"] = 1e3 * statistics.mean(agent_loop(llm))
            tpots, _ = run_batch1(llm, edit_prompts, SamplingParams(max_tokens=96, temperature=0.0))
            row["edit_tpot_ms"] = 1e3 * statistics.mean(tpots)
            tpots, _ = run_batch1(llm, free_prompts, SamplingParams(max_tokens=64, temperature=0.8, seed=3))
            row["free_tpot_ms"] = 1e3 * statistics.mean(tpots)
            row["throughput_64"] = throughput(llm)
            spec = llm.stats()["spec_decode"]
            row["acceptance_rate"] = spec and spec["acceptance_rate"]
            row["mean_accepted_length"] = spec and spec["mean_accepted_length"]
            llm.shutdown()
            rows.append(row)
            print(json.dumps(row), flush=True)
    figures["rows"] = rows
    print("\n| layout | method | agent TPOT ms | edit TPOT ms | free TPOT ms | tok/s at 64 | accepted | "
          "x none: agent / edit / free TPOT, throughput |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = {r["layout"]: r for r in rows if r["method"] == "none"}
    for r in rows:
        b = base.get(r["layout"])
        ratios = "" if b is None else (f"{b['agent_tpot_ms'] / r['agent_tpot_ms']:.2f} / "
                                       f"{b['edit_tpot_ms'] / r['edit_tpot_ms']:.2f} / "
                                       f"{b['free_tpot_ms'] / r['free_tpot_ms']:.2f}, "
                                       f"{r['throughput_64'] / b['throughput_64']:.2f}")
        accepted = "" if r["acceptance_rate"] is None else (f"{r['acceptance_rate']:.2f} "
                                                            f"({r['mean_accepted_length']:.2f}/check)")
        print(f"| {r['layout']} | {r['method']} | {r['agent_tpot_ms']:.2f} | {r['edit_tpot_ms']:.2f} | "
              f"{r['free_tpot_ms']:.2f} | {r['throughput_64']:.0f} | {accepted} | {ratios} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
