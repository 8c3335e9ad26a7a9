"""Latency and throughput report of a serving benchmark: summary statistics, a timeline, a figure and tables.

Input: one dict per request, all times in seconds from the run's start:
    {"config", "id", "arrival_s", "start_s", "first_token_s" (or None), "token_times_s" (one per token),
     "end_s", "prompt_tokens", "output_tokens", "status", "error" (or None)}

A request succeeded when its status is 200 and it has no error; latencies and throughputs count succeeded requests
only, while the load (arrivals, requests in flight) counts every request. Latencies are in milliseconds, as
{"mean", "p50", "p90", "p99", "max"} with linearly interpolated percentiles (numpy's default), or None when there is
no sample. Peak throughput is the largest 1-second window [k, k+1) of the run; prompt tokens count at the request's
first token.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms")


def succeeded(record: dict) -> bool:
    return record["status"] == 200 and not record["error"]


def latency_stats(seconds: list[float]) -> dict:
    if not seconds:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    ms = np.asarray(seconds, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(ms.max())}


def _tpot_s(record: dict) -> float | None:
    if record["output_tokens"] < 2:
        return None
    token_times = record["token_times_s"]
    return (token_times[-1] - token_times[0]) / (record["output_tokens"] - 1)


def _bin_index(times, bin_s: float) -> np.ndarray:
    return np.floor(np.asarray(times, dtype=float) / bin_s).astype(np.int64)


def _bin(t: float, bin_s: float) -> int:
    return math.floor(t / bin_s)  # not t // bin_s, which can differ from _bin_index (1.0 // 0.1 == 9.0)


def _tokens_per_bin(records: list[dict], bin_s: float, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """(output tokens, prompt tokens) per bin: each token at its arrival, a prompt at the request's first token."""
    token_times = [t for r in records for t in r["token_times_s"]]
    output = np.bincount(_bin_index(token_times, bin_s), minlength=n_bins)[:n_bins]
    with_first = [r for r in records if r["first_token_s"] is not None]
    prompt = np.bincount(_bin_index([r["first_token_s"] for r in with_first], bin_s),
                         weights=[r["prompt_tokens"] for r in with_first], minlength=n_bins)[:n_bins]
    return output, prompt


def summarize(records: list[dict]) -> dict:
    """Counts, latency statistics and throughputs of one configuration's requests."""
    ok = [r for r in records if succeeded(r)]
    failed_by_status = Counter(str(r["status"]) for r in records if not succeeded(r))
    summary = {
        "total": len(records),
        "succeeded": len(ok),
        "failed_by_status": dict(sorted(failed_by_status.items())),
        "ttft_ms": latency_stats([r["first_token_s"] - r["start_s"] for r in ok if r["first_token_s"] is not None]),
        "tpot_ms": latency_stats([tpot for r in ok if (tpot := _tpot_s(r)) is not None]),
        "itl_ms": latency_stats([float(gap) for r in ok for gap in np.diff(r["token_times_s"])]),
        "e2e_ms": latency_stats([r["end_s"] - r["start_s"] for r in ok]),
        "queue_ms": latency_stats([r["start_s"] - r["arrival_s"] for r in ok]),
        "makespan_s": None,
        "input_tok_s": None, "output_tok_s": None, "total_tok_s": None,
        "peak_output_tok_s": None, "peak_total_tok_s": None,
    }
    if not ok:
        return summary
    makespan = max(r["end_s"] for r in ok) - min(r["start_s"] for r in ok)
    input_tokens = sum(r["prompt_tokens"] for r in ok)
    output_tokens = sum(r["output_tokens"] for r in ok)
    summary["makespan_s"] = makespan
    if makespan > 0:
        summary["input_tok_s"] = input_tokens / makespan
        summary["output_tok_s"] = output_tokens / makespan
        summary["total_tok_s"] = (input_tokens + output_tokens) / makespan
    n_windows = _bin(max(r["end_s"] for r in ok), 1.0) + 1
    output, prompt = _tokens_per_bin(ok, 1.0, n_windows)
    summary["peak_output_tok_s"] = float(output.max())
    summary["peak_total_tok_s"] = float((output + prompt).max())
    return summary


def timeline(records: list[dict], bin_s: float = 1.0) -> list[dict]:
    """Per bin [start_s, start_s + bin_s) from 0 to the last end: load, mean latencies and throughput.

    arrivals and in_flight (at the bin's midpoint) count every request; ttft_ms is the mean over succeeded requests
    whose first token came in the bin, tpot_ms over those that ended in it (None when there are none).
    """
    if not records:
        return []
    n_bins = _bin(max(r["end_s"] for r in records), bin_s) + 1
    arrivals = np.bincount(_bin_index([r["arrival_s"] for r in records], bin_s), minlength=n_bins)
    ok = [r for r in records if succeeded(r)]
    output, prompt = _tokens_per_bin(ok, bin_s, n_bins)

    ttfts = [[] for _ in range(n_bins)]
    tpots = [[] for _ in range(n_bins)]
    for r in ok:
        if r["first_token_s"] is not None:
            ttfts[_bin(r["first_token_s"], bin_s)].append(r["first_token_s"] - r["start_s"])
        if (tpot := _tpot_s(r)) is not None:
            tpots[_bin(r["end_s"], bin_s)].append(tpot)

    def mean_ms(seconds: list[float]) -> float | None:
        return 1000.0 * sum(seconds) / len(seconds) if seconds else None

    bins = []
    for i in range(n_bins):
        midpoint = (i + 0.5) * bin_s
        bins.append({
            "start_s": i * bin_s,
            "arrivals": int(arrivals[i]),
            "in_flight": sum(1 for r in records if r["start_s"] <= midpoint < r["end_s"]),
            "ttft_ms": mean_ms(ttfts[i]),
            "tpot_ms": mean_ms(tpots[i]),
            "output_tok_s": float(output[i]) / bin_s,
            "total_tok_s": float(output[i] + prompt[i]) / bin_s,
        })
    return bins


def report(records_by_config: dict[str, list[dict]], path_json=None, path_png=None, title: str = "",
           bin_s: float = 1.0) -> dict:
    """Summary and timeline per configuration; optionally written as JSON and as a PNG figure."""
    result = {
        "title": title,
        "bin_s": bin_s,
        "configs": {name: {"summary": summarize(records), "timeline": timeline(records, bin_s)}
                    for name, records in records_by_config.items()},
    }
    if path_json is not None:
        with open(path_json, "w") as f:
            json.dump(result, f, indent=1)
    if path_png is not None:
        plot(result, path_png)
    return result


def _nan_for_none(bins: list[dict], key: str) -> list[float]:
    return [math.nan if b[key] is None else b[key] for b in bins]


def plot(result: dict, path_png) -> None:
    """Four panels over time, one line per configuration: load, TTFT, TPOT, output throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, sharex=True, figsize=(10, 11), dpi=120)
    load, ttft, tpot, throughput = axes
    for i, (name, config) in enumerate(result["configs"].items()):
        bins = config["timeline"]
        color = f"C{i}"
        t = [b["start_s"] + result["bin_s"] / 2 for b in bins]

        load.plot(t, [b["in_flight"] for b in bins], color=color, label=name)
        load.plot(t, [b["arrivals"] / result["bin_s"] for b in bins], color=color, linestyle="--", alpha=0.6)
        ttft.plot(t, _nan_for_none(bins, "ttft_ms"), color=color, marker=".", label=name)
        tpot.plot(t, _nan_for_none(bins, "tpot_ms"), color=color, marker=".", label=name)
        throughput.plot(t, [b["output_tok_s"] for b in bins], color=color, label=name)
    load.set_ylabel("requests in flight (—)\narrivals per s (- -)")
    ttft.set_ylabel("TTFT (ms)")
    tpot.set_ylabel("TPOT (ms)")
    throughput.set_ylabel("output tokens/s")
    throughput.set_xlabel("time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    load.legend(loc="upper right")
    fig.suptitle(result["title"])
    fig.tight_layout()
    fig.savefig(path_png)
    plt.close(fig)


def _cell(value, decimals: int) -> str:
    return "-" if value is None else f"{value:.{decimals}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    return "\n".join(lines)


def format_table(summaries: dict[str, dict]) -> str:
    """One row per configuration; latencies in ms with 1 decimal, throughputs in tokens/s rounded to integers."""
    header = ["config", "TTFT p50 (ms)", "TTFT p90", "TPOT p50", "TPOT p90", "ITL p50", "E2E p50",
              "total tok/s", "peak output tok/s", "ok/total"]
    rows = [[name,
             _cell(s["ttft_ms"]["p50"], 1), _cell(s["ttft_ms"]["p90"], 1),
             _cell(s["tpot_ms"]["p50"], 1), _cell(s["tpot_ms"]["p90"], 1),
             _cell(s["itl_ms"]["p50"], 1), _cell(s["e2e_ms"]["p50"], 1),
             _cell(s["total_tok_s"], 0), _cell(s["peak_output_tok_s"], 0),
             f"{s['succeeded']}/{s['total']}"]
            for name, s in summaries.items()]
    return _table(header, rows)


def format_table5(summaries: dict[str, dict]) -> str:
    """The Shift Parallelism paper's Table 5: median TTFT and TPOT (ms, 1 decimal), peak combined (input + output)
    throughput (tokens/s, integer) per configuration."""
    header = ["config", "median TTFT (ms)", "median TPOT (ms)", "peak input + output tok/s"]
    rows = [[name, _cell(s["ttft_ms"]["p50"], 1), _cell(s["tpot_ms"]["p50"], 1), _cell(s["peak_total_tok_s"], 0)]
            for name, s in summaries.items()]
    return _table(header, rows)
