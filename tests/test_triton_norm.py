"""The GPU's RMSNorm kernel, with and without the residual add (torch_shift.kernels.triton_norm), against the
model's PyTorch expression: on a GPU natively, on the CPU in Triton's interpreter (a subprocess with
TRITON_INTERPRET=1, set before triton is imported). The model with it against transformers on a GPU is in
tests/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

EPS = 1e-5
# (rows, hidden): a hidden size not a power of two; no rows (an SP rank's empty forward)
SHAPES = [(1, 2048), (5, 1000), (3, 64), (0, 128)]


def expression(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def check_norm(device: str, dtypes: list[torch.dtype]) -> None:
    """x as a column slice of a wider tensor (as q/k/v split out of one projection are) and contiguous; the residual
    sum equal to PyTorch's add bit for bit (but for bf16 in the interpreter, which rounds float32 to bf16 toward
    zero), the norm within a rounding of the expression (its sum of squares is added in another order)."""
    from torch_shift.kernels import triton_norm

    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        tolerance = {"rtol": 1e-5, "atol": 1e-5}
        if dtype != torch.float32:  # a bf16 rounding; two where the interpreter truncates twice
            tolerance = {"rtol": 1.6e-2 if device != "cpu" else 3.2e-2, "atol": 1e-2}
        for rows, hidden in SHAPES:
            wide = (torch.randn(rows, hidden + 8, generator=gen) * 3).to(device, dtype)
            residual = torch.randn(rows, hidden, generator=gen).to(device, dtype)
            weight = torch.randn(hidden, generator=gen).to(device, dtype)
            for x in (wide[:, 8:], wide[:, :hidden].contiguous()):
                out, summed = triton_norm.rms_norm(x, weight, EPS)
                assert summed is None
                torch.testing.assert_close(out, expression(x, weight), **tolerance)
                out, summed = triton_norm.rms_norm(x, weight, EPS, residual)
                if device != "cpu" or dtype == torch.float32:
                    assert torch.equal(summed, x + residual), (dtype, rows, hidden)
                torch.testing.assert_close(summed, x + residual, **tolerance)
                torch.testing.assert_close(out, expression(x + residual, weight), **tolerance)


def test_norm_matches_the_expression():
    if torch.cuda.is_available():
        check_norm("cuda", [torch.float32, torch.bfloat16, torch.float16])
    else:
        from test_triton_attention import _interpreted

        _interpreted("import torch, test_triton_norm as t; t.check_norm('cpu', [torch.float32, torch.bfloat16])")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_model_norm_runs_one_kernel_on_the_gpu():
    """RMSNorm with a residual on CUDA rows, without autograd (as the engine runs it), is one kernel and gives
    PyTorch's sum bit for bit."""
    from torch_shift.models.decoder import RMSNorm

    norm = RMSNorm(256, EPS).cuda().to(torch.bfloat16)
    x, residual = (torch.randn(4, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, summed = norm(x, residual)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels == ["_rms_norm_kernel"], kernels
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(out, expression(x + residual, norm.weight), rtol=1.6e-2, atol=1e-2)
