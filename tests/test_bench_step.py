"""bench/bench_step.py, where a batch-1 decode step's time goes (docs/performance.md), runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_shift.models.linear import packing_supported

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_step.py"


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32), reason="no packed weights on this CPU")
def test_bench_step_times_every_part_of_an_engines_step(tmp_path):
    """Its untimed TPOT comes from an engine as a user starts it (the C++ decoder runs its small steps where it
    builds), its parts from a second engine without that decoder: every part timed. In a process of its own: its
    timers replace methods of the engine's classes for good."""
    out = tmp_path / "step.json"
    run = subprocess.run([sys.executable, str(BENCH), "--small", "--dtype", "float32", "--tokens", "4", "--compile",
                          "false", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    parts = figures["per_step_ms"]
    assert figures["tpot_s"] > 0 and figures["matmul_gbps"] > 0
    assert parts["packed matmuls (the LM head's included)"] > 0 and parts["attention"] > 0
    assert "| engine around the runner |" in run.stdout
