"""`torch_shift.parallelize` on the models users hold (transformers' Llama, Mistral, Qwen2, Qwen3;
torchtitan's Llama 3; plain or DTensor weights) over 2-D and 1-D meshes: the module's logits
against the original model's in both layouts, padded batches included, and `LLM(module)`
against the single-device engine."""

from __future__ import annotations

import pytest
import torch
import torchtitan_llama
from conftest import VOCAB_SIZE, build_hf_model, random_prompts

from torch_shift import LLM, SamplingParams, parallelize
from torch_shift.models import load_model
from torch_shift.models.batch import PackedBatch
from torch_shift.parallel.launch import run_ranks

THRESHOLD = 16  # calls with more real tokens run in the base layout, the others in the shift layout


def _calls() -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(input_ids, attention_mask) per call: padded and unpadded, above and below THRESHOLD."""
    ids = torch.randint(6, VOCAB_SIZE, (3, 13), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding: 6 tokens
    mask[2, :4] = 0  # left padding: 9 tokens
    small_mask = torch.ones(2, 7, dtype=torch.long)
    small_mask[0, :2] = 0
    return [(ids, mask),              # 28 tokens: base
            (ids[:2, :7], small_mask),  # 12 tokens: shift
            (ids, None),              # 39 tokens: base
            (ids[:2, :6], None)]      # 12 tokens: shift


CALL_LAYOUTS = ["base", "shift", "base", "shift"]


def _original(family: str):
    """A conftest family ("llama", ...), or torchtitan's Llama 3 with its default RoPE ("torchtitan")
    or with CosSinRoPE ("torchtitan_cos_sin")."""
    if family.startswith("torchtitan"):
        return torchtitan_llama.build(seed=0, rope=family.partition("_")[2] or "complex")
    if family.startswith("moe_"):  # test_moe's mixtures of experts: "moe_qwen3_moe", "moe_mixtral", "moe_qwen2_moe"
        from test_moe import build_moe_model

        return build_moe_model(family.removeprefix("moe_"))
    if family == "gpt_oss":  # attention sinks sharded with the heads, windowed and full layers, expert biases
        from test_gpt_oss import build_gpt_oss

        return build_gpt_oss()
    return build_hf_model(family)


def _build(name: str, world: int):
    """The model `name` names (see _original), with "+fsdp" its parameters as DTensors (FSDP2 over
    all ranks)."""
    family, _, wrap = name.partition("+")
    model = _original(family)
    if wrap == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        blocks = model.layers.values() if family.startswith("torchtitan") else model.model.layers
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _reference(name: str) -> list[torch.Tensor]:
    """The original model's logits for each call: each padded row computed alone, unpadded."""
    family = name.partition("+")[0]
    model = _original(family)

    def logits(ids: torch.Tensor) -> torch.Tensor:
        out = model(ids)
        return out if family.startswith("torchtitan") else out.logits

    refs = []
    with torch.no_grad():
        for ids, mask in _calls():
            if mask is None:
                refs.append(logits(ids))
                continue
            ref = torch.zeros(*ids.shape, VOCAB_SIZE)
            for row in range(ids.shape[0]):
                real = mask[row].bool()
                ref[row, real] = logits(ids[row, real][None])[0]
            refs.append(ref)
    return refs


def _logits_rank(rank, world, mesh_shape, names):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch_shift

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("sp", "tp") if len(mesh_shape) == 2 else ("tp",))
    results = {}
    for name in names:
        module = torch_shift.parallelize(_build(name, world), mesh, shift_threshold=THRESHOLD)
        layouts, logits = [], []
        for ids, mask in _calls():
            module.layout_counts.clear()
            logits.append(module(ids, mask))
            layouts.append(",".join(module.layout_counts))
        results[name] = logits, layouts
    dist.barrier()
    dist.destroy_process_group()
    return results


CASES = {
    (2, 2): ["llama", "qwen2", "qwen3", "llama+fsdp", "torchtitan+fsdp", "moe_qwen3_moe", "moe_mixtral",
               "gpt_oss", "qwen3_bias", "moe_qwen2_moe"],
    (4, 1): ["llama", "qwen2", "qwen3", "mistral_window", "torchtitan", "torchtitan_cos_sin", "moe_qwen3_moe",
               "gpt_oss"],
    # a 1-D ("tp",) mesh: SP = 1
    (2,): ["llama", "qwen2", "qwen3", "torchtitan+fsdp", "moe_mixtral", "llama_bias", "moe_qwen2_moe"],
}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", list(CASES), ids=["sp2tp2", "sp4tp1", "tp2"])
def test_parallelized_module_gives_the_original_logits(mesh_shape):
    # torchtitan is an optional extra (pip install torch_shift[torchtitan])
    has_torchtitan = torchtitan_llama.import_llama3() is not None
    names = [n for n in CASES[mesh_shape] if has_torchtitan or not n.startswith("torchtitan")]
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) == 2 else 1)
    results = run_ranks(_logits_rank, world, mesh_shape, names, timeout_s=600)
    for name in names:
        refs = _reference(name)
        for logits, layouts in (r[name] for r in results):
            # with SP = 1 the base layout is full TP already: the one layout
            assert layouts == (CALL_LAYOUTS if len(mesh_shape) == 2 else ["base"] * len(CALL_LAYOUTS)), name
            for got, ref, (ids, mask) in zip(logits, refs, _calls(), strict=True):
                assert got.shape == (*ids.shape, VOCAB_SIZE)
                torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_padded_batch_packs_real_tokens_at_their_positions_in_the_row(llama):
    """Positions count the real tokens before each one in its row (transformers' `generate`); with
    RoPE a shift of all of a row's positions leaves its logits equal, so this is checked here."""
    from torch_shift.config import ModelConfig

    config = ModelConfig.from_dir(llama[1])
    ids = torch.tensor([[3, 7, 8, 9], [6, 7, 0, 0], [0, 0, 10, 11]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1]])
    batch = PackedBatch.from_padded(ids, mask, config, torch.device("cpu"))
    assert batch.input_ids.tolist() == [3, 7, 8, 9, 6, 7, 10, 11]
    assert batch.positions.tolist() == [0, 1, 2, 3, 0, 1, 0, 1]
    assert batch.seq_lens == [4, 2, 2]
    unpacked = batch.unpack(torch.arange(1.0, 9.0)[:, None])
    assert unpacked[..., 0].tolist() == [[1, 2, 3, 4], [5, 6, 0, 0], [0, 0, 7, 8]]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        PackedBatch.from_padded(ids + VOCAB_SIZE, mask, config, torch.device("cpu"))
    with pytest.raises(ValueError, match="shape"):
        PackedBatch.from_padded(ids, mask[:, :2], config, torch.device("cpu"))


GREEDY = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
PROMPT_LENGTHS = [5, 19, 2, 11]


def _llm_rank(rank, world, model_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch_shift

    dist.init_process_group("gloo")  # as under torchrun
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("sp", "tp"))
    module = torch_shift.parallelize(build_hf_model("llama"), mesh, shift_threshold=THRESHOLD)
    prompts = random_prompts(4, PROMPT_LENGTHS, seed=3)
    llm = LLM(module, tokenizer=model_dir, num_kv_blocks=64)
    from_module = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    text = llm.generate("the model", GREEDY, use_tqdm=False)[0].outputs[0].text
    layouts = dict(module.layout_counts)
    from_path = [o.outputs[0].token_ids for o in LLM(model_dir, sp=2, tp=2, shift_threshold=THRESHOLD,
                                                      num_kv_blocks=64).generate(prompts, GREEDY, use_tqdm=False)]
    dist.barrier()
    dist.destroy_process_group()
    return from_module, from_path, text, layouts


def test_llm_serves_a_parallelized_module(llama):
    _, model_dir = llama
    reference = LLM(str(model_dir))
    expected = [o.outputs[0].token_ids for o in
                reference.generate(random_prompts(4, PROMPT_LENGTHS, seed=3), GREEDY, use_tqdm=False)]
    expected_text = reference.generate("the model", GREEDY, use_tqdm=False)[0].outputs[0].text
    for from_module, from_path, text, layouts in run_ranks(_llm_rank, 4, str(model_dir)):
        assert from_module == expected
        assert from_path == expected
        assert text == expected_text
        assert layouts["base"] >= 1 and layouts["shift"] >= 1


def test_llm_serves_a_decoder_lm_and_refuses_other_modules(llama):
    hf_model, model_dir = llama
    prompts = random_prompts(3, [4, 9, 1], seed=7)
    got = LLM(load_model(model_dir), tokenizer=str(model_dir)).generate(prompts, GREEDY, use_tqdm=False)
    ref = LLM(str(model_dir)).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    with pytest.raises(TypeError, match=r"call torch_shift.parallelize\(model, mesh\) first"):
        LLM(hf_model)
    with pytest.raises(ValueError, match="sp, tp: set by the module itself"):
        LLM(load_model(model_dir), sp=2, tp=1)
    # the engine's collectives' bound is the engine's, not the module's (it was refused as "set by the module")
    assert LLM(load_model(model_dir), distributed_timeout_s=30.0).engine.config.parallel.timeout_s == 30.0


def _errors_rank(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch_shift

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    llama = build_hf_model("llama")
    errors = []
    attempts = [
        (llama.model, mesh),  # the decoder without its LM head
        (torch.nn.Linear(4, 4), mesh),
        # 3 query and KV heads do not divide over TP = 2
        (build_hf_model("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=3), mesh),
        (llama, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))),
    ]
    with torch.device("meta"):  # torchtitan's and FSDP's way to build a model before its weights
        attempts.append((build_hf_model("llama"), mesh))
    # a mesh of rank 0 alone: rank 1, not in it, failed inside torch's DeviceMesh.get_group (an IndexError)
    attempts.append((llama, init_device_mesh("cpu", (1, 1), mesh_dim_names=("sp", "tp"))))
    for model, m in attempts:
        try:
            torch_shift.parallelize(model, m)
            errors.append(None)
        except (TypeError, ValueError) as e:
            errors.append((type(e).__name__, str(e)))
    dist.destroy_process_group()
    return errors


def test_parallelizes_arguments_are_checked_before_anything_is_read():
    """Found by a probe: these were AttributeErrors, a TypeError comparing a str, or accepted silently (no group is
    made, so one process checks them)."""
    from torch.distributed.device_mesh import DeviceMesh

    class Mesh(DeviceMesh):  # never used past its type and device: every check comes first
        device_type = "cpu"

    class GpuMesh(DeviceMesh):
        device_type = "cuda"

    mesh = Mesh.__new__(Mesh)
    model = torch.nn.Linear(2, 2)
    for args, kwargs, error, words in [
        ((None, mesh), {}, TypeError, "nn.Module, got NoneType"),
        ((model, "tp"), {}, TypeError, "DeviceMesh"),
        ((model, mesh), {"shift_threshold": "256"}, ValueError, "shift_threshold must be an int >= 0"),
        ((model, mesh), {"shift_threshold": True}, ValueError, "shift_threshold must be an int >= 0"),
        ((model, mesh), {"shift_weights": "bogus"}, ValueError, "'copy' or 'view'"),
    ]:
        with pytest.raises(error, match=words):
            parallelize(*args, **kwargs)
    if not torch.cuda.is_available():  # was an AssertionError from torch.cuda
        with pytest.raises(ValueError, match="which this machine does not have"):
            parallelize(model, GpuMesh.__new__(GpuMesh))


def test_unsupported_models_and_meshes_are_clear_errors():
    for rank, (no_head, linear, heads, axes, meta, outside) in enumerate(run_ranks(_errors_rank, 2)):
        for kind, message in (no_head, linear):
            assert kind == "TypeError"
            for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                              "torchtitan's Llama 3", "DecoderLM"):
                assert supported in message
        assert "LlamaModel is not supported" in no_head[1]
        assert heads == ("ValueError", "this mesh does not fit the model: num_attention_heads=3 is not divisible "
                         "by SP x TP = 1 x 2 = 2; num_key_value_heads=3 and TP=2: neither divides the other; "
                         "num_key_value_heads=3 and SP x TP=2: neither divides the other")
        assert axes[0] == "ValueError" and "1-D with axis ('tp',)" in axes[1]
        assert meta[0] == "ValueError" and "on the meta device" in meta[1] and "to_empty" in meta[1]
        if rank == 1:
            assert outside == ("ValueError", "rank 1 is not in the mesh (it holds ranks [0] of a world of 2): every "
                               "rank that calls parallelize must be in its mesh")


def _disagreeing_rank(rank, world, model_dir):
    """Under torchrun, ranks whose calls differ: each failed inside a collective (gloo aborted the process on a size
    mismatch), hung, or ran on with another rank's layout or weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch_shift

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("sp", "tp"))
    errors = []
    calls = [
        lambda: torch_shift.parallelize(build_hf_model("llama"), mesh, shift_threshold=4 if rank else 256),
        lambda: torch_shift.parallelize(build_hf_model("llama", seed=rank), mesh),  # each rank's own random init
        lambda: torch_shift.parallelize(build_hf_model("llama", num_hidden_layers=2 + rank), mesh),
        lambda: module(ids[:, :5 + rank]),
        lambda: module(ids, torch.ones_like(ids) if rank else None),
        lambda: LLM(str(model_dir), sp=world if rank else 1, tp=1 if rank else world),
        lambda: LLM(str(model_dir), sp=world, num_kv_blocks=32 + rank, distributed_timeout_s=60.0),
    ]
    module = torch_shift.parallelize(build_hf_model("llama"), mesh)
    ids = torch.randint(6, VOCAB_SIZE, (2, 7), generator=torch.Generator().manual_seed(1))
    for call in calls:
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    # the ranks and their groups go on: the same call on every rank works
    logits = module(ids)
    dist.destroy_process_group()
    return errors, logits


def test_ranks_whose_calls_differ_all_raise_a_value_error_naming_the_difference(llama):
    _, model_dir = llama
    ranks = run_ranks(_disagreeing_rank, 2, str(model_dir), timeout_s=240)
    (errors, logits), (errors_1, logits_1) = ranks
    assert errors == errors_1 and torch.equal(logits, logits_1)
    threshold, weights, layers, batch, mask, layout, blocks = errors
    assert threshold.startswith("parallelize: the ranks differ in shift_threshold: rank 0 256, rank 1 4. Under "
                                "torchrun every rank runs the same program")
    assert "the ranks differ in weights.model.embed_tokens.weight: rank 0 ((512, 64), '" in weights
    assert "more of weights" in weights
    assert "the ranks differ in config.num_hidden_layers: rank 0 2, rank 1 3" in layers
    assert batch.startswith("a parallelized module's forward: the ranks differ in input_ids.shape: rank 0 (2, 5), "
                            "rank 1 (2, 6); input_ids.contents: ")
    assert "the ranks differ in attention_mask: rank 0 None, rank 1 {" in mask
    assert layout.startswith("LLM(...) under torchrun: the ranks differ in deployment.family: rank 0 'tp', rank 1 "
                             "'shift'; deployment.sp: rank 0 1, rank 1 2")
    assert "the ranks differ in num_kv_blocks: rank 0 32, rank 1 33" in blocks


def _partial_rank(rank, world, model_dir):
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")  # the user's group, as under torchrun
    if rank == 1:  # never builds the engine
        time.sleep(8)
        return None
    start = time.monotonic()
    try:
        LLM(model_dir, sp=2, distributed_timeout_s=4.0)
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "built", time.monotonic() - start


def test_an_engine_some_ranks_never_build_ends_with_an_error_in_its_timeout(llama):
    """Under torchrun every rank builds the engine; one that never does hung the others in the engine's group
    creation for the user's group's timeout (30 minutes): the engine's own bound ends them with an error."""
    _, model_dir = llama
    (message, seconds), _ = run_ranks(_partial_rank, 2, str(model_dir), timeout_s=120)
    assert "not every one of the 2 ranks built the engine within 4 s" in message and seconds < 30
