"""The GPU's rotary kernel (torch_shift.kernels.triton_rotary) against the model's eager expression: on a GPU natively,
on the CPU in Triton's interpreter (a subprocess with TRITON_INTERPRET=1, set before triton is imported). The model
with it against transformers on a GPU is in tests/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

# (tokens, heads, kv_heads, head_dim, rope): GQA, a half not a power of two, YaRN's scaled table, no tokens
CASES = [(5, 8, 2, 64, "default"), (3, 4, 4, 80, "yarn"), (1, 32, 8, 128, "default"), (0, 4, 2, 64, "default")]
MAX_POSITIONS = 300


def expression(positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_sin[:, positions].to(x.dtype).unsqueeze(2)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def check_rotary(device: str, dtypes: list[torch.dtype]) -> None:
    """q and k as column slices of one projection's output (as the model splits them), positions of either integer
    type: equal to the expression bit for bit (but for bf16 in the interpreter, which rounds float32 to bf16 toward
    zero), contiguous."""
    from torch_shift.config import RopeConfig
    from torch_shift.kernels import triton_rotary
    from torch_shift.models.rope import RotaryEmbedding

    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for tokens, heads, kv_heads, dim, rope_type in CASES:
            rope = RopeConfig(theta=10000.0, rope_type=rope_type, factor=4.0 if rope_type == "yarn" else 1.0,
                              original_max_position_embeddings=64)
            cos_sin = RotaryEmbedding(rope, dim, MAX_POSITIONS).cos_sin.to(device)
            qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 2).to(device, dtype)
            q = qkv[:, :heads * dim].view(tokens, heads, dim)
            k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
            positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=gen).to(device)
            for index in (positions, positions.to(torch.int32)):
                q_out, k_out = triton_rotary.rotary(index, q, k, cos_sin)
                assert q_out.is_contiguous() and k_out.is_contiguous()
                for out, x in ((q_out, q), (k_out, k)):
                    expected = expression(positions, x, cos_sin)
                    if device != "cpu" or dtype == torch.float32:
                        assert torch.equal(out, expected), (dtype, tokens, heads, dim, (out - expected).abs().max())
                    else:  # a bf16 rounding toward zero at each of three roundings
                        torch.testing.assert_close(out, expected, rtol=4e-2, atol=4e-2)


def test_rotary_matches_the_expression():
    if torch.cuda.is_available():
        check_rotary("cuda", [torch.float32, torch.bfloat16, torch.float16])
    else:
        from test_triton_attention import _interpreted

        _interpreted("import torch, test_triton_rotary as t; t.check_rotary('cpu', [torch.float32, torch.bfloat16])")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_model_rotary_runs_one_kernel_on_the_gpu():
    """The model's rotary embedding of CUDA q and k, without autograd (as the engine runs it), eager and compiled, is
    one kernel and gives the eager expression's result."""
    from torch_shift.config import RopeConfig
    from torch_shift.models import fused
    from torch_shift.models.rope import RotaryEmbedding

    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), 64, 128).cuda()
    qkv = torch.randn(3, 16 * 64, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, :8 * 64].view(3, 8, 64), qkv[:, 8 * 64:12 * 64].view(3, 4, 64)
    positions = torch.tensor([0, 17, 127], device="cuda")
    compiled = torch.compile(rotary, fullgraph=True)
    for forward in (rotary, compiled):
        with torch.inference_mode():
            forward(positions, q, k)  # compiled (inductor copies the table as a constant) outside the profile
        with torch.inference_mode(), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            q_out, k_out = forward(positions, q, k)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert kernels == ["_rotary_kernel"], kernels
        assert torch.equal(q_out, expression(positions, q, rotary.cos_sin))
        assert torch.equal(k_out, expression(positions, k, rotary.cos_sin))
    fused.GPU_TRITON_ROTARY = False
    try:
        with torch.inference_mode():
            assert torch.equal(rotary(positions, q, k)[0], q_out)
    finally:
        fused.GPU_TRITON_ROTARY = True
