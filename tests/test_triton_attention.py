"""The paged Triton attention (backend "triton") against the float64 reference of test_attention_backends, and
in the engine against the SDPA backend: on a GPU natively, on the CPU in Triton's interpreter (a subprocess
with TRITON_INTERPRET=1, which must be set before triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

HERE = Path(__file__).parent
# (heads, kv_heads, head_dim, block_size): GQA groups of 4, 1, 2, 4 and 1, head dims not a power of two
SHAPES = [(8, 2, 16, 4), (4, 4, 64, 16), (6, 3, 16, 16), (4, 1, 8, 32), (8, 8, 80, 16)]


def on_device(cache, batch, device):
    """A step of make_step (built on the CPU) with its cache and tensors on `device`."""
    from torch_shift.kv.cache import KVCache

    moved = KVCache.__new__(KVCache)
    moved._init(cache.k_store.to(device), cache.v_all.to(device))
    return moved, replace(batch, slot_mapping=batch.slot_mapping.to(device), positions=batch.positions.to(device))


def check_kernel(device: str, dtypes: list[torch.dtype]) -> None:
    from torch_shift.attention import triton_paged

    check_split_decode(device)
    default, by_sdpa_default = triton_paged.SPLIT_KEYS, triton_paged.SDPA_PROMPT_TOKENS
    for split_keys in (default, 64):  # 64: the decode context of 200 in chunks
        triton_paged.SPLIT_KEYS = split_keys
        try:
            for by_sdpa in (None, 1):  # fresh prompts through the paged kernel, and through SDPA
                triton_paged.SDPA_PROMPT_TOKENS = by_sdpa
                check_kernel_against_reference(device, dtypes)
        finally:
            triton_paged.SPLIT_KEYS, triton_paged.SDPA_PROMPT_TOKENS = default, by_sdpa_default


def check_split_decode(device: str) -> None:
    """A decode step launched for more chunks than its contexts need (a CUDA graph's, launched for any context)
    computes exactly what it computes split as its contexts need, and unsplit where they fit one chunk; with the
    decode rows' keys and values written by the K/V write kernel instead of the decode launch, the same outputs and
    the same cache."""
    from test_attention_backends import make_step

    from torch_shift.attention import attention_backend, triton_paged

    sinks = torch.linspace(-2.0, 3.0, 8)
    cases = [(dtype, runs, window, sink) for dtype in (torch.float32, torch.bfloat16) for runs, window, sink in (
        ([(0, 1), (37, 1), (60, 1)], None, None), ([(3, 1), (50, 1), (20, 1)], 9, sinks),
        ([(3, 1), (200, 1), (90, 1)], None, None), ([(3, 1), (200, 1), (90, 1)], 70, sinks))]
    for dtype, runs, window, sink in cases:
        defaults = triton_paged.SPLIT_KEYS, triton_paged.DECODE_WRITES_KV
        triton_paged.SPLIT_KEYS = 64
        try:
            outs, caches = [], []
            # the decode rows' K/V written by the decode launch, and (False) by the K/V write kernel first
            for extra, writes in ((0, True), (3, True), (0, False)):
                triton_paged.DECODE_WRITES_KV = writes
                cache, batch, q, k, v, _ = make_step(runs, 8, 2, 16, 4, dtype, window, num_layers=1, sinks=sink)
                cache, batch = on_device(cache, batch, device)
                q, k, v = q.to(device), k.to(device), v.to(device)
                attention = attention_backend("triton", torch.device(device), dtype).build(batch, cache)
                assert attention.metadata.decode_splits == -(-max(c + 1 for c, _ in runs) // 64)
                attention.metadata.decode_splits += extra
                outs.append(attention(0, q, k, v, None if sink is None else sink.to(device), window))
                caches.append((cache.k_store, cache.v_all))
        finally:
            triton_paged.SPLIT_KEYS, triton_paged.DECODE_WRITES_KV = defaults
        for out, (k_store, v_all) in zip(outs[1:], caches[1:]):
            assert torch.equal(outs[0], out), (dtype, runs, (outs[0] - out).abs().max())
            assert torch.equal(caches[0][0], k_store) and torch.equal(caches[0][1], v_all), (dtype, runs)


def check_kernel_against_reference(device: str, dtypes: list[torch.dtype]) -> None:
    from test_attention_backends import RUNS, TOLERANCE, make_step

    from torch_shift.attention import attention_backend
    from torch_shift.attention.triton_paged import write_kv

    sinks = torch.linspace(-2.0, 3.0, 8)
    cases = [(shape, window, None) for shape in SHAPES for window in (None, 9)] + [((8, 2, 16, 4), 9, sinks)]
    for dtype in dtypes:
        for (heads, kv_heads, head_dim, block_size), window, sink in cases:
            cache, batch, q, k, v, reference = make_step(RUNS, heads, kv_heads, head_dim, block_size, dtype, window,
                                                         num_layers=2, sinks=sink)
            cache, batch = on_device(cache, batch, device)
            q, k, v = q.to(device), k.to(device), v.to(device)
            attention = attention_backend("triton", torch.device(device), dtype).build(batch, cache)
            out = attention(1, q, k, v, None if sink is None else sink.to(device), window)
            assert out.dtype == dtype and out.shape == q.shape
            error = (out.double().cpu() - reference).abs().max()
            bound = TOLERANCE[dtype] * (4 if sink is not None else 1) * max(1.0, reference.abs().max())
            assert error < bound, (dtype, heads, kv_heads, head_dim, block_size, window, error)
            # the step's own keys and values are in their slots for the next step
            blocks, offsets = batch.slot_mapping // block_size, batch.slot_mapping % block_size
            assert torch.equal(cache.k[1][blocks, offsets], k) and torch.equal(cache.v[1][blocks, offsets], v)
    # a slot of -1 (a CUDA graph's padding row) writes nothing
    cache, batch, q, k, v, _ = make_step(RUNS, 8, 2, 16, 4, torch.float32, num_layers=1)
    cache, batch = on_device(cache, batch, device)
    before = cache.k_store.clone(), cache.v_all.clone()
    write_kv(cache, 0, torch.full_like(batch.slot_mapping, -1), k.to(device), v.to(device))
    assert torch.equal(cache.k_store, before[0]) and torch.equal(cache.v_all, before[1])


def check_engine(device: str, model_dir: str) -> None:
    """Greedy tokens with the Triton backend equal the SDPA backend's, chunked prompts and preemption included; decode
    steps through the CUDA graphs' static inputs too, with the model eager and compiled, and scheduled
    asynchronously (input ids from the device); decode contexts split in chunks of 32 keys (as the graphs' steps
    split them: into chunks for the longest context)."""
    from torch_shift.attention import triton_paged

    defaults = triton_paged.SPLIT_KEYS, triton_paged.DECODE_LAUNCH["BLOCK_N"], triton_paged.SDPA_PROMPT_TOKENS
    triton_paged.SPLIT_KEYS = triton_paged.DECODE_LAUNCH["BLOCK_N"] = 32
    try:
        check_engine_outputs(device, model_dir)
    finally:
        triton_paged.SPLIT_KEYS, triton_paged.DECODE_LAUNCH["BLOCK_N"], triton_paged.SDPA_PROMPT_TOKENS = defaults


def check_engine_outputs(device: str, model_dir: str) -> None:
    from conftest import random_prompts

    from torch_shift import LLM, SamplingParams
    from torch_shift.attention import triton_paged

    prompts = random_prompts(6, [3, 17, 40, 1, 9, 33])
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    args = {"device": device, "max_num_batched_tokens": 24, "num_kv_blocks": 40, "block_size": 4,
            "max_model_len": 96}
    outputs = {}
    engines = (("sdpa", "sdpa"), ("triton", "triton"), ("triton, prompts by sdpa", "triton"), ("static", "triton"),
               ("static compiled", "triton"), ("triton async", "triton"), ("static async", "triton"))
    for name, backend in engines:
        triton_paged.SDPA_PROMPT_TOKENS = 10 if name == "triton, prompts by sdpa" else None  # some of them
        llm = LLM(model_dir, attention_backend=backend, compile=name == "static compiled",
                  async_scheduling=name.endswith("async"), cuda_graphs=name.startswith("static") and device == "cuda",
                  **args)
        if name == "triton" and device == "cpu":  # the start-up step a GPU runs (blocks 0 and 1 written, then reused)
            llm.engine.runner._warm_up_attention()
        if name.startswith("static"):  # decode steps through the CUDA graphs' static inputs (eager where not captured)
            from torch_shift.engine.cuda_graphs import DecodeGraphs

            runner = llm.engine.runner
            if device == "cpu":
                (layout,) = runner.deployment.layouts
                runner.graphs = DecodeGraphs(runner.model, layout, runner.kv_cache, 8, 96, None)
                runner.graphs.buckets = [2, 4, 8]  # steps of 1-8 decodes, padded
            assert runner.graphs is not None
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if name.startswith("static"):
            assert llm.engine.runner.graphs.num_replays >= params.max_tokens - 1
    assert outputs["triton"] == outputs["sdpa"] == outputs["static"] == outputs["static compiled"]
    assert outputs["triton, prompts by sdpa"] == outputs["triton async"] == outputs["static async"] == outputs["triton"]


def check_layouts(model_dir: str) -> None:
    """Flying's bindings (DP replicas and a TP-2 group over their KV blocks viewed at width 2), Shift (SP-2 and its
    TP layout), TP-2 and Seesaw (PP-2 prefill, TP-2 decode, KV through the host tier) at world 2 with the Triton
    kernel, decode contexts split in chunks of 16 keys: tokens and logprobs as the single-device engine's. On the CPU
    with gloo: ranks cannot share one GPU through NCCL."""
    from conftest import random_prompts
    from test_flying import _generate_rank
    from test_shift import assert_same_outputs

    from torch_shift import LLM, SamplingParams
    from torch_shift.attention import triton_paged
    from torch_shift.parallel.launch import run_ranks

    prompts = random_prompts(4, [3, 17, 40, 9], seed=5)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, logprobs=3)
    ref = LLM(model_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    small = {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 16}
    layouts = ({"dp": 2, "policy": "random", "max_num_seqs": 2, "max_num_batched_tokens": 16},
               {"sp": 2, "shift_threshold": 8, **small}, {"tp": 2, **small},
               {"pp": 2, "policy": "seesaw", "num_cpu_kv_blocks": 32, **small})
    defaults = triton_paged.SPLIT_KEYS, triton_paged.DECODE_LAUNCH["BLOCK_N"]
    triton_paged.SPLIT_KEYS = triton_paged.DECODE_LAUNCH["BLOCK_N"] = 16  # the ranks are forked: they see it
    try:
        for args in layouts:
            results = run_ranks(_generate_rank, 2, model_dir, {**args, "attention_backend": "triton", "device": "cpu"},
                                prompts, params, timeout_s=600)
            for outputs, _ in results:
                assert_same_outputs(outputs, ref)
            assert results[0][1]["leaked_blocks"] == 0
            assert len(results[0][1]["steps_by_layout"]) >= (2 if "policy" in args or "sp" in args else 1), args
    finally:
        triton_paged.SPLIT_KEYS, triton_paged.DECODE_LAUNCH["BLOCK_N"] = defaults


# a kernel that loops over a scalar argument, as every kernel of the project does
_LOOP_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def loop(out, n):
    total = 0
    for i in range(0, n, 2):
        total += i
    tl.store(out, total)
out = torch.zeros(1, dtype=torch.int32)
loop[(1,)](out, 6)
assert out.item() == 6
"""


def _interpreted(code: str) -> None:
    """`code` in a Python with Triton's interpreter on; skipped where the interpreter cannot run a loop over a scalar
    argument (Triton 3.6, torch 2.11's, with NumPy 2.4: "only 0-dimensional arrays can be converted to Python
    scalars"), which the project's kernels all do."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}

    def run(source: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", source], cwd=HERE, env=env, capture_output=True, text=True,
                              timeout=600)

    result = run(code)
    if result.returncode != 0 and run(_LOOP_PROBE).returncode != 0:
        pytest.skip("Triton's interpreter cannot run a loop over a scalar argument here (Triton 3.6 with NumPy 2.4)")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def test_triton_kernel_matches_the_reference():
    if torch.cuda.is_available():
        check_kernel("cuda", [torch.float32, torch.bfloat16, torch.float16])
    else:
        _interpreted("import torch, test_triton_attention as t; t.check_kernel('cpu', [torch.float32, torch.bfloat16])")


@pytest.mark.slow
def test_triton_backend_in_the_engine_matches_sdpa(llama):
    _, model_dir = llama
    if torch.cuda.is_available():
        check_engine("cuda", str(model_dir))
    else:
        _interpreted(f"import test_triton_attention as t; t.check_engine('cpu', {str(model_dir)!r})")


_LOOP_PROBE = """
import numpy as np, torch, triton, triton.language as tl
@triton.jit
def count(out_ptr):
    n = tl.program_id(0) + 3
    total = 0
    for i in range(0, n):
        total += 1
    tl.store(out_ptr, total)
out = torch.zeros(1, dtype=torch.int32)
count[(1,)](out)
assert out.item() == 3
"""


def _interpreter_takes_loop_bounds_from_program_ids() -> bool:
    """Triton 3.6's interpreter (the GPU machine's) turns a loop bound computed from a program id, a 1-element
    array there, into an int with int(), which numpy 2.4 refuses; later interpreters squeeze it first."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    probe = subprocess.run([sys.executable, "-c", _LOOP_PROBE], env=env, capture_output=True, timeout=120)
    return probe.returncode == 0


@pytest.mark.slow
def test_every_layout_runs_the_triton_kernel(tmp_path):
    if not _interpreter_takes_loop_bounds_from_program_ids():
        pytest.skip("this Triton's interpreter cannot run a loop bounded by a program id (fixed in later Triton)")
    from conftest import build_hf_model, save_checkpoint

    model_dir = save_checkpoint(build_hf_model("llama", num_key_value_heads=4, num_hidden_layers=4), tmp_path / "kv4")
    _interpreted(f"import test_triton_attention as t; t.check_layouts({str(model_dir)!r})")


def test_metadata_slices_start_16_byte_aligned():
    """Triton compiles a kernel per alignment of each pointer argument: the step's inputs and attention metadata,
    slices of one pinned buffer on a GPU, must all start aligned whatever their sizes, or serving compiles new
    kernels step after step."""
    import numpy as np

    from torch_shift.memory import to_device

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for dtype in (np.int32, np.int64):
            for sizes in ([1, 3, 5], [7, 2, 9, 1], [4, 4], [0, 3]):
                parts = [np.arange(n) + 10 * i for i, n in enumerate(sizes)]
                tensors = to_device(parts, dtype, torch.device(device))
                assert [t.tolist() for t in tensors] == [p.tolist() for p in parts]
                assert all(t.dtype == torch.from_numpy(np.zeros(1, dtype)).dtype for t in tensors)
                assert all(t.data_ptr() % 16 == 0 for t in tensors if t.numel())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fresh_prompt_runs_on_sdpas_fused_kernels(dtype):
    """The prompt path (triton_paged.causal_attention) runs on SDPA's fused kernels or raises (FlashAttention in bf16,
    the memory-efficient kernel in fp32 on a GPU; the CPU's flash kernel here): 3-D inputs fell back to the math
    kernel, 13x slower than the paged kernel on an H200. Its result is causal attention with K/V per query head."""
    from torch_shift.attention.triton_paged import causal_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, heads, 16, generator=g).to(dtype) for heads in (8, 2, 2))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = causal_attention(q.to(device), k.to(device), v.to(device)).cpu()
    mask = torch.ones(40, 40, dtype=torch.bool).tril()
    kk, vv = k.double().repeat_interleave(4, 1), v.double().repeat_interleave(4, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) / 4.0
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vv)
    assert out.shape == q.shape and (out.double() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_a_fresh_prompts_kv_heads_are_read_in_place_with_the_bits_of_repeated_ones(monkeypatch):
    """16-bit prompts give FlashAttention each query head's K/V head in place (`enable_gqa`): the bits of K/V repeated
    per query head. Where no fused kernel takes GQA (a GPU without FlashAttention), the heads are repeated, and are
    from then on for those inputs."""
    from torch.nn.attention import sdpa_kernel

    from torch_shift.attention import triton_paged
    from torch_shift.attention.triton_paged import _PROMPT_BACKENDS, causal_attention

    g = torch.Generator().manual_seed(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(40, heads, 64, generator=g).to(device, torch.bfloat16) for heads in (8, 2, 2))
    with sdpa_kernel(_PROMPT_BACKENDS):
        repeated = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(0, 1).unsqueeze(0) for x in (q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))),
            is_causal=True)[0].transpose(0, 1)
    monkeypatch.setattr(triton_paged, "_GQA_IN_PLACE", {})
    assert torch.equal(causal_attention(q, k, v), repeated) and not triton_paged._GQA_IN_PLACE

    sdpa, asked = torch.nn.functional.scaled_dot_product_attention, []

    def no_gqa(*args, enable_gqa=False, **kwargs):
        asked.append(enable_gqa)
        if enable_gqa:
            raise RuntimeError("No available kernel. Aborting execution.")
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(triton_paged.F, "scaled_dot_product_attention", no_gqa)
    assert torch.equal(causal_attention(q, k, v), repeated) and torch.equal(causal_attention(q, k, v), repeated)
    assert asked == [True, False, False]
    assert triton_paged._GQA_IN_PLACE == {(q.device, torch.bfloat16, 64): False}
