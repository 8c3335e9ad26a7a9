"""The two ways to start a parallel engine, and what happens when a rank fails."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_shift import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["the quick brown fox", "café au lait", "x"]


def single_device(model_dir, max_tokens=8):
    outs = LLM(str(model_dir)).generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]


@pytest.mark.slow
def test_torchrun_smoke(llama, tmp_path):
    """(a) a real `torchrun --standalone`: every rank runs the program and returns rank 0's outputs."""
    _, model_dir = llama
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--log-dir", str(tmp_path), "--redirects", "1", str(REPO / "examples" / "shift_generate.py"), "--model", str(model_dir), "--sp", "2", "--tp", "1",
         "--shift-threshold", "8", *PROMPTS],
        capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    logs = sorted(tmp_path.rglob("stdout.log"))  # one per rank, so their lines do not interleave
    lines = [json.loads(line) for log in logs for line in log.read_text().splitlines() if line.startswith("{")]
    assert sorted(line["rank"] for line in lines) == [0, 1]
    tokens, texts = single_device(model_dir)
    for line in lines:
        assert line["outputs"] == tokens and line["texts"] == texts
        assert line["layouts"]["base"] >= 1 and line["layouts"]["shift"] >= 1


def test_single_process_launch_through_the_cli(llama):
    """(b) an ordinary process starts its local ranks itself."""
    _, model_dir = llama
    result = subprocess.run(
        [sys.executable, "-m", "torch_shift", "generate", "--model", str(model_dir), "--sp", "2", "--tp", "2", "--shift-threshold", "8",
         "--max-tokens", "8", "--json", *PROMPTS],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    tokens, texts = single_device(model_dir)
    assert [d["token_ids"] for d in lines] == tokens and [d["text"] for d in lines] == texts


FAILING_RANK = """
import os, sys, time
from torch_shift import LLM, SamplingParams
import torch_shift.engine.model_runner as mr

how = sys.argv[2]
original = mr.ModelRunner.execute
calls = [0]
def execute(self, plan):
    calls[0] += 1
    if os.environ.get("RANK") == "1" and calls[0] == 3:  # rank 0 is the user's process: no RANK there
        if how == "raise":
            raise RuntimeError("injected failure on rank 1")
        os._exit(9)
    return original(self, plan)
mr.ModelRunner.execute = execute
llm = LLM(sys.argv[1], sp=2, tp=1, shift_threshold=4, distributed_timeout_s=30)
start = time.monotonic()
try:
    llm.generate(["hello"] * 3, SamplingParams(max_tokens=20), use_tqdm=False)
except Exception as e:
    print("rank 0 error after %.1f s: %s" % (time.monotonic() - start, str(e)[:300]), flush=True)
    sys.exit(3)
print("no error", flush=True)
"""


@pytest.mark.parametrize("how", ["raise", "die"])
def test_a_failing_rank_ends_the_others_in_bounded_time(llama, tmp_path, how):
    _, model_dir = llama
    script = tmp_path / "fail.py"
    script.write_text(FAILING_RANK)
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(script), str(model_dir), how], capture_output=True, text=True,
                            timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 3, (result.stdout, result.stderr[-2000:])
    assert "rank 0 error after" in result.stdout
    if how == "raise":
        assert "injected failure on rank 1" in result.stdout
    assert elapsed < 60  # far below the 120 s default timeout, well within the 30 s set here plus start-up


def _rank0_dies(rank, world, model_dir):
    import torch_shift.engine.model_runner as mr

    original = mr.ModelRunner.execute
    calls = [0]

    def execute(self, plan):
        calls[0] += 1
        if rank == 0 and calls[0] == 3:
            os._exit(9)
        return original(self, plan)

    mr.ModelRunner.execute = execute
    llm = LLM(str(model_dir), sp=2, tp=1, shift_threshold=4, distributed_timeout_s=30)
    start = time.monotonic()
    try:
        llm.generate(["hello"] * 3, SamplingParams(max_tokens=20), use_tqdm=False)
    except Exception as e:  # noqa: BLE001 - what rank 1 saw is the result
        return time.monotonic() - start, f"{type(e).__name__}: {e}"
    return time.monotonic() - start, None


def test_torchrun_style_ranks_end_when_rank_0_dies(llama):
    """Under torchrun (every rank runs `generate`), rank 0 dying mid-step ends rank 1 with an error."""
    from torch_shift.parallel.launch import LocalRanks, free_port

    _, model_dir = llama
    ranks = LocalRanks(_rank0_dies, 2, [0, 1], model_dir, port=free_port())
    try:
        rank, status, value = ranks.results.get(timeout=90)  # rank 0 reports nothing: it died
        elapsed, error = pickle.loads(value)
        assert (rank, status) == (1, "ok")
        # rank 1 may see rank 0's sockets close before rank 0 is a zombie the parent can reap: wait for its end
        ranks.procs[0].join(timeout=30)
        assert ranks.procs[0].exitcode == 9
        assert error is not None and elapsed < 45, (elapsed, error)  # the 30 s collective bound at most
    finally:
        ranks.stop(grace_s=1)
