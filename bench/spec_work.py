"""bench_spec.py's work in token ids, run the same way on torch_shift (bench_spec.py) and on vLLM's CPU build
(peer_vllm_spec.py): this module imports neither engine.

An engine is anything with `generate(prompts, max_tokens, temperature, seed, ignore_eos) -> token ids per prompt`.
TPOT of a prompt is measured alike on both: the time of generating its tokens minus the time of generating its first
one (a run of one token), over the tokens after the first, both timed after an untimed run of one token (`tpot`).
`run_work` takes several engines, all up at once (bench_spec's of several ranks each in a process of its own), and
runs them in turn, prompt by prompt, so that the machine's slow and fast spells (10-35% apart on this CPU) fall on all
of them alike.
"""

from __future__ import annotations

import statistics
import time
from typing import Protocol

AGENT_TURNS = 4
THROUGHPUT_ROUNDS = 3
# each free prompt is sampled under these seeds: over 6 prompts once, a repeat's free-text TPOT ratio moved 0.94-1.08
# between repeats of the same engines, more than the 0.97 it is held to; 18 samples alternated read 1.03
FREE_SEEDS = (3, 4, 5)


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int | None,
                 ignore_eos: bool) -> list[list[int]]: ...


def tpot(engine: Engine, prompt: list[int], max_tokens: int, temperature: float = 0.0,
         seed: int | None = None) -> tuple[float | None, list[int]]:
    """The prompt's TPOT in seconds (None for a single token) and its tokens. A run of one token goes first, untimed:
    where the engine caches prefixes it leaves the prompt's KV cached, so that the two timed runs prefill alike.
    (Timed first, that run prefilled the whole prompt and the full one a cached prompt: the difference counted the
    saved prefill as decode time, 1.0-1.1 ms a token short of the engine's own timestamps on the widened model's edit
    prompts, whose plain TPOT is 4.3-4.5 ms, and a ratio to another engine or method was inflated.)"""
    engine.generate([prompt], 1, temperature, seed, False)
    start = time.perf_counter()
    engine.generate([prompt], 1, temperature, seed, False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    (tokens,) = engine.generate([prompt], max_tokens, temperature, seed, False)
    full = time.perf_counter() - start
    return ((full - first) / (len(tokens) - 1) if len(tokens) > 1 else None), tokens


def in_turn(names: list[str], index: int) -> list[str]:
    """The engines' order at the `index`-th prompt (agent turn, throughput round): row `index` of a Williams square, so
    that over n prompts (2n for an odd n) each engine runs once in each place and once right after each other one. In
    a fixed order, engines read 5-15% apart for their place or their instance (two engines of the same suffix method,
    third and fourth: 1.73 and 1.88 ms; a draft + suffix engine 12% slower than a suffix one when last, 5-8% faster
    when right after the plain one). New engines each repeat (bench_spec) spread the instances'."""
    n = len(names)
    first = [0]  # 0, 1, n - 1, 2, n - 2, ...
    low, high = 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    row = index % (n if n % 2 == 0 else 2 * n)
    order = [names[(i + row) % n] for i in first]
    return order[::-1] if row >= n else order


def agent_loops(engines: dict[str, Engine], work: dict) -> dict[str, list[float | None]]:
    """Turns of an agent: each prompt carries the earlier turns' outputs and an observation; each engine keeps
    its own history (its own outputs), turn by turn in turn. Each engine's TPOT of every turn (None: one token)."""
    tpots: dict[str, list[float | None]] = {name: [] for name in engines}
    turn = 0
    for prompt, observations in zip(work["agent_prompts"], work["agent_observations"]):
        history = {name: list(prompt) for name in engines}
        for observation in observations:
            for name in in_turn(list(engines), turn):
                t, tokens = tpot(engines[name], history[name], 64)
                tpots[name].append(t)
                history[name] += tokens + observation
            turn += 1
    return tpots


def _tpot_columns(work: str, tpots: list[float | None]) -> dict:
    """A row's columns of `work`'s TPOTs (seconds, None for a single token): their mean and each one, in ms."""
    return {f"{work}_tpot_ms": 1e3 * statistics.mean(t for t in tpots if t is not None),
            f"{work}_tpots_ms": [None if t is None else 1e3 * t for t in tpots]}


def run_work(engines: dict[str, Engine], work: dict) -> dict[str, dict]:
    """The three batch-1 workloads (mean TPOT in ms, and each prompt's in order: "agent_tpots_ms" and so on, None
    for a single token; each free prompt under every one of FREE_SEEDS), then 64 sampled requests at once (output
    tok/s, the median of rounds in rotated order), for each engine, the engines in turn at every prompt (in_turn):
    the engines' TPOTs of one prompt were timed within a second or so of each other."""
    rows = {name: _tpot_columns("agent", tpots) for name, tpots in agent_loops(engines, work).items()}
    free = [(prompt, seed) for seed in FREE_SEEDS for prompt in work["free_prompts"]]
    for key, prompts, max_tokens, temperature in (("edit", [(p, None) for p in work["edit_prompts"]], 96, 0.0),
                                                  ("free", free, 64, 0.8)):
        tpots: dict[str, list[float | None]] = {name: [] for name in engines}
        for index, (prompt, seed) in enumerate(prompts):
            for name in in_turn(list(engines), index):
                tpots[name].append(tpot(engines[name], prompt, max_tokens, temperature, seed)[0])
        for name in engines:
            rows[name].update(_tpot_columns(key, tpots[name]))
    # the 64-request batch THROUGHPUT_ROUNDS times per engine, the order rotated each round (one run each in a fixed
    # order moved a row by up to 30% with the machine's spells): the median. A seed per round: with one seed, a
    # round repeated the last one's sampled outputs, which the suffix method's global tree then held whole (98% of
    # 9,000 proposed tokens accepted under Shift)
    names = list(engines)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(max(THROUGHPUT_ROUNDS, len(names))):
        for name in in_turn(names, round_index):
            start = time.perf_counter()
            outputs = engines[name].generate(work["throughput_prompts"], 96, 0.8, 7 + round_index, True)
            runs[name].append(sum(map(len, outputs)) / (time.perf_counter() - start))
    for name in names:
        rows[name]["throughput_64"] = statistics.median(runs[name])
    return rows
