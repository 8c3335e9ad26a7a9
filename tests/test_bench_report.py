"""torch_shift.bench.report against statistics worked out by hand from hand-made request records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torch_shift.bench.report import format_table, format_table5, report, summarize, timeline


def request(id, arrival, start, tokens, end, prompt, status=200, error=None):
    return {"config": "A", "id": id, "arrival_s": arrival, "start_s": start,
            "first_token_s": tokens[0] if tokens else None, "token_times_s": list(tokens), "end_s": end,
            "prompt_tokens": prompt, "output_tokens": len(tokens), "status": status, "error": error}


# Three successes (one of a single token), and four failures whose times would change every statistic if counted:
# the broken stream got a 200 and two tokens before its error, and starts before every success.
RECORDS = [
    request("r1", 0.0, 0.1, [0.3, 0.4, 0.6], 0.7, prompt=100),
    request("r2", 0.5, 0.5, [1.0, 1.5, 1.8], 1.9, prompt=20),
    request("r3", 1.2, 1.25, [1.5], 1.55, prompt=30),
    request("busy1", 0.05, 0.05, [], 0.06, prompt=7, status=429, error="queue full"),
    request("busy2", 1.3, 1.3, [], 1.31, prompt=7, status=429, error="queue full"),
    request("down", 0.9, 0.9, [], 0.95, prompt=7, status=503, error="shutting down"),
    request("broken", 0.0, 0.0, [0.15, 0.25], 0.3, prompt=5, error="stream interrupted"),
]


def approx_stats(mean, p50, p90, p99, max):
    return {key: pytest.approx(value, rel=1e-9) for key, value in
            {"mean": mean, "p50": p50, "p90": p90, "p99": p99, "max": max}.items()}


def test_counts_by_status_and_failures_left_out_of_latencies():
    summary = summarize(RECORDS)
    assert (summary["total"], summary["succeeded"]) == (7, 3)
    assert summary["failed_by_status"] == {"200": 1, "429": 2, "503": 1}


def test_ttft_e2e_and_queueing_percentiles():
    summary = summarize(RECORDS)
    # TTFT 200, 500, 250 ms; sorted 200 250 500: p90 at rank 1.8 = 250 + 0.8 * 250, p99 at 1.98
    assert summary["ttft_ms"] == approx_stats(950 / 3, 250, 450, 495, 500)
    # E2E 600, 1400, 300 ms; sorted 300 600 1400: p90 = 600 + 0.8 * 800, p99 = 600 + 0.98 * 800
    assert summary["e2e_ms"] == approx_stats(2300 / 3, 600, 1240, 1384, 1400)
    # sending delay 100, 0, 50 ms
    assert summary["queue_ms"] == approx_stats(50, 50, 90, 99, 100)


def test_tpot_from_token_times_and_itl_pooled_over_requests():
    summary = summarize(RECORDS)
    # TPOT: r1 (0.6 - 0.3) / 2 = 150 ms, r2 (1.8 - 1.0) / 2 = 400 ms; r3 has a single token
    assert summary["tpot_ms"] == approx_stats(275, 275, 375, 397.5, 400)
    # ITL: r1 gaps 100, 200 and r2 gaps 500, 300 in one pool; sorted 100 200 300 500, p90 at rank 2.7
    assert summary["itl_ms"] == approx_stats(275, 250, 440, 494, 500)


def test_tpot_ignores_the_end_after_the_last_token():
    late_end = [request("r", 0.0, 0.0, [0.1, 0.2, 0.3], 5.0, prompt=1)]
    assert summarize(late_end)["tpot_ms"]["p50"] == pytest.approx(100)


def test_throughput_over_the_makespan_of_successes():
    summary = summarize(RECORDS)
    # first success starts at 0.1, last ends at 1.9; 150 prompt and 7 output tokens
    assert summary["makespan_s"] == pytest.approx(1.8)
    assert summary["input_tok_s"] == pytest.approx(150 / 1.8)
    assert summary["output_tok_s"] == pytest.approx(7 / 1.8)
    assert summary["total_tok_s"] == pytest.approx(157 / 1.8)


def test_peak_one_second_windows():
    summary = summarize(RECORDS)
    # [0, 1): 3 tokens of r1 + its 100 prompt tokens (first token at 0.3); [1, 2): 3 of r2 + 1 of r3, prompts 20 + 30
    assert summary["peak_output_tok_s"] == 4
    assert summary["peak_total_tok_s"] == 103
    assert max(b["output_tok_s"] for b in timeline(RECORDS, bin_s=1.0)) == summary["peak_output_tok_s"]


def test_summary_without_successes():
    summary = summarize(RECORDS[3:6])
    assert summary["succeeded"] == 0 and summary["ttft_ms"]["p50"] is None and summary["peak_output_tok_s"] is None


def test_timeline_bins():
    bins = timeline(RECORDS, bin_s=0.5)
    # the last request ends at 1.9: bins start at 0, 0.5, 1.0, 1.5; midpoints 0.25, 0.75, 1.25, 1.75
    assert [b["start_s"] for b in bins] == [0.0, 0.5, 1.0, 1.5]
    assert [b["arrivals"] for b in bins] == [3, 2, 2, 0]
    # 0.25: r1 and the broken stream; 0.75: r2 (r1 ended at 0.7); 1.25: r2 and r3 (sent at 1.25); 1.75: r2
    assert [b["in_flight"] for b in bins] == [2, 1, 2, 1]
    # first tokens: r1 at 0.3, r2 at 1.0, r3 at 1.5; ends with a TPOT: r1 at 0.7, r2 at 1.9
    assert [b["ttft_ms"] for b in bins] == [pytest.approx(200), None, pytest.approx(500), pytest.approx(250)]
    assert [b["tpot_ms"] for b in bins] == [None, pytest.approx(150), None, pytest.approx(400)]
    # tokens per bin 2, 1, 1, 3; prompt tokens at the first token: 100, 0, 20, 30
    assert [b["output_tok_s"] for b in bins] == [4, 2, 2, 6]
    assert [b["total_tok_s"] for b in bins] == [204, 2, 42, 66]


def shifted(records, seconds):
    def move(t):
        return None if t is None else t + seconds
    return [{**r, "arrival_s": r["arrival_s"] + seconds, "start_s": r["start_s"] + seconds,
             "first_token_s": move(r["first_token_s"]), "token_times_s": [t + seconds for t in r["token_times_s"]],
             "end_s": r["end_s"] + seconds} for r in records]


def test_report_writes_png_and_json(tmp_path: Path):
    records = {"Shift": RECORDS, "TP": shifted(RECORDS, 0.4)}
    result = report(records, path_json=tmp_path / "report.json", path_png=tmp_path / "report.png", title="test")
    assert set(result["configs"]) == {"Shift", "TP"}
    assert result["configs"]["Shift"]["summary"] == summarize(RECORDS)
    assert result["configs"]["TP"]["timeline"] == timeline(records["TP"])
    assert json.loads((tmp_path / "report.json").read_text()) == result
    png = (tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_importing_report_does_not_import_matplotlib():
    path = Path(__file__).parents[1] / "torch_shift" / "bench" / "report.py"
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('report', {str(path)!r})\n"
            "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
            "assert 'matplotlib' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def row_cells(table: str, name: str) -> list[str]:
    return next(line.split() for line in table.splitlines() if line.split()[0] == name)


def test_format_table_rounds_latencies_to_a_tenth_and_throughputs_to_integers():
    summaries = {"Shift": summarize(RECORDS), "TP": summarize(RECORDS[:2])}
    table = format_table(summaries)
    # TTFT p50 p90, TPOT p50 p90, ITL p50, E2E p50, total tok/s (157 / 1.8 = 87.2), peak output tok/s, ok/total
    assert row_cells(table, "Shift") == ["Shift", "250.0", "450.0", "275.0", "375.0", "250.0", "600.0", "87", "4", "3/7"]
    # r1 and r2 only: TTFT 200, 500; E2E 600, 1400; 120 + 6 tokens over 0.1 .. 1.9
    assert row_cells(table, "TP") == ["TP", "350.0", "470.0", "275.0", "375.0", "250.0", "1000.0", "70", "3", "2/2"]


def test_format_table5():
    table = format_table5({"Shift": summarize(RECORDS), "DP": summarize(RECORDS[1:2])})
    header = table.splitlines()[0]
    assert "median TTFT (ms)" in header and "median TPOT (ms)" in header and "peak input + output tok/s" in header
    assert row_cells(table, "Shift") == ["Shift", "250.0", "275.0", "103"]
    # r2 alone: TTFT 500, TPOT 400, 3 tokens + 20 prompt tokens in [1, 2)
    assert row_cells(table, "DP") == ["DP", "500.0", "400.0", "23"]
