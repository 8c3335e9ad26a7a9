"""Training -> inference handoff on CPU ranks (gloo): FSDP2 (+ TP) training weights served by the
engine without touching disk; the tokens equal those of the same weights loaded from disk, and
training goes on as if the handoff had not happened."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_hf_model, random_prompts
from safetensors.torch import save_file

from torch_shift import LLM, SamplingParams
from torch_shift.handoff import handoff, handoff_from_dcp
from torch_shift.models.sources import half_split_rope_rows, torchtitan_to_hf_name
from torch_shift.models.toy import build_tokenizer
from torch_shift.parallel.launch import run_ranks

GREEDY = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
PROMPT_LENGTHS = [5, 19, 2, 11]


def _training_model(world: int, train_tp: int):
    """transformers' Llama under TP (`parallelize_module`) over "tp" and FSDP2 over "dp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = build_hf_model("llama", seed=0)
    model.train()
    mesh = init_device_mesh("cpu", (world // train_tp, train_tp), mesh_dim_names=("dp", "tp"))
    for layer in model.model.layers:
        if train_tp > 1:
            parallelize_module(layer, mesh["tp"], {
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, optimizer, steps: int, seed: int) -> list[float]:
    generator = torch.Generator().manual_seed(seed)  # the same batches on every rank
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, model.config.vocab_size, (4, 24), generator=generator)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _full_weights(model) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _handoff_rank(rank, world, train_tp, sp, tp, tmp_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo")  # as a torchrun training script does
    model, optimizer = _training_model(world, train_tp)
    control, control_optimizer = _training_model(world, train_tp)  # the same run without a handoff
    _train(model, optimizer, 3, seed=1)
    _train(control, control_optimizer, 3, seed=1)

    before = _full_weights(model)
    if rank == 0:  # the same weights on disk, for the reference engine in the test process
        save_file({k: v.contiguous() for k, v in before.items()}, f"{tmp_dir}/disk/model.safetensors")
    prompts = random_prompts(4, PROMPT_LENGTHS, seed=3)
    llm = handoff(model, model.config.to_dict(), tokenizer=f"{tmp_dir}/disk", sp=sp, tp=tp, shift_threshold=16)
    from_memory = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    text = llm.generate("the model", GREEDY, use_tqdm=False)[0].outputs[0].text
    layouts = dict(llm.engine.model.layout_counts)
    untouched = all(torch.equal(before[k], v) for k, v in _full_weights(model).items())

    dcp.save(model.state_dict(), checkpoint_id=f"{tmp_dir}/dcp")
    llm = handoff_from_dcp(f"{tmp_dir}/dcp", model.config.to_dict(), sp=sp, tp=tp, shift_threshold=16)
    from_dcp = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    losses = _train(model, optimizer, 2, seed=2)
    control_losses = _train(control, control_optimizer, 2, seed=2)
    after, control_after = _full_weights(model), _full_weights(control)
    resumed_identically = losses == control_losses and all(torch.equal(after[k], control_after[k]) for k in after)
    moved = any(not torch.equal(after[k], before[k]) for k in after)
    dist.barrier()
    dist.destroy_process_group()
    return from_memory, from_dcp, text, layouts, untouched, resumed_identically, moved


CASES = [(2, 1, 2, 1), (2, 2, 1, 2), (4, 2, 2, 2), (4, 1, 1, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("world,train_tp,sp,tp", CASES,
                         ids=[f"world{w}-train_tp{t}-sp{s}tp{p}" for w, t, s, p in CASES])
def test_handoff_serves_training_weights_and_training_resumes(tmp_path, world, train_tp, sp, tp):
    (tmp_path / "disk").mkdir()
    hf_model = build_hf_model("llama")
    (tmp_path / "disk" / "config.json").write_text(json.dumps({**hf_model.config.to_dict(), "dtype": "float32"}))
    build_tokenizer(tmp_path / "disk", vocab_size=hf_model.config.vocab_size)
    results = run_ranks(_handoff_rank, world, train_tp, sp, tp, str(tmp_path), timeout_s=600)

    reference = LLM(str(tmp_path / "disk"))
    expected = [o.outputs[0].token_ids for o in
                reference.generate(random_prompts(4, PROMPT_LENGTHS, seed=3), GREEDY, use_tqdm=False)]
    expected_text = reference.generate("the model", GREEDY, use_tqdm=False)[0].outputs[0].text
    for from_memory, from_dcp, text, layouts, untouched, resumed_identically, moved in results:
        assert from_memory == expected
        assert from_dcp == expected
        assert text == expected_text
        assert ("shift" in layouts) == (sp > 1)  # with SP = 1 the base layout is full TP already
        assert untouched, "the handoff changed the training weights"
        assert resumed_identically, "training after the handoff differs from training without it"
        assert moved, "training did not go on"


def test_handoff_outside_the_training_world_is_refused(llama):
    hf_model, _ = llama
    with pytest.raises(ValueError, match="sp \\* tp = 2 must equal the world size"):
        handoff(hf_model, hf_model.config.to_dict(), sp=2)


def test_single_process_handoff_of_plain_tensors(llama):
    hf_model, model_dir = llama
    prompts = random_prompts(3, [4, 9, 1], seed=7)
    ref = [o.outputs[0].token_ids for o in LLM(str(model_dir)).generate(prompts, GREEDY, use_tqdm=False)]
    for config in (hf_model.config.to_dict(), None):  # None: read from the model
        got = handoff(hf_model, config).generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == ref
    with pytest.raises(TypeError, match="needs the model's config"):
        handoff(hf_model.state_dict())


def test_a_head_beside_a_tied_embedding_must_be_the_embedding(llama, tmp_path):
    """As a checkpoint directory is checked: a config that ties the head, with the source holding another
    lm_head.weight, is refused (the engine served the embedding as the head, silently other tokens); a tied model's
    one parameter under both names is taken."""
    import torch.distributed.checkpoint as dcp

    hf_model, _ = llama
    untied = {n: t.detach() for n, t in hf_model.state_dict().items()}
    tied_config = hf_model.config.to_dict() | {"tie_word_embeddings": True}
    with pytest.raises(ValueError, match="ties the LM head to the embedding .* 'lm_head.weight' differs from "
                                         "'model.embed_tokens.weight'"):
        handoff(untied, tied_config)
    dcp.save(untied, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(ValueError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        handoff_from_dcp(str(tmp_path / "dcp"), tied_config)
    tied = build_hf_model("llama_tied", seed=0)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight  # one parameter under both names
    prompts = random_prompts(2, [4, 9], seed=7)
    got = handoff({n: t.detach() for n, t in tied.named_parameters()} | {"lm_head.weight": tied.lm_head.weight},
                  tied.config.to_dict()).generate(prompts, GREEDY, use_tqdm=False)
    with torch.no_grad():
        want = [tied.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]
    assert [o.outputs[0].token_ids for o in got] == want


def test_torchtitan_names_and_rope_rows(llama):
    """torchtitan names map explicitly; its interleaved-RoPE q/k rows become half-split rows."""
    assert torchtitan_to_hf_name("layers.3.attention.qkv_linear.wk.weight") == "model.layers.3.self_attn.k_proj.weight"
    assert torchtitan_to_hf_name("layers.3.attention.wk.weight") == "model.layers.3.self_attn.k_proj.weight"
    assert torchtitan_to_hf_name("layers.0.feed_forward.w2.weight") == "model.layers.0.mlp.down_proj.weight"
    assert torchtitan_to_hf_name("tok_embeddings.weight") == "model.embed_tokens.weight"
    assert torchtitan_to_hf_name("layers.0.attention.rotary") is None
    # one head of dim 4: interleaved pairs (r0, r1), (r2, r3) -> half-split pairs (r0, r2), (r1, r3)
    w = torch.arange(8.0).reshape(4, 2)
    assert half_split_rope_rows(w, 1)[:, 0].tolist() == [0.0, 4.0, 2.0, 6.0]


def _torchtitan_rank(rank, world, sp, tp, tmp_dir):
    import torch.distributed as dist
    import torchtitan_llama
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = torchtitan_llama.build(seed=0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):
        batch = torch.randint(0, torchtitan_llama.VOCAB, (2, 17), generator=generator)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    before = _full_weights(model)
    if rank == 0:  # torchtitan's own converter writes the reference checkpoint
        _, adapter_cls = torchtitan_llama.import_llama3()
        hf = adapter_cls(torchtitan_llama.tiny_llama3_config(), None).to_hf(before)
        save_file({k: v.contiguous() for k, v in hf.items()}, f"{tmp_dir}/model.safetensors")
    config = torchtitan_llama.hf_config() if world == 2 else None  # None: read from the model
    llm = handoff(model, config, sp=sp, tp=tp, shift_threshold=16)
    tokens = [o.outputs[0].token_ids for o in
              llm.generate(random_prompts(4, PROMPT_LENGTHS, seed=3), GREEDY, use_tqdm=False)]
    untouched = all(torch.equal(before[k], v) for k, v in _full_weights(model).items())
    dist.barrier()
    dist.destroy_process_group()
    return tokens, untouched


@pytest.mark.slow
@pytest.mark.parametrize("world,sp,tp", [(2, 1, 2), (4, 2, 2)])
def test_torchtitan_llama3_handoff(tmp_path, world, sp, tp):
    import torchtitan_llama

    if torchtitan_llama.import_llama3() is None:
        pytest.skip("torchtitan is not installed (pip install torch_shift[torchtitan]) or does not import with this "
                    "torch")
    (tmp_path / "config.json").write_text(json.dumps(torchtitan_llama.hf_config()))
    results = run_ranks(_torchtitan_rank, world, sp, tp, str(tmp_path), timeout_s=600)
    expected = [o.outputs[0].token_ids for o in
                LLM(str(tmp_path)).generate(random_prompts(4, PROMPT_LENGTHS, seed=3), GREEDY, use_tqdm=False)]
    assert len(set(map(tuple, expected))) > 1  # the prompts lead to different continuations
    for tokens, untouched in results:
        assert tokens == expected
        assert untouched


@pytest.mark.slow
def test_train_and_handoff_example_under_torchrun():
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "train_and_handoff.py"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(example),
         "--steps", "4", "--resume-steps", "2", "--train-tp", "2", "--sp", "2", "--tp", "1", "--max-tokens", "5"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert sum(line.startswith("[generate]") for line in lines) == 2
    assert any("handoff to sp=2 tp=1" in line for line in lines)
    assert sum(line.startswith("[train] step") for line in lines) == 4  # 2 logged before, 2 after the handoff
