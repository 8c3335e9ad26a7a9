"""The `torch-shift` command."""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import time

import pytest

from torch_shift import LLM, SamplingParams
from torch_shift.cli import main

# `python -m torch_shift`: the command of this checkout, whatever PATH holds
TORCH_SHIFT = [sys.executable, "-m", "torch_shift"]


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


# Words of the King James Version the default model was trained on; a random model's text has few.
KJV_WORDS = set("""the and of unto he them that shall his to in i lord god said be for they is not with all a thou
thy was which him me my it from their ye upon were have are you this will by as her also out king israel people son
sons children house land came went day before hath thee when then there so but say saying no man men up into hand
an at had did do if our us we one because let made go come over against among after even every great these those
its hast art saith spake your yet own away down what who whom own forth neither nor earth heaven day days""".split())


def readable(text: str) -> bool:
    words = re.findall(r"[A-Za-z]+", text.lower())
    return len(words) >= 8 and sum(w in KJV_WORDS for w in words) >= len(words) / 2


def test_console_script_with_the_default_model():
    result = subprocess.run([*TORCH_SHIFT, "generate", "And God said", "--max-tokens", "40", "--ignore-eos"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "embedded default model" in result.stderr
    assert result.stdout.startswith("--- prompt 'And God said' [sample 0, 40 tokens, finish=length]\nAnd God said")
    assert readable(result.stdout.split("\n", 1)[1]), result.stdout


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    """`torch-shift serve --port 0 ...`; the URL is the one the server says it listens on."""
    server = subprocess.Popen([*TORCH_SHIFT, "serve", "--port", "0", *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stderr], daemon=True).start()
    deadline = time.monotonic() + 120
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            server.kill()
            raise AssertionError("the server did not say where it listens") from None
        found = re.search(r"\[torch-shift\] serving .* on (http://127\.0\.0\.1:\d+) ", line)
        if found:
            return server, found.group(1)


def test_serve_without_a_model_serves_the_default_model_and_says_where():
    import openai

    server, url = start_server()
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["default"]
        completion = client.completions.create(model="default", prompt="In the beginning", max_tokens=40,
                                               temperature=0.0)
        assert readable(completion.choices[0].text), completion.choices[0].text
    finally:
        server.terminate()
        server.wait(30)


def test_help_says_what_each_command_is_and_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    top = capsys.readouterr().out
    assert "changes its parallel layout while it serves" in top
    assert re.search(r"generate +generate text offline", top) and re.search(r"serve +an OpenAI-compatible", top)
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "Generate text offline for each prompt" in text
    for expected in ("token budget of one step (default: 2048)", "(default: 256)", "--tensor-parallel-size TP",
                     "--ulysses-sequence-parallel-size SP", "--distributed-timeout DISTRIBUTED_TIMEOUT_S",
                     "--temperature TEMPERATURE 0: greedy (default: 0.0)"):
        assert expected in text, expected


def test_sampling_without_a_seed_differs_between_runs(llama, capsys):
    _, model_dir = llama
    args = ["generate", "--model", str(model_dir), "--temperature", "1.0", "--max-tokens", "16", "--json", "the"]

    def run(*extra):
        assert main(args + list(extra)) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    assert len({tuple(run()) for _ in range(3)}) > 1
    assert run("--seed", "5") == run("--seed", "5")


def test_max_tokens_beyond_the_context_is_an_error(llama, capsys):
    _, model_dir = llama
    assert main(["generate", "--model", str(model_dir), "--max-model-len", "64", "--max-tokens", "60",
                 "--token-ids", "7 8 9 10 11"]) == 2
    assert "prompt 0 has 5 tokens; with --max-tokens 60 that is 65, more than the context of 64 tokens" in \
        capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir), "--max-model-len", "64", "--max-tokens", "59",
                 "--token-ids", "7 8 9 10 11", "--json", "--ignore-eos"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 59


def test_vllm_parallel_flags(llama, capsys):
    _, model_dir = llama
    assert main(["generate", "--model", str(model_dir), "--pipeline-parallel-size", "3", "x"]) == 2
    assert "pp=3 stages need at least 3 layers; the model has num_hidden_layers=2" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir), "--tensor-parallel-size", "2", "--max-tokens", "4",
                 "--json", "the quick"]) == 0
    expected = LLM(str(model_dir)).generate("the quick", SamplingParams(max_tokens=4, temperature=0.0),
                                            use_tqdm=False)[0].outputs[0].token_ids
    assert json.loads(capsys.readouterr().out)["token_ids"] == expected


CORE_ONLY = """
import contextlib, importlib.abc, io, json, sys
OPTIONAL = {"httpx", "matplotlib", "transformers", "fastapi", "uvicorn", "prometheus_client", "openai",
            "torchtitan", "pydantic"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in OPTIONAL:
            raise ImportError(f"{name} is blocked: it is not a core dependency")
sys.meta_path.insert(0, Block())
from torch_shift.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code or 0
    results.append([code, out.getvalue()])
print(json.dumps(results))
"""

CORE_COMMANDS = [
    (["generate", "--help"], 0, "--max-tokens"),
    (["convert", "--help"], 0, "--out"),
    (["generate", "And God said", "--max-tokens", "4"], 0, "--- prompt 'And God said' [sample 0, 4 tokens"),
    (["serve"], 2, "torch-shift serve needs fastapi, uvicorn, prometheus_client: pip install 'torch_shift[serve]'"),
    (["bench", "--table5"], 2, "torch-shift bench needs httpx, matplotlib: pip install 'torch_shift[bench]'"),
]


def test_commands_with_only_the_core_dependencies(tmp_path):
    """A user who installed no extra (the optional modules blocked, as the project's hook does): every command
    works or names the extra it needs."""
    script = tmp_path / "core_only.py"
    script.write_text(CORE_ONLY)
    result = subprocess.run([sys.executable, str(script), json.dumps([argv for argv, _, _ in CORE_COMMANDS])],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for (argv, returncode, expected), (code, output) in zip(CORE_COMMANDS, json.loads(result.stdout.splitlines()[-1]),
                                                            strict=True):
        assert code == returncode and expected in output, (argv, code, output[-2000:])
