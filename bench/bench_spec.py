"""Speculative decoding (issue 22): TPOT at batch 1 and throughput at 64 running requests, with and without each
method, on the default model (trained), one process and two ranks under Shift, with the acceptance measured.

Workloads, repetition coming from the task:
- agent: a loop of turns, each prompt carrying the earlier turns' outputs and an observation (as an agent's does);
- edit: a document the model wrote, then "revise it" with its first line: the output is the document, edited;
- free: short prompts, sampled (temperature 0.8): no repetition to find.
Also the proposer's own cost at 256 running requests (every step proposes for every request), and each method's
ceiling on the batch-1 greedy work: the tokens a step would make if every proposal were checked for free (the
greedy outputs without speculation, replayed through the proposer), which bounds its TPOT ratio to no speculation.

The draft model (method "draft"): the default model's first `--draft-layers` layers with its final norm and head
(LayerSkip's early exit as a checkpoint of its own: the only smaller model with this tokenizer), unless
`--draft DIR` names another; with `--draft-intermediate N` its MLPs widened as the target's (below), so that its
forwards read their weights from memory as a larger draft's do. Method "draft+suffix": the same draft with suffix
decoding beside it (`enable_suffix_decoding`, as ArcticInference: a request's suffix draft where it is expected to
keep the draft's k tokens, else the draft model's where the budget finds that its forwards pay).

A method named with ":sync" (e.g. "suffix:sync") runs with `async_scheduling=False`: beside the default, where one
rank's steps after which nothing is proposed run ahead of the host (torch_shift.engine.core), it shows what that gains.

    python bench/bench_spec.py [--layouts one,shift] [--methods none,ngram,suffix,draft,draft+suffix] [--repeats 3]
                               [--intermediate 24576] [--draft DIR | --draft-layers N] [--draft-intermediate N]
                               [--vllm-python VENV/bin/python] [--json out.json]

Each repeat's ratios are printed beside the machine's read rate before and after it (a sum over 1 GiB) and the plain
engine's TPOT, and each method's ratios over the repeats in which a prompt's plain TPOT was below, then above, that
prompt's median over the repeats (ratios_below_and_above_median): a plain step reads the weights, a check's rows also
multiply, so the ratios follow the read rate, which on the machine of docs/performance.md flips between two levels
every 10-40 s.

With --intermediate, the target is the default model widened (`widened`): the same function with weights read from
memory at every step, as a larger model's, where the issue's premise (decode bound by reading weights) holds; its
draft is then the default model itself.

With --vllm-python, vLLM's CPU build runs the same work in token ids (spec_work.py, peer_vllm_spec.py) for the
methods it has (none and ngram; suffix where that environment also holds ArcticInference, whose suffix tree vLLM's
suffix method runs), and each row shows its ratio to vLLM's row of the same method.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_peers import run_json_process
from peer_vllm import read_bandwidth
from spec_work import AGENT_TURNS, run_work

from torch_shift import LLM, SamplingParams

METHODS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 16},
}
DRAFT_K = 4
VLLM_METHODS = ("none", "ngram")  # those vLLM's CPU build runs; suffix with ArcticInference (vllm_methods)
LAYOUTS = {"one": {}, "shift": {"sp": 2, "shift_threshold": 32}}
MODEL_DIR: str | None = None  # the target model (main sets it: the default model, or it widened)
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


def widened(model_dir: Path, out: Path, intermediate: int, seed: int = 0) -> Path:
    """`model_dir` with every MLP widened to `intermediate` neurons whose outputs the down projection multiplies by
    zero: the same function (the added products are exact zeros, summed after the model's own), with weights that
    read like a larger model's. The default model's weights (4 MB) stay in this CPU's caches, so its decode step is
    bound by its per-step work, not by reading weights as a real LLM's is; widened, its step streams them from
    memory as the issue's premise has it, while every proposal is accepted as often as the trained model accepts
    it."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    extra = intermediate - config["intermediate_size"]
    if extra <= 0:
        raise SystemExit(f"--intermediate must exceed the model's {config['intermediate_size']}")
    config["intermediate_size"] = intermediate
    (out / "config.json").write_text(json.dumps(config, indent=1))
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(model_dir / "model.safetensors")
    for name in list(tensors):
        weight = tensors[name]
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            added = torch.randn(extra, weight.shape[1], generator=generator) * weight.float().std()
            tensors[name] = torch.cat([weight, added.to(weight.dtype)])
        elif name.endswith("mlp.down_proj.weight"):
            tensors[name] = torch.cat([weight, weight.new_zeros(weight.shape[0], extra)], dim=1)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out


def documents(llm: LLM, num: int) -> list[str]:
    params = SamplingParams(max_tokens=120, temperature=0.7, seed=1)
    return [o.outputs[0].text for o in llm.generate(SEEDS[:num], params, use_tqdm=False)]


class TorchShiftEngine:
    """spec_work's engine: token-id prompts through LLM.generate."""

    def __init__(self, llm: LLM):
        self.llm = llm

    def generate(self, prompts, max_tokens, temperature, seed, ignore_eos):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=ignore_eos)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]


def make_work(llm: LLM) -> dict:
    """The workloads in token ids (spec_work.py), from text prompts and the default model's own documents."""
    tokenizer = llm.tokenizer
    docs = documents(llm, 4)
    work = {"edit_prompts": [f"{doc}\n\nThe same, revised:\n{doc.split(chr(10))[0]}" for doc in docs],
            "free_prompts": SEEDS[:6],
            "throughput_prompts": [SEEDS[i % len(SEEDS)] + "," * (i // len(SEEDS)) for i in range(64)],
            "agent_prompts": [f"Task: continue the chronicle.\n{seed}" for seed in SEEDS[:3]]}
    work = {key: [tokenizer.encode(text) for text in texts] for key, texts in work.items()}
    work["agent_observations"] = [[tokenizer.encode(f"\nObservation: step {turn} recorded.\n{seed}",
                                                    add_special_tokens=False) for turn in range(AGENT_TURNS)]
                                  for seed in SEEDS[:3]]
    return work


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


def greedy_turns(llm: LLM, work: dict) -> dict[str, list[tuple[list[int], list[int]]]]:
    """(prompt, greedy output) of each agent turn and edit request, without speculation, as run_work makes them."""
    engine = TorchShiftEngine(llm)
    turns: dict[str, list] = {"agent": [], "edit": []}
    for prompt, observations in zip(work["agent_prompts"], work["agent_observations"]):
        history = list(prompt)
        for observation in observations:
            (output,) = engine.generate([history], 64, 0.0, None, False)
            turns["agent"].append((list(history), output))
            history += output + observation
    for prompt in work["edit_prompts"]:
        turns["edit"].append((list(prompt), engine.generate([prompt], 96, 0.0, None, False)[0]))
    return turns


def acceptance_ceiling(method: str, turns: dict[str, list[tuple[list[int], list[int]]]]) -> dict[str, float]:
    """Tokens per step of each batch-1 greedy workload if every proposal were checked whole and for free: the
    method's proposer replays the greedy outputs (the agent turns, then the edits, each output cached when it
    finishes, as in the engine), a step taking the accepted proposals and one token. The most a TPOT ratio to no
    speculation can reach with this method, model and work, whatever checks cost."""
    from torch_shift.engine.spec_decode import SpeculativeConfig, build_proposer
    from torch_shift.engine.spec_decode.ngram import ngram_proposal
    from torch_shift.engine.spec_decode.suffix import PAD

    config = SpeculativeConfig.from_user(METHODS[method])
    proposer = build_proposer(config)
    k = config.num_speculative_tokens
    ceiling = {}
    for workload, pairs in turns.items():
        num_tokens = num_steps = 0
        for prompt, output in pairs:
            done = 0
            while done < len(output):
                context = np.array(prompt + output[:done], dtype=np.int64)
                room = min(k, len(output) - done - 1)
                if room <= 0:
                    draft = []
                elif method == "ngram":
                    draft = ngram_proposal(context, config.prompt_lookup_min, config.prompt_lookup_max, room)
                else:  # what follows the context reads as PAD, as in the engine's buffers
                    padded = np.concatenate([context, np.full(config.suffix_decoding_max_tree_depth + 2, PAD)])
                    draft = proposer.speculate(context, padded, room).token_ids
                accepted = 0
                while accepted < len(draft) and draft[accepted] == output[done + accepted]:
                    accepted += 1
                done += accepted + 1
                num_steps += 1
            num_tokens += len(output)
            if method == "suffix":
                proposer.global_tree.add(output)
        ceiling[workload] = num_tokens / num_steps
    return ceiling


def start_engine(model_dir: str, method: str, speculative_config: dict | None, layout: dict) -> LLM:
    """`method`'s engine (its configuration `speculative_config`) of `layout`'s engine arguments, warmed up."""
    mode = method.partition(":")[2]
    if mode not in ("", "sync"):
        raise ValueError(f"method {method!r}: the only suffix of a method is ':sync'")
    llm = LLM(model_dir, compile=False, speculative_config=speculative_config,
              async_scheduling=False if mode else None, **layout)
    llm.generate(SEEDS[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    return llm


def _host_engine(connection, model_dir: str, method: str, speculative_config: dict | None, layout: dict) -> None:
    """EngineProcess's process: the engine, then each call that comes through `connection` answered in turn."""
    try:
        llm = start_engine(model_dir, method, speculative_config, layout)
    except BaseException as e:  # noqa: BLE001 - told to the parent, which raises it
        connection.send(("error", f"{type(e).__name__}: {e}"))
        return
    engine = TorchShiftEngine(llm)
    connection.send(("ready", None))
    while True:
        try:
            call, args = connection.recv()
        except EOFError:  # the benchmark ended without shutting its engines down (an error, Ctrl+C)
            llm.shutdown()
            return
        if call == "shutdown":
            llm.shutdown()
            connection.send(("done", None))
            return
        connection.send(("done", engine.generate(*args) if call == "generate" else llm.stats()))


class EngineProcess:
    """An engine of several ranks in a process of its own, so that the engines of several methods (one parallel
    engine per process) stay up together and run_work runs them in turn prompt by prompt, as it runs one process's:
    one engine after the other, Shift's plain TPOT moved 1.9-3.4 ms between the engines' minutes and its ratios with
    it (docs/performance.md). Its calls: an LLM's generate (as TorchShiftEngine), stats and shutdown."""

    def __init__(self, method: str, layout: dict):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        name = method.partition(":")[0]
        self.process = context.Process(target=_host_engine, args=(child, MODEL_DIR, method, METHODS[name], layout))
        self.process.start()
        child.close()
        self._reply()

    def _reply(self):
        kind, value = self.connection.recv()
        if kind == "error":
            self.process.join()
            raise RuntimeError(f"the engine's process failed: {value}")
        return value

    def generate(self, prompts, max_tokens, temperature, seed, ignore_eos):
        self.connection.send(("generate", (prompts, max_tokens, temperature, seed, ignore_eos)))
        return self._reply()

    def stats(self) -> dict:
        self.connection.send(("stats", None))
        return self._reply()

    def shutdown(self) -> None:
        self.connection.send(("shutdown", None))
        self._reply()
        self.process.join()

    def close(self) -> None:
        """Where the benchmark failed: the pipe closed, which shuts the engine down in its process."""
        self.connection.close()
        self.process.join(timeout=60)


def run_methods(layout: str, methods: list[str], work: dict) -> dict[str, dict]:
    """One engine of `layout` per method, made for this run and up together, on the work of spec_work.run_work (run
    in turn prompt by prompt): in this process, or, for a layout of several ranks, each in a process of its own
    (EngineProcess)."""
    def finish(llm: LLM | EngineProcess, row: dict) -> dict:
        spec = llm.stats()["spec_decode"]
        row["acceptance_rate"] = spec and spec["acceptance_rate"]
        row["mean_accepted_length"] = spec and spec["mean_accepted_length"]
        row["stages_by_rows"] = spec and spec["stages_by_rows"]
        llm.shutdown()
        return row

    if LAYOUTS[layout]:
        engines = {}
        try:
            for method in methods:
                engines[method] = EngineProcess(method, LAYOUTS[layout])
            rows = run_work(engines, work)
        except BaseException:
            for engine in engines.values():
                engine.close()
            raise
        return {method: finish(engine, rows[method]) for method, engine in engines.items()}
    llms = {method: start_engine(MODEL_DIR, method, METHODS[method.partition(":")[0]], {}) for method in methods}
    rows = run_work({method: TorchShiftEngine(llm) for method, llm in llms.items()}, work)
    return {method: finish(llm, rows[method]) for method, llm in llms.items()}


def vllm_methods(vllm_python: str) -> tuple[str, ...]:
    """The methods of METHODS that the peer's environment runs: suffix decoding needs `arctic_inference` there
    (`pip install arctic-inference`, built from source on the CPU)."""
    import subprocess

    probe = subprocess.run([vllm_python, "-c", "import arctic_inference.suffix_decoding"], capture_output=True,
                           cwd=tempfile.gettempdir())
    return VLLM_METHODS + (("suffix",) if probe.returncode == 0 else ())


def run_vllm(vllm_python: str, method: str, work: dict, timeout_s: float = 1200) -> dict:
    """The same work on vLLM's CPU build in one process on both cores (peer_vllm_spec.py)."""
    model_dir = Path(MODEL_DIR)
    config = json.loads((model_dir / "config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps({"model": str(model_dir), "dtype": config.get("torch_dtype", "bfloat16"),
                                         "max_model_len": config["max_position_embeddings"],
                                         "speculative_config": METHODS[method], "work": work}))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
        row = run_json_process([vllm_python, str(Path(__file__).with_name("peer_vllm_spec.py")), str(spec_path)],
                               env, timeout_s)
    row.pop("engine")
    return row


def ratios_below_and_above_median(plain: list[dict], method: list[dict], work: str) -> tuple[float, float] | None:
    """A method's TPOT ratio to no speculation (the plain engine's TPOT over the method's, summed) on `work`'s prompts
    (run_work's "<work>_tpots_ms" of each repeat, `plain`'s and `method`'s in the same order), over the repeats in
    which a prompt's plain TPOT was below the median of that prompt's plain TPOTs over the repeats, then over those in
    which it was above (prompts differ in length: a long one is not a slow spell; a repeat at the median is in
    neither). None where either side has no timing."""
    key = f"{work}_tpots_ms"
    runs = [list(zip(base[key], run[key])) for base, run in zip(plain, method)]
    fast, slow = [], []
    for index in range(min(map(len, runs), default=0)):
        timed = [run[index] for run in runs if None not in run[index]]
        if timed:
            median = statistics.median(p for p, _ in timed)
            fast += [(p, m) for p, m in timed if p < median]
            slow += [(p, m) for p, m in timed if p > median]
    if not fast or not slow:
        return None

    def ratio(side):
        return sum(p for p, _ in side) / sum(m for _, m in side)

    return ratio(fast), ratio(slow)


def stages_table(repeats: list[dict]) -> str:
    """LLM.stats()["spec_decode"]["stages_by_rows"] of each repeat summed: for each row count, its stages, their mean
    time (as the speculator priced them: the decoder's seconds and a share of the check's host time) against the
    one-row stages' (a stage that decodes its token alone: a plain step's work), and the proposals a stage accepted.
    What a check's rows cost on this machine, beside the budget's choices (docs/performance.md)."""
    totals: dict[int, list[float]] = {}
    for stages in repeats:
        for rows, figures in stages.items():
            total = totals.setdefault(int(rows), [0, 0.0, 0.0])
            total[0] += figures["stages"]
            total[1] += figures["mean_seconds"] * figures["stages"]
            total[2] += figures["mean_accepted"] * figures["stages"]
    one_row = totals[1][1] / totals[1][0] if 1 in totals else None
    return "; ".join(
        f"{rows}: {num} x {seconds / num * 1e3:.2f} ms"
        + (f" ({seconds / num / one_row:.2f}x)" if one_row else "") + f", {accepted / num:.2f} accepted"
        for rows, (num, seconds, accepted) in sorted(totals.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="one,shift")
    parser.add_argument("--methods", default="none,ngram,suffix")
    parser.add_argument("--json", default=None)
    parser.add_argument("--draft", type=Path, default=None, help="the draft model of method 'draft'")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="the draft is the default model's first this many layers (default: 1, or with "
                             "--intermediate the whole default model)")
    parser.add_argument("--draft-intermediate", type=int, default=None,
                        help="the draft's MLPs widened to this many neurons (as --intermediate widens the target's)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every method, in turn (medians shown)")
    parser.add_argument("--vllm-python", default=None,
                        help="python of a virtual environment with vllm-cpu: vLLM's methods run on the same work, one "
                             "process on both cores, beside each torch_shift run of layout 'one'")
    parser.add_argument("--suffix-spec-factor", type=float, default=None,
                        help="suffix_decoding_max_spec_factor of method 'suffix' (its default: 1, as vLLM's and "
                             "ArcticInference's): the longest proposal is this times the match's length")
    parser.add_argument("--intermediate", type=int, default=None,
                        help="run the default model with its MLPs widened to this many neurons that multiply by zero "
                             "(widened()): the same outputs, its weights read from memory at every step as a larger "
                             "model's; its draft (method 'draft') is then the default model itself")
    args = parser.parse_args()
    from torch_shift.models.default import default_model_dir

    global MODEL_DIR
    MODEL_DIR = str(default_model_dir())
    if args.suffix_spec_factor is not None:
        METHODS["suffix"] = {**METHODS["suffix"], "suffix_decoding_max_spec_factor": args.suffix_spec_factor}
    if args.intermediate is not None:
        MODEL_DIR = str(widened(default_model_dir(), Path(tempfile.mkdtemp()) / "widened", args.intermediate))
    if {"draft", "draft+suffix"} & {method.partition(":")[0] for method in args.methods.split(",")}:
        draft_dir = args.draft
        if draft_dir is None:
            draft_dir = (default_model_dir() if args.intermediate is not None and args.draft_layers is None else
                         truncated_draft(default_model_dir(), Path(tempfile.mkdtemp()) / "draft",
                                         args.draft_layers or 1))
        if args.draft_intermediate is not None:
            draft_dir = widened(draft_dir, Path(tempfile.mkdtemp()) / "draft-widened", args.draft_intermediate)
        METHODS["draft"] = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": DRAFT_K}
        METHODS["draft+suffix"] = {**METHODS["draft"], "enable_suffix_decoding": True}
        if args.suffix_spec_factor is not None:
            METHODS["draft+suffix"]["suffix_decoding_max_spec_factor"] = args.suffix_spec_factor
    figures: dict = {"proposer_s_at_256": proposer_cost()}
    print("proposing for 256 running requests of 1500 tokens: "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in figures["proposer_s_at_256"].items()), flush=True)
    plain = LLM(MODEL_DIR, compile=False)
    work = make_work(plain)
    turns = greedy_turns(plain, work)
    plain.shutdown()
    figures["ceiling_tokens_per_step"] = {m: acceptance_ceiling(m, turns) for m in args.methods.split(",")
                                          if m in ("ngram", "suffix")}
    for method, ceiling in figures["ceiling_tokens_per_step"].items():
        print(f"{method} with every proposal checked for free: agent {ceiling['agent']:.2f}, edit "
              f"{ceiling['edit']:.2f} tokens per step (the most its TPOT ratio to none can reach here)", flush=True)
    rows = []
    spells = []  # per layout: each repeat's read rates, and every engine's results
    peer_methods = vllm_methods(args.vllm_python) if args.vllm_python else ()
    for layout in args.layouts.split(","):
        # every method's engine made afresh for every repeat (no suffix tree remembers an earlier repeat), all up at
        # once and run in turn prompt by prompt (spec_work.run_work); medians over repeats
        runs: dict[tuple[str, str], list[dict]] = {}
        read_rates: list[tuple[float, float]] = []  # the machine's read rate before and after each repeat
        for repeat in range(args.repeats):
            before = read_bandwidth()
            results = run_methods(layout, args.methods.split(","), work)
            read_rates.append((before, read_bandwidth()))
            if args.vllm_python and layout == "one":
                for method in args.methods.split(","):
                    if method in peer_methods:
                        results[f"vllm {method}"] = run_vllm(args.vllm_python, method, work)
            for name, result in results.items():
                engine, method = name.split(" ") if name.startswith("vllm ") else ("torch_shift", name)
                runs.setdefault((engine, method), []).append(result)
                print(json.dumps({"engine": engine, "layout": layout, "method": method, "repeat": repeat, **result}),
                      flush=True)
        spells.append((layout, read_rates, runs))
        for (engine, method), results in runs.items():
            row = {"engine": engine, "layout": layout, "method": method, "repeats": results}
            for key in results[0]:
                if key.endswith("_tpots_ms") or key == "stages_by_rows":  # in "repeats" only
                    continue
                values = [r[key] for r in results if r[key] is not None]
                row[key] = statistics.median(values) if values else None
            rows.append(row)
    figures["rows"] = rows
    print("\n| engine | layout | method | agent TPOT ms | edit TPOT ms | free TPOT ms | tok/s at 64 | accepted | "
          "x none: agent / edit / free TPOT, throughput | x vLLM, same method: agent / edit / free TPOT, throughput |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    by_key = {(r["engine"], r["layout"], r["method"]): r for r in rows}

    def ratios(r: dict, b: dict | None) -> str:  # TPOT: b's over r's; throughput: r's over b's (> 1: r faster)
        if b is None or b is r:
            return ""
        return (f"{b['agent_tpot_ms'] / r['agent_tpot_ms']:.2f} / {b['edit_tpot_ms'] / r['edit_tpot_ms']:.2f} / "
                f"{b['free_tpot_ms'] / r['free_tpot_ms']:.2f}, {r['throughput_64'] / b['throughput_64']:.2f}")

    for r in rows:
        accepted = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        if r["mean_accepted_length"] is not None:
            accepted += f" ({r['mean_accepted_length']:.2f}/check)"
        peer = by_key.get(("vllm", r["layout"], r["method"])) if r["engine"] == "torch_shift" else None
        print(f"| {r['engine']} | {r['layout']} | {r['method']} | {r['agent_tpot_ms']:.2f} | {r['edit_tpot_ms']:.2f} | "
              f"{r['free_tpot_ms']:.2f} | {r['throughput_64']:.0f} | {accepted} | "
              f"{ratios(r, by_key.get((r['engine'], r['layout'], 'none')))} | {ratios(r, peer)} |")
    # the ratios follow the machine's read rate, which moves between repeats (docs/performance.md, eighty-sixth
    # session): each repeat's beside its rate and the plain engine's TPOT; then each prompt's TPOT beside the plain
    # engine's of the same prompt (timed within a second or so: one spell; the read rate holds each of its levels for
    # 10-40 s here), split by the plain engine's TPOT
    for layout, read_rates, runs in spells:
        plain = runs.get(("torch_shift", "none"))
        if plain is None:
            continue
        for repeat, (before, after) in enumerate(read_rates):
            base = plain[repeat]
            per_method = "; ".join(
                method + " " + ", ".join(f"{work} {base[key] / r[repeat][key]:.2f}" for work, key in (
                    ("agent", "agent_tpot_ms"), ("edit", "edit_tpot_ms"), ("free", "free_tpot_ms")))
                for (engine, method), r in runs.items() if engine == "torch_shift" and method != "none")
            print(f"{layout} repeat {repeat}: read {before / 1e9:.0f} / {after / 1e9:.0f} GB/s before / after, plain "
                  f"agent TPOT {base['agent_tpot_ms']:.2f} ms; TPOT x none: {per_method}")
        for (engine, method), results in runs.items():
            if engine != "torch_shift" or method == "none":
                continue
            halves = []
            for work in ("agent", "edit", "free"):
                split = ratios_below_and_above_median(plain, results, work)
                if split is not None:
                    halves.append(f"{work} {split[0]:.2f} / {split[1]:.2f}")
            print(f"{layout} {method}, TPOT x none where the plain TPOT was below / above its own prompt's median over "
                  "the repeats: " + "; ".join(halves))
        for (engine, method), results in runs.items():
            table = stages_table([r.get("stages_by_rows") or {} for r in results])
            if table:
                print(f"{layout} {method}, redrafting checks' stages by rows (proposals and the token before them) "
                      "over the repeats: " + table)
    figures["read_bandwidth_per_repeat"] = {layout: read_rates for layout, read_rates, _ in spells}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
