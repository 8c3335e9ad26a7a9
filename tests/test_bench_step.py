"""bench/bench_step.py, where a batch-1 decode step's time goes (docs/performance.md), runs end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from torch_shift.models.linear import packing_supported

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32), reason="no packed weights on this CPU")
def test_bench_step_times_every_part_of_an_engines_step(tmp_path, capsys):
    """Its untimed TPOT comes from an engine as a user starts it (the C++ decoder runs its small steps where it
    builds), its parts from a second engine without that decoder: every part timed, the parts' sum the step."""
    from bench_step import main

    out = tmp_path / "step.json"
    assert main(["--small", "--dtype", "float32", "--tokens", "4", "--compile", "false", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    parts = figures["per_step_ms"]
    assert figures["tpot_s"] > 0 and figures["matmul_gbps"] > 0
    assert parts["packed matmuls (the LM head's included)"] > 0 and parts["attention"] > 0
    assert "| engine around the runner |" in capsys.readouterr().out
