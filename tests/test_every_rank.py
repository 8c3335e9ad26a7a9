"""Under torchrun every rank runs the user's program: every public call of `LLM` must return rank 0's answer
on every rank, for every family of deployments (issue 21). The ranks here are forked with torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT), none started by another."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from torch_shift import LLM, SamplingParams
from torch_shift.parallel.launch import run_ranks
from torch_shift.parallel.layout_model import LayoutModel

PROMPTS = ["the quick brown fox", "café au lait", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "hello there"}]
SMALL_TIER = {"block_size": 4, "num_kv_blocks": 24, "num_cpu_kv_blocks": 32}

# the layout model each family's ranks run, behind the declared LayoutModel protocol
LAYOUT_MODELS = {"tp": "ShiftModule", "shift": "ShiftModule", "dp": "ReplicaModel", "flying": "ReplicaModel",
                 "pp": "PipelineModel", "seesaw": "PipelineModel"}

FAMILIES = {
    "tp": {"tp": 2},
    "shift": {"sp": 2, "shift_threshold": 8},
    "dp": {"dp": 2},
    "flying": {"dp": 2, "policy": "flying"},
    "pp": {"pp": 2},
    "seesaw": {"pp": 2, "policy": "seesaw", **SMALL_TIER},
}


def _every_call(rank, world, model_dir, engine_args):
    llm = LLM(str(model_dir), **engine_args)
    model = llm.engine.worker.runner.model
    answers = {"layout_model": type(model).__name__ if isinstance(model, LayoutModel) else None}
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    answers["generate"] = [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                           for o in outputs]
    chat = llm.chat(MESSAGES, PARAMS, use_tqdm=False)
    answers["chat"] = [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text) for o in chat]
    try:  # a user's mistake: rank 0's error on every rank, and the engine goes on
        llm.generate(["fine", 3.5], PARAMS, use_tqdm=False)
    except (TypeError, ValueError) as e:
        answers["error"] = str(e)
    answers["after_error"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)]
    try:  # each rank its own prompts (a data loader sharded by rank): every rank raises, and the engine goes on
        llm.generate(PROMPTS[rank:rank + 1], PARAMS, use_tqdm=False)
        answers["different_calls"] = "no error"
    except ValueError as e:
        answers["different_calls"] = "the ranks made different calls" in str(e)
    answers["after_different_calls"] = [o.outputs[0].token_ids
                                        for o in llm.generate(PROMPTS[:1], PARAMS, use_tqdm=rank == 0)]
    answers["stats"] = llm.stats()
    answers["tokenizer"] = llm.tokenizer.encode("the quick brown fox")
    llm.shutdown()
    answers["shutdown"] = True
    return answers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_public_call_answers_the_same_on_every_rank(layers4, family):
    ranks = run_ranks(_every_call, 2, layers4, FAMILIES[family], timeout_s=180)
    reference = LLM(str(layers4)).generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [a[1] for a in ranks[0]["generate"]] == [o.outputs[0].token_ids for o in reference]
    assert ranks[0]["layout_model"] == LAYOUT_MODELS[family]
    assert "prompt 1" in ranks[0]["error"]
    assert ranks[0]["stats"]["num_steps"] > 0
    assert ranks[0]["different_calls"] is True
    assert ranks[0]["after_different_calls"] == ranks[0]["after_error"]
    for rank, answers in enumerate(ranks[1:], start=1):
        for call in ranks[0]:
            assert answers[call] == ranks[0][call], (family, rank, call)


def test_a_call_digest_reads_the_name_and_the_arguments_contents():
    from torch_shift.parallel.agreement import value_digest

    def digest(*arguments, name="generate"):
        return value_digest((name, arguments))

    same = digest(["hi", [1, 2]], SamplingParams(max_tokens=3), None)
    assert digest(["hi", [1, 2]], SamplingParams(max_tokens=3), None) == same
    assert digest(["hi", [1, 3]], SamplingParams(max_tokens=3), None) != same
    assert digest(["hi", [1, 2]], SamplingParams(max_tokens=4), None) != same
    assert digest(["hi", [1, 2]], SamplingParams(max_tokens=3), 1) != same
    assert digest(["hi", [1, 2]], SamplingParams(max_tokens=3), None, name="chat") != same
    assert digest([[1, 2]]) != digest([[1], [2]])  # lengths are part of it
    assert digest([np.array([1, 2])]) == digest([[np.int64(1), 2]]) == digest([[1, 2]])  # numbers by value
    assert digest([np.array([1, 3])]) != digest([[1, 2]])
    assert digest({"b": 1, "a": 2}) == digest({"a": 2, "b": 1})  # no hash seed decides an order
    assert digest(torch.float32) != digest(torch.bfloat16)  # dtypes, paths and devices by their names
    assert digest(Path("a")) != digest(Path("b")) and digest(torch.device("cpu")) != digest(torch.device("meta"))
