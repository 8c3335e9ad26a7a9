"""The `torch-shift` command."""

from __future__ import annotations

import json
import re
import subprocess
import time

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
    result = subprocess.run(["torch-shift", "generate", "And God said", "--max-tokens", "40", "--ignore-eos"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "embedded default model" in result.stderr
    assert result.stdout.startswith("--- prompt 'And God said' [sample 0, 40 tokens, finish=length]\nAnd God said")
    assert readable(result.stdout.split("\n", 1)[1]), result.stdout


def test_serve_without_a_model_serves_the_default_model():
    import openai

    from torch_shift.parallel.launch import free_port

    port = free_port()
    server = subprocess.Popen(["torch-shift", "serve", "--port", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        assert [m.id for m in models.data] == ["default"]
        completion = client.completions.create(model="default", prompt="In the beginning", max_tokens=40,
                                               temperature=0.0)
        assert readable(completion.choices[0].text), completion.choices[0].text
    finally:
        server.terminate()
        server.wait(30)
