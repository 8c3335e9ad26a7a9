"""The `torch-shift` command."""

from __future__ import annotations

import json
import os
import subprocess

from torch_shift import LLM, SamplingParams
from torch_shift.cli import main


def test_generate_prints_what_the_api_returns(llama, capsys):
    _, model_dir = llama
    assert main(["generate", "--model", str(model_dir), "--max-tokens", "8", "--json", "the quick", "café"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = LLM(str(model_dir)).generate(["the quick", "café"], SamplingParams(max_tokens=8, temperature=0.0),
                                            use_tqdm=False)
    assert [(d["prompt"], d["token_ids"], d["text"]) for d in lines] == [
        (o.prompt, o.outputs[0].token_ids, o.outputs[0].text) for o in expected]


def test_generate_token_ids_and_bad_input(llama, capsys):
    _, model_dir = llama
    assert main(["generate", "--model", str(model_dir), "--token-ids", "7 8 9", "--max-tokens", "3", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    assert main(["generate", "--model", str(model_dir), "--top-p", "0", "x"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_console_script_with_the_default_model(tmp_path):
    env = dict(os.environ, TORCH_SHIFT_HOME=str(tmp_path))
    result = subprocess.run(["torch-shift", "generate", "Hello", "--max-tokens", "5", "--ignore-eos"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "embedded default model" in result.stderr
    assert result.stdout.startswith("--- prompt 'Hello' [sample 0, 5 tokens, finish=length]\nHello")
    assert (tmp_path / "default-random-llama-v1" / "model.safetensors").is_file()
