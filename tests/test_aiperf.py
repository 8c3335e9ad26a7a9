"""aiperf, unmodified, against `torch-shift serve`: its server-metrics export reads vLLM's metric names, which must
carry numbers (they all read 0.00 while the server named them torch_shift:*).

aiperf pins versions the project's own environment does not keep (huggingface_hub < 2), so it lives in an
environment of its own: scripts/install.sh with the dev extra makes `.venv-aiperf/`; TORCH_SHIFT_AIPERF may name
another aiperf executable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from torch_shift.models.toy import build_tokenizer, tiny_llama_config, write_random_checkpoint
from torch_shift.parallel.launch import free_port

REPO = Path(__file__).resolve().parent.parent


def aiperf_executable() -> str | None:
    for candidate in (os.environ.get("TORCH_SHIFT_AIPERF"), str(REPO / ".venv-aiperf" / "bin" / "aiperf"),
                      shutil.which("aiperf")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


@pytest.mark.slow
def test_aiperf_server_metrics_are_not_zero(tmp_path):
    aiperf = aiperf_executable()
    if aiperf is None:
        pytest.skip("aiperf is not installed (scripts/install.sh dev makes .venv-aiperf/)")
    model_dir = build_tokenizer(write_random_checkpoint(tmp_path / "model", tiny_llama_config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2)))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "torch_shift", "serve", "--model", str(model_dir), "--port",
                               str(port), "--served-model-name", "tiny"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        artifacts = tmp_path / "aiperf"
        run = subprocess.run([aiperf, "profile", "-m", "tiny", "--url", f"http://127.0.0.1:{port}",
                              "--endpoint-type", "chat", "--streaming", "--request-count", "32", "--concurrency", "4",
                              "--tokenizer", str(model_dir), "--prompt-input-tokens-mean", "32",
                              # long enough (a few seconds) for several of aiperf's scrapes of /metrics
                              "--prompt-output-tokens-mean", "64", "--extra-inputs", "ignore_eos:true",
                              "--random-seed", "1", "--ui-type", "none",
                              "--output-artifact-dir", str(artifacts)],
                             capture_output=True, text=True, timeout=600, env={**os.environ, "NO_COLOR": "1"})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        server.send_signal(2)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    metrics = json.loads((artifacts / "server_metrics_export.json").read_text())["metrics"]

    def stat(name: str, key: str) -> float:
        return sum(series["stats"][key] for series in metrics[name]["series"])

    for counter in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
                    "vllm:prefix_cache_queries"):
        assert stat(counter, "total") > 0, counter
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:inter_token_latency_seconds", "vllm:request_prompt_tokens"):
        assert stat(histogram, "count") > 0, histogram
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert gauge in metrics, gauge
    assert "torch_shift:steps" in metrics  # torch_shift's own beside them
    console = (artifacts / "profile_export_console.txt").read_text()
    assert "Usage Prompt Cache Read Tokens" in console  # usage.prompt_tokens_details is read
