"""The serving benchmark: request streams, and statistics of a real run against its own timestamps."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest
from test_server import RunningServer

from torch_shift.bench.loadgen import run_load
from torch_shift.bench.report import summarize
from torch_shift.bench.traffic import (
    DEFAULT_TRACE,
    LengthSource,
    gamma_arrivals,
    phase_arrivals,
    read_trace,
    trace_replay,
    workload,
)


def test_arrival_processes():
    rng = random.Random(0)
    gaps = lambda ts: [b - a for a, b in zip([0.0] + ts, ts)]  # noqa: E731
    poisson = gaps(gamma_arrivals(4000, 10.0, 1.0, rng))
    bursty = gaps(gamma_arrivals(4000, 10.0, 3.0, rng))
    for g, cv in ((poisson, 1.0), (bursty, 3.0)):
        assert statistics.mean(g) == pytest.approx(0.1, rel=0.1)
        assert statistics.pstdev(g) / statistics.mean(g) == pytest.approx(cv, rel=0.15)
    times = phase_arrivals([(10.0, 2.0), (10.0, 20.0)], random.Random(1))
    low, high = sum(t < 10 for t in times), sum(t >= 10 for t in times)
    assert 8 <= low <= 35 and 150 <= high <= 250 and max(times) < 20


def test_trace_lengths_and_replay_are_scaled_and_clipped():
    """On the trace shipped in the package (the first 2,000 requests of the Azure 2023 conversation trace)."""
    assert len(read_trace(DEFAULT_TRACE)) == 2000
    lengths = LengthSource(trace=DEFAULT_TRACE, scale=0.125, max_prompt=64, max_output=16)
    specs = trace_replay(DEFAULT_TRACE, 50, 10.0, lengths, vocab_size=512)
    assert len(specs) == 50 and specs[0].arrival_s == 0.0
    assert all(1 <= len(s.prompt) <= 64 and 2 <= s.max_tokens <= 16 for s in specs)
    assert specs[1].arrival_s == pytest.approx(4.314579 / 10.0)  # the trace's second arrival, compressed
    assert len(specs[1].prompt) == min(64, round(396 * 0.125))
    sampled = workload([0.0, 1.0], lengths, 512, seed=3)
    assert all(max(s.prompt) < 512 and min(s.prompt) >= 8 for s in sampled)


def test_statistics_of_a_real_run_match_its_recorded_timestamps(checkpoints):
    _, model_dir = checkpoints("llama")
    server = RunningServer(model_dir)
    try:
        specs = workload(gamma_arrivals(12, 20.0, 2.0, random.Random(2)), LengthSource(prompt_len=9, output_len=6),
                         vocab_size=512)
        records = asyncio.run(run_load(server.url, specs, model="tiny", config="single", progress=False))
    finally:
        server.stop()
    assert all(r["status"] == 200 and r["output_tokens"] == 6 and r["prompt_tokens"] == 9 for r in records)
    for r in records:
        assert r["arrival_s"] <= r["start_s"] <= r["first_token_s"] <= r["token_times_s"][-1] <= r["end_s"]
        assert r["token_times_s"] == sorted(r["token_times_s"])
    summary = summarize(records)
    ttft = sorted(r["first_token_s"] - r["start_s"] for r in records)
    tpot = [(r["token_times_s"][-1] - r["token_times_s"][0]) / 5 for r in records]
    assert summary["ttft_ms"]["p50"] == pytest.approx(1e3 * statistics.median(ttft))
    assert summary["ttft_ms"]["max"] == pytest.approx(1e3 * ttft[-1])
    assert summary["tpot_ms"]["mean"] == pytest.approx(1e3 * statistics.mean(tpot))
    makespan = max(r["end_s"] for r in records) - min(r["start_s"] for r in records)
    assert summary["total_tok_s"] == pytest.approx(12 * 15 / makespan)


@pytest.mark.slow
def test_bench_command_compares_configs_side_by_side(checkpoints, tmp_path):
    import json
    import subprocess
    import sys

    _, model_dir = checkpoints("llama")
    result = subprocess.run(
        [sys.executable, "-m", "torch_shift", "bench", "--model", str(model_dir), "--config", "single:", "--config",
         "Shift:sp=2,shift_threshold=4", "--num-requests", "6", "--rate", "20", "--prompt-len", "8",
         "--output-len", "4", "--out", str(tmp_path), "--no-progress"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["configs"]) == {"single", "Shift"}
    assert all(c["summary"]["succeeded"] == 6 for c in data["configs"].values())
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "single" in result.stdout and "Shift" in result.stdout


def test_bench_against_a_url_where_no_server_answers_says_so(tmp_path, capsys):
    """A wrong --url printed a table of 0/4 and exited 0."""
    import socket

    from torch_shift.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    assert main(["bench", "--url", f"http://127.0.0.1:{port}", "--vocab-size", "512", "--num-requests", "2",
                 "--out", str(tmp_path), "--no-progress"]) == 2
    assert f"--url http://127.0.0.1:{port}: no server answers there" in capsys.readouterr().err


def test_bench_where_every_request_fails_exits_non_zero(checkpoints, tmp_path, capsys):
    """A server that refuses every request (here: an API key not given) is a failed run, with the first error."""
    from torch_shift.cli import main

    _, model_dir = checkpoints("llama")
    server = RunningServer(model_dir, api_key="secret")
    try:
        assert main(["bench", "--url", server.url, "--vocab-size", "512", "--num-requests", "2", "--out",
                     str(tmp_path), "--no-progress"]) == 1
    finally:
        server.stop()
    assert "every request to server failed; the first: status 401" in capsys.readouterr().err
