"""One engine, one setting switched on and off between generations of the same prompt, pairs in alternating order
(bench_decode_pool.py, bench_native_decoder.py): this machine's slow and fast spells (10-35% apart) fall on both
settings alike, which separate processes cannot promise."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def alternate_generations(llm, prompt: dict, params, switch: Callable[[bool], None],
                          pairs: int) -> dict[bool, list[tuple[float, object]]]:
    """Per setting (True, False): `pairs` generations of `prompt`, each as (its median engine step in seconds after
    the prompt and the first decode, its completion), after one warm-up generation of each."""
    steps: list[float] = []
    engine_step = llm.engine.step

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        out = engine_step(*args, **kwargs)
        steps.append(time.perf_counter() - start)
        return out

    def generation(on: bool) -> tuple[float, object]:
        switch(on)
        steps.clear()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        return statistics.median(steps[2:]), out.outputs[0]

    llm.engine.step = timed_step
    try:
        generation(True), generation(False)
        results: dict[bool, list[tuple[float, object]]] = {True: [], False: []}
        for i in range(pairs):
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                results[on].append(generation(on))
    finally:
        del llm.engine.step
    return results


def per_pair_ratios(results: dict[bool, list[tuple[float, object]]]) -> tuple[list[float], list[float], list[float]]:
    """The median steps of each setting in ms, and the per-pair ratios of on to off."""
    on_ms = [1e3 * s for s, _ in results[True]]
    off_ms = [1e3 * s for s, _ in results[False]]
    return on_ms, off_ms, [a / b for a, b in zip(on_ms, off_ms)]
