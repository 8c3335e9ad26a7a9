"""RMSNorm on a GPU in one Triton kernel, with the residual add before it when given.

Compiled with a dynamic token count, inductor wrote a decoder layer's residual add + RMSNorm as three kernels (the
add, the sum of squares, the scaling: 3.8 us at 1 row of 2048 in a CUDA graph on an H100), where this kernel takes
1.6 us (docs/performance.md, issue 25); a decode step of a 16-layer model runs 33 norms. One program per row holds
the row in registers, so rows up to MAX_HIDDEN elements.

The add and the scaling round as PyTorch's operators do (`x + residual` in x's dtype, `weight * normed.to(dtype)`);
the sum of squares is added in another order than PyTorch's reduction, so the output may differ from the
expression's in the last bit. On the CPU the kernel runs in Triton's interpreter when TRITON_INTERPRET=1 was set
before triton was imported (tests only); the model calls it for CUDA tensors alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_shift.kernels import next_pow2

MAX_HIDDEN = 16384


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, eps, N, stride_x, stride_r,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * N + cols, x, mask=mask)
    h = x.to(tl.float32)
    mean_square = tl.sum(h * h, axis=0) / N
    normed = (h * tl.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * N + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(`weight * norm(s)`, s) for s = x + residual, or s = x (returned as None) without a residual; x and residual
    [tokens, hidden] rows of unit stride (torch_shift.models.fused.gpu_rms_norm_applies)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] <= MAX_HIDDEN, (x.shape, x.stride())
    rows, hidden = x.shape
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else None
    if rows:
        block = next_pow2(hidden)
        _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out,
                                  summed if summed is not None else out, eps, hidden, x.stride(0),
                                  residual.stride(0) if residual is not None else 0, BLOCK=block,
                                  HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 256)))
    return out, summed
