"""bench_spec.py's work in token ids, run the same way on torch_shift (bench_spec.py) and on vLLM's CPU build
(peer_vllm_spec.py): this module imports neither engine.

An engine is anything with `generate(prompts, max_tokens, temperature, seed, ignore_eos) -> token ids per prompt`.
TPOT of a prompt is measured alike on both: the time of generating its tokens minus the time of generating its first
one (a run of one token), over the tokens after the first.
"""

from __future__ import annotations

import statistics
import time
from typing import Protocol

AGENT_TURNS = 4


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int | None,
                 ignore_eos: bool) -> list[list[int]]: ...


def tpot(engine: Engine, prompt: list[int], max_tokens: int, temperature: float = 0.0,
         seed: int | None = None) -> tuple[float | None, list[int]]:
    start = time.perf_counter()
    engine.generate([prompt], 1, temperature, seed, False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    (tokens,) = engine.generate([prompt], max_tokens, temperature, seed, False)
    full = time.perf_counter() - start
    return ((full - first) / (len(tokens) - 1) if len(tokens) > 1 else None), tokens


def agent_loop(engine: Engine, work: dict) -> list[float]:
    """Turns of an agent: each prompt carries the earlier turns' outputs and an observation."""
    tpots = []
    for prompt, observations in zip(work["agent_prompts"], work["agent_observations"]):
        history = list(prompt)
        for observation in observations:
            t, tokens = tpot(engine, history, 64)
            tpots += [t] if t is not None else []
            history += tokens + observation
    return tpots


def run_work(engine: Engine, work: dict) -> dict:
    """The three batch-1 workloads (mean TPOT in ms), then 64 sampled requests at once (output tok/s)."""
    row = {"agent_tpot_ms": 1e3 * statistics.mean(agent_loop(engine, work))}
    tpots = [tpot(engine, p, 96)[0] for p in work["edit_prompts"]]
    row["edit_tpot_ms"] = 1e3 * statistics.mean(t for t in tpots if t is not None)
    tpots = [tpot(engine, p, 64, temperature=0.8, seed=3)[0] for p in work["free_prompts"]]
    row["free_tpot_ms"] = 1e3 * statistics.mean(t for t in tpots if t is not None)
    start = time.perf_counter()
    outputs = engine.generate(work["throughput_prompts"], 96, 0.8, 7, True)
    row["throughput_64"] = sum(map(len, outputs)) / (time.perf_counter() - start)
    return row
