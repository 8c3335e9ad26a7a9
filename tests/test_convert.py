"""`torch-shift convert`: converted checkpoints load to the same weights and logits as the Hugging Face files."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import FAMILIES, engine_logits, random_prompts, rewrite_config, save_checkpoint
from safetensors.torch import save_file
from test_shift import PARAMS, PROMPT_LENGTHS, assert_same_outputs, reference

import torch_shift.models.convert as convert_module
from torch_shift import LLM
from torch_shift.cli import main
from torch_shift.config import ModelConfig
from torch_shift.engine.llm_engine import EngineArgs, LLMEngine
from torch_shift.models.convert import convert_checkpoint
from torch_shift.models.loader import CONVERTED_MANIFEST, CheckpointReader
from torch_shift.parallel.launch import run_ranks
from torch_shift.parallel.shift import build_shift_module


@pytest.fixture(scope="session")
def converted(checkpoints, tmp_path_factory):
    """family -> converted directory (float32, small shards so the index spans several files)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            _, model_dir = checkpoints(family)
            out = tmp_path_factory.mktemp(f"{family}-converted") / "ckpt"
            cache[family] = convert_checkpoint(model_dir, out, max_shard_bytes=100_000, progress=False)
        return cache[family]

    return get


def test_layout_of_the_converted_directory(checkpoints, converted):
    _, model_dir = checkpoints("llama_tied")
    out = converted("llama_tied")
    manifest = json.loads((out / CONVERTED_MANIFEST).read_text())
    tensors = manifest["tensors"]
    assert "lm_head.weight" not in tensors  # tied: stored once
    assert tensors["layers.0.attn.qkv_proj.weight.k"]["part"] == "k"
    assert tensors["layers.1.mlp.down_proj.weight"]["transposed"]
    assert not tensors["layers.1.mlp.gate_up_proj.weight.up"]["transposed"]
    assert len({e["file"] for e in tensors.values()}) > 1
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).is_file()
    assert ModelConfig.from_dir(out) == ModelConfig.from_dir(model_dir)
    assert not list(out.parent.glob(".*partial*"))
    # the shards as readable as the umask makes the config (safetensors writes its files owner-only)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.glob("*.safetensors")}
    assert set(modes.values()) == {(out / "config.json").stat().st_mode & 0o777}, modes


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_single_rank_logits_identical_to_the_hf_directory(checkpoints, converted, family):
    _, model_dir = checkpoints(family)
    prompt = random_prompts(1, [30], seed=5)[0]
    from_hf = engine_logits(LLMEngine(EngineArgs(str(model_dir), max_num_batched_tokens=16)), prompt)
    from_converted = engine_logits(LLMEngine(EngineArgs(str(converted(family)), max_num_batched_tokens=16)), prompt)
    assert torch.equal(from_hf, from_converted)


def test_dtype_conversion_equals_loading_in_that_dtype(checkpoints, tmp_path):
    _, model_dir = checkpoints("qwen2")
    out = convert_checkpoint(model_dir, tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    prompt = random_prompts(1, [12], seed=1)[0]
    from_hf = engine_logits(LLMEngine(EngineArgs(str(model_dir), dtype="bfloat16")), prompt)
    from_converted = engine_logits(LLMEngine(EngineArgs(str(out))), prompt)  # "auto": the stored dtype
    assert from_converted.dtype == torch.bfloat16
    assert torch.equal(from_hf, from_converted)


def _mesh_rank(rank, world, hf_dir, converted_dir):
    # the shards as read (packing them for the matmul, which drops the dense copies, is tested elsewhere)
    llm = LLM(str(converted_dir), sp=2, tp=2, shift_threshold=16, prepack_weights=False)
    engine = llm.engine
    # the same ranks load the Hugging Face files: every shard of both layouts must be byte-equal
    from_hf = build_shift_module(engine.model_config, engine.parallel.groups.replica,
                                 CheckpointReader(hf_dir, engine.model_config), engine.dtype, engine.device,
                                 shift_threshold=16)
    unequal = []
    for layout in ("base", "shift"):
        got = getattr(engine.model, layout).state_dict()
        for name, tensor in getattr(from_hf, layout).state_dict().items():
            if not torch.equal(got[name], tensor):
                unequal.append(f"{layout}.{name}")
    outputs = llm.generate(random_prompts(6, PROMPT_LENGTHS), PARAMS, use_tqdm=False)
    return unequal, outputs, dict(engine.model.layout_counts)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sp2_tp2_mesh_reads_the_same_shards_as_the_hf_directory(checkpoints, converted, family):
    _, model_dir = checkpoints(family)
    ref = reference(model_dir)
    for unequal, outputs, counts in run_ranks(_mesh_rank, 4, model_dir, converted(family)):
        assert unequal == []
        assert_same_outputs(outputs, ref)
        assert counts["base"] >= 1 and counts["shift"] >= 1


def test_missing_shard_fails_before_writing(checkpoints, tmp_path):
    hf_model, _ = checkpoints("llama")
    sharded = save_checkpoint(hf_model, tmp_path / "sharded", max_shard_size="100KB")
    shard = sorted(sharded.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"missing: {shard.name}"):
        convert_checkpoint(sharded, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sharded"]


def test_wrong_shape_and_unknown_architecture_through_the_cli(checkpoints, tmp_path, capsys):
    hf_model, _ = checkpoints("llama")
    wrong = save_checkpoint(hf_model, tmp_path / "wrong", with_tokenizer=False)
    rewrite_config(wrong, intermediate_size=96)
    assert main(["convert", "--model", str(wrong), "--out", str(tmp_path / "out")]) == 2
    assert "has shape (64, 128), config.json implies (64, 96)" in capsys.readouterr().err

    rewrite_config(wrong, intermediate_size=128, architectures=["GPT2LMHeadModel"])
    assert main(["convert", "--model", str(wrong), "--out", str(tmp_path / "out")]) == 2
    assert "GPT2LMHeadModel" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wrong"]


def test_failure_midway_leaves_nothing_that_looks_valid(checkpoints, tmp_path, monkeypatch):
    _, model_dir = checkpoints("llama")
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(convert_module, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(model_dir, tmp_path / "out", max_shard_bytes=100_000, progress=False)
    assert list(tmp_path.iterdir()) == []  # neither the output nor the staging directory


def test_existing_output_and_overwrite(checkpoints, tmp_path):
    _, model_dir = checkpoints("llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists"):
        convert_checkpoint(model_dir, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["convert", "--model", str(model_dir), "--out", str(out), "--overwrite"]) == 0
    assert (out / CONVERTED_MANIFEST).is_file() and not (out / "keep.txt").exists()
    with pytest.raises(ValueError, match="already a torch_shift checkpoint"):
        convert_checkpoint(out, tmp_path / "again", progress=False)


def test_converted_checkpoint_with_a_missing_file_is_a_clear_error(converted, tmp_path):
    out = shutil.copytree(converted("llama"), tmp_path / "copy")
    victim = min(out.glob("model-*.safetensors"))
    victim.unlink()
    with pytest.raises(ValueError, match=f"missing: {victim.name}"):
        LLMEngine(EngineArgs(str(out)))
