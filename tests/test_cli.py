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
    # --logprobs: each token's logprob and the top ones, in JSON and in text (they were computed, never shown)
    logprobs = LLM(str(model_dir)).generate(["the quick"], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2),
                                            use_tqdm=False)[0].outputs[0].logprobs
    assert main(["generate", "--model", str(model_dir), "--max-tokens", "3", "--logprobs", "2", "--json",
                 "the quick"]) == 0
    (line,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["logprob"] for p in line["logprobs"]] == pytest.approx(
        [lp[t].logprob for lp, t in zip(logprobs, line["token_ids"])])
    assert all(len(p["top"]) == 2 and p["top"][0]["token_id"] == p["token_id"] for p in line["logprobs"])
    assert main(["generate", "--model", str(model_dir), "--max-tokens", "3", "--logprobs", "2", "the quick"]) == 0
    assert capsys.readouterr().out.count("(top: ") == 3


def test_a_progress_bar_made_by_the_callers_function_and_none_from_generate_off_a_terminal(llama, capsys):
    """As vLLM's `use_tqdm`: a function that makes the bar (the command's, on a terminal, clears itself when done);
    the command's output in a file or a pipe holds no bar."""
    from tqdm.auto import tqdm

    _, model_dir = llama
    made = []

    def make_bar(**kwargs):
        made.append(kwargs)
        return tqdm(**kwargs)

    LLM(str(model_dir)).generate(["the quick", "café"], SamplingParams(max_tokens=2), use_tqdm=make_bar)
    assert [kwargs["total"] for kwargs in made] == [2]
    assert "Processed prompts: 100%" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir), "--max-tokens", "2", "the quick", "café"]) == 0
    assert "Processed prompts" not in capsys.readouterr().err


def test_generate_with_speculative_config(llama, capsys):
    _, model_dir = llama
    prompt = "the quick brown fox " * 4
    # vLLM's command lines write flags with underscores too (not what follows "--": prompts)
    from torch_shift.cli import _dashed_flags
    assert _dashed_flags(["--max_tokens=3", "a_b", "--", "--x_y"]) == ["--max-tokens=3", "a_b", "--", "--x_y"]
    assert main(["generate", "--model", str(model_dir), "--max_tokens=12", "--json", "--speculative_config",
                 '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}', prompt]) == 0
    expected = LLM(str(model_dir)).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert json.loads(capsys.readouterr().out)["token_ids"] == expected[0].outputs[0].token_ids
    assert main(["generate", "--model", str(model_dir), "--speculative-config", '{"method": "eagle"}', "x"]) == 2
    assert "method 'eagle' is not supported" in capsys.readouterr().err


def test_generate_token_ids_and_bad_input(llama, capsys):
    _, model_dir = llama
    assert main(["generate", "--model", str(model_dir), "--token-ids", "7 8 9", "--max-tokens", "3", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    assert main(["generate", "--model", str(model_dir), "--top-p", "0", "x"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir), "--token-ids", "7 8 9", "--max-tokens", "2", "--n", "2"]) == 2
    assert "n must be 1 when using greedy sampling (temperature 0), got 2" in capsys.readouterr().err  # vLLM's rule
    assert main(["generate", "--model", str(model_dir), "--token-ids", "7 8 9", "--max-tokens", "30",
                 "--num-kv-blocks", "2", "--block-size", "16"]) == 2
    assert "the context of 32 tokens: lower --max-tokens (or raise the KV cache's memory" in capsys.readouterr().err


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
                     "--temperature TEMPERATURE 0: greedy (default: 0.0)",
                     "reuse the KV blocks of a shared prompt prefix (default: on)",
                     "instead of each expert's FFN split by TP (docs/moe.md) (default: off)"):
        assert expected in text, expected


def test_a_script_run_beside_a_clone_named_torch_shift_imports_the_installed_package(tmp_path):
    """scripts/install.sh installs in setuptools' compat mode: its import hook (the default mode) comes after
    sys.path, where a folder named torch_shift without __init__.py (a clone) became an empty namespace package."""
    (tmp_path / "torch_shift").mkdir()
    result = subprocess.run([sys.executable, "-c", "import torch_shift; print(torch_shift.LLM.__module__)"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "torch_shift.engine.llm", result.stderr[-2000:]


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
    (["serve"], 2, "torch-shift serve needs fastapi, uvicorn, prometheus_client: scripts/install.sh serve in a "
     "checkout of torch_shift, or pip install 'torch_shift[serve]'"),
    (["bench", "--table5"], 2, "torch-shift bench needs httpx, matplotlib: scripts/install.sh bench in a checkout of "
     "torch_shift, or pip install 'torch_shift[bench]'"),
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


def test_every_engine_argument_is_a_flag_of_generate_and_serve_with_vllms_names():
    """The command line's engine options come from EngineArgs' fields: none missing, none extra, the same
    defaults, and vLLM's flag names where vLLM has one."""
    from dataclasses import fields

    from torch_shift.cli import _engine_kwargs, build_parser
    from torch_shift.engine.args import ENGINE_ARG_ALIASES, EngineArgs

    parser = build_parser()
    engine_fields = {f.name: f.default for f in fields(EngineArgs) if f.name != "model"}
    for command in (["generate", "x"], ["serve"]):
        args = parser.parse_args(command)
        kwargs = _engine_kwargs(args)
        assert set(kwargs) == set(engine_fields), command
        assert kwargs == {**engine_fields, "seed": kwargs["seed"]}, command  # the CLI's seed: None, fresh per run
        subparser = parser._subparsers._group_actions[0].choices[command[0]]
        flags = {flag for action in subparser._actions for flag in action.option_strings}
        for alias in ENGINE_ARG_ALIASES:
            assert f"--{alias.replace('_', '-')}" in flags, (command[0], alias)
        for vllm_flag in ("--enforce-eager", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                          "--gpu-memory-utilization", "--enable-prefix-caching", "--no-enable-prefix-caching",
                          "--attention-backend", "--swap-space", "--scheduling-policy", "--block-size", "--dtype"):
            assert vllm_flag in flags, (command[0], vllm_flag)
    args = parser.parse_args(["generate", "--enforce-eager", "--attention-backend", "sdpa", "--flying-weights", "copy",
                              "--seesaw-weights", "host", "--kv-swap", "async", "x"])
    kwargs = _engine_kwargs(args)
    assert (kwargs["compile"], kwargs["cuda_graphs"], kwargs["attention_backend"], kwargs["flying_weights"],
            kwargs["seesaw_weights"], kwargs["kv_swap"]) == (False, False, "sdpa", "copy", "host", "async")
    eager = EngineArgs("m", enforce_eager=True)
    assert eager.compile is False and eager.cuda_graphs is False
    not_eager = EngineArgs("m", enforce_eager=False)
    assert not_eager.compile is None and not_eager.cuda_graphs is None
    for given in ({"compile": True}, {"cuda_graphs": True}):
        with pytest.raises(ValueError, match="disagree"):
            EngineArgs("m", enforce_eager=True, **given)
    with pytest.raises(ValueError, match="cuda_graphs=True needs one rank on a GPU"):
        LLM(cuda_graphs=True, device="cpu")


def test_dtype_names_and_a_misspelt_option(capsys):
    """--dtype takes every name LLM(dtype=...) takes; an unknown option is named with its command's usage and the
    option meant."""
    from torch_shift.cli import build_parser, main

    parser = build_parser()
    for given, full in [("bf16", "bfloat16"), ("half", "float16"), ("fp32", "float32"), ("auto", "auto")]:
        assert parser.parse_args(["generate", "--dtype", given, "x"]).dtype == full
        assert parser.parse_args(["convert", "--model", "m", "--out", "o", "--dtype", given]).dtype == full
    assert parser.parse_args(["plan", "--hardware", "h100", "--dtype", "bfloat16"]).dtype == "bf16"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--dtype", "fp17", "x"])
    assert "invalid choice: 'fp17'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--temprature", "0.5", "x"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "usage: torch-shift generate" in err and "--temprature: did you mean --temperature?" in err
    with pytest.raises(SystemExit):
        main(["generate", "--modle", "m", "x"])
    err = capsys.readouterr().err
    # the usage in one line beside the error, not every option (45 lines) above it
    assert err.splitlines() == ["usage: torch-shift generate [OPTIONS] PROMPT [PROMPT ...]",
                                "torch-shift generate: error: unrecognized arguments: --modle; "
                                "--modle: did you mean --model?"]


def test_version_and_help(capsys):
    from torch_shift import __version__
    from torch_shift.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"torch-shift {__version__}\n"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: torch-shift serve [OPTIONS] [MODEL]\n") and "--max-model-len" in out


def test_a_vllm_serve_command_line_moves_over(capsys):
    """What a probe of vLLM users' flags found: the positional model, vLLM's size suffixes and its uvicorn log level
    were refused, a bad --log-level failed only after the model had loaded, and hints named the opposite flag."""
    from torch_shift.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "some/model", "--max-model-len", "32k", "--max-num-batched-tokens", "4K",
                              "--kv-cache-memory-bytes", "1G", "--uvicorn-log-level", "DEBUG"])
    assert (args.model_tag, args.max_model_len, args.max_num_batched_tokens, args.kv_cache_memory_bytes,
            args.log_level) == ("some/model", 32_000, 4096, 1 << 30, "debug")
    assert parser.parse_args(["serve", "--trust-remote-code", "--enable-chunked-prefill"]).trust_remote_code
    logs = parser.parse_args(["serve", "--disable-log-stats", "--enable-log-requests"])
    assert logs.disable_log_stats and logs.enable_log_requests
    assert not parser.parse_args(["serve", "--no-enable-log-requests"]).enable_log_requests
    assert main(["serve", "--no-enable-chunked-prefill"]) == 2
    assert "--no-enable-chunked-prefill: torch_shift always chunks prompts" in capsys.readouterr().err
    several = parser.parse_args(["serve", "--served-model-name", "a", "b", "--api-key", "k1", "k2"])
    assert (several.served_model_name, several.api_key) == (["a", "b"], ["k1", "k2"])  # vLLM's: several of each
    assert parser.parse_args(["serve", "--max-model-len", "auto"]).max_model_len is None
    from torch_shift.serve.options import CorsOptions

    assert CorsOptions.from_args(parser.parse_args(["serve"])) == CorsOptions()  # vLLM's defaults: any origin
    cors = parser.parse_args(["serve", "--allowed-origins", '["http://a.example"]', "--allow-credentials",
                              "--allowed-methods", '["GET", "POST"]'])
    assert CorsOptions.from_args(cors) == CorsOptions(("http://a.example",), True, ("GET", "POST"), ("*",))
    assert parser.parse_args(["serve", "--max-model-len", "-1"]).max_model_len is None
    for bad in (["--log-level", "notset"], ["--max-model-len", "1.5K"], ["--allowed-origins", "http://a.example"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])
    capsys.readouterr()
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "two models: 'a' and --model 'b'" in capsys.readouterr().err
    for unknown, hint in (("--no-enforce-eager", None), ("--tokenizer-mode", None),
                         ("--max-modle-len", "--max-model-len")):
        with pytest.raises(SystemExit):
            main(["serve", unknown])
        err = capsys.readouterr().err
        assert (f"{unknown}: did you mean {hint}?" in err) if hint else "did you mean" not in err, (unknown, err)


def test_compile_by_default_for_a_model_of_50m_parameters_or_more():
    from types import SimpleNamespace

    from torch_shift.attention import _has_triton
    from torch_shift.engine.args import COMPILE_MIN_PARAMETERS, EngineArgs
    from torch_shift.kernels import compiler

    large, small = (SimpleNamespace(num_parameters=n, is_moe=False)
                    for n in (COMPILE_MIN_PARAMETERS, COMPILE_MIN_PARAMETERS - 1))
    moe = SimpleNamespace(num_parameters=COMPILE_MIN_PARAMETERS, is_moe=True)
    one, two = SimpleNamespace(world_size=1), SimpleNamespace(world_size=2)
    gpu = EngineArgs("m", device="cuda")  # no GPU needed to decide: the device is only named
    assert gpu._compiles(large, one) == _has_triton()  # inductor's GPU kernels are Triton's
    assert not gpu._compiles(small, one) and not gpu._compiles(large, two)
    cpu = EngineArgs("m", device="cpu")
    assert cpu._compiles(large, one) == (compiler() is not None) and not cpu._compiles(small, one)
    assert cpu._compiles(large, two) == (compiler() is not None) and not cpu._compiles(small, two)
    assert cpu._compiles(moe, one) == cpu._compiles(moe, two) == (compiler() is not None)
    assert not EngineArgs("m", device="cuda", compile=False)._compiles(large, one)
    assert EngineArgs("m", device="cpu", compile=True)._compiles(small, two)


def test_token_ids_that_are_not_integers_name_the_flag_before_the_model_loads(capsys, monkeypatch):
    import torch_shift

    monkeypatch.setattr(torch_shift, "LLM", None)  # loading a model here would fail with a TypeError, not this
    assert main(["generate", "--token-ids", "1 a 3"]) == 2
    err = capsys.readouterr().err
    assert "--token-ids: prompt 0 ('1 a 3') must be token ids" in err and "'a' is not a token id" in err
    assert main(["generate", "--token-ids", "1 2", " , "]) == 2
    assert "prompt 1" in capsys.readouterr().err


def test_plan_with_a_missing_path_says_no_such_file(capsys, tmp_path):
    missing = tmp_path / "Llama-3-70B" / "config.json"
    for model in (str(missing), "Llama-3-70B/config.json"):
        assert main(["plan", "--model", model, "--hardware", "h100", "--synthetic", "64:8"]) == 2
        err = capsys.readouterr().err
        assert f"--model {model}: no such file or directory" in err and "Hugging Face cache" not in err


def test_a_file_given_as_a_model_says_what_a_model_is(llama):
    from torch_shift.models.hub import resolve_model_dir

    _, model_dir = llama
    with pytest.raises(ValueError, match="is a file: a model is a checkpoint directory"):
        resolve_model_dir(model_dir / "config.json")
    with pytest.raises(ValueError, match=r"no such file: Llama-3-70B/config.json \(and a model is a checkpoint "
                                         "directory"):
        resolve_model_dir("Llama-3-70B/config.json")


def test_generate_with_a_missing_config_path_says_no_such_file(capsys):
    assert main(["generate", "--model", "Llama-3-70B/config.json", "--max-tokens", "1", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no such file: Llama-3-70B/config.json" in err and "Hugging Face cache" not in err


def test_serve_on_a_taken_port_fails_before_the_model_loads(capsys, monkeypatch):
    import socket

    from torch_shift.serve import api_server

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(api_server, "create_server", load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in err and "--port 0" in err
    assert main(["serve", "--host", "192.0.2.1"]) == 2  # TEST-NET-1: no machine has it
    assert "--host 192.0.2.1 --port 8000: cannot listen there" in capsys.readouterr().err
    for bad in ("99999", "-1"):  # 99999 served on 99999 mod 65536; -1 was said to be a bad host
        with pytest.raises(SystemExit):
            main(["serve", "--port", bad])
        assert "a port is 0 to 65535" in capsys.readouterr().err


def test_benchmark_servers_take_switches_as_flags_and_serve_parses_them():
    from torch_shift.bench.run import serve_command
    from torch_shift.cli import build_parser

    cmd = serve_command("m", 8000, "TP+EP", {"tp": "2", "enable_expert_parallel": True, "compile": False})
    assert cmd[cmd.index("--tp") + 1] == "2"
    assert "--enable-expert-parallel" in cmd and "--no-compile" in cmd
    args = build_parser().parse_args(cmd[cmd.index("serve"):])
    assert args.enable_expert_parallel is True and args.compile is False and args.tp == 2


def test_the_command_shows_the_librarys_notes_such_as_a_first_kernel_build(capsys):
    """A first run builds the CPU kernels for about 20 s: the command says so instead of looking hung."""
    import logging

    from torch_shift.cli import _show_library_log
    from torch_shift.kernels import logger as kernels_logger

    library_log = logging.getLogger("torch_shift")
    saved = library_log.handlers[:], library_log.level, library_log.propagate
    try:
        library_log.handlers.clear()
        _show_library_log()
        _show_library_log()  # once only
        kernels_logger.info("building %s ...", "libtorch_shift_cpu.so")
        assert capsys.readouterr().err == "[torch-shift] building libtorch_shift_cpu.so ...\n"
    finally:
        library_log.handlers[:], library_log.level, library_log.propagate = saved


def test_ctrl_c_ends_a_command_with_130_and_no_traceback(monkeypatch, capsys):
    from torch_shift import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_generate", interrupted)
    assert cli.main(["generate", "x"]) == 130
    assert capsys.readouterr().err == "[torch-shift] interrupted\n"


@pytest.mark.parametrize("argv, option", [
    (["convert", "--model", "m", "--out", "o", "--max-shard-size-mb", "0"], "--max-shard-size-mb"),
    (["convert", "--model", "m", "--out", "o", "--max-shard-size-mb", "-5"], "--max-shard-size-mb"),
    (["plan", "--hardware", "h100", "--synthetic", "128:32", "--world", "0"], "--world"),
    (["bench", "--url", "http://127.0.0.1:1", "--num-requests", "0"], "--num-requests"),
    (["bench", "--url", "http://127.0.0.1:1", "--rate", "-1"], "--rate"),
])
def test_a_count_size_or_rate_of_zero_is_a_usage_error(argv, option, capsys):
    """They ran empty work (a benchmark of no requests, a shard per tensor) or took 0 as "unset" (plan's world)."""
    from torch_shift.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert f"argument {option}: must be > 0" in capsys.readouterr().err
