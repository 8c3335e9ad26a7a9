"""Rotary embeddings of a step's queries and keys on a GPU in one Triton kernel.

Compiled, inductor wrote `q * cos + rotate_half(q) * sin` and the same for k as a kernel each, with index kernels for
the cos/sin rows: 36 of the 207 kernels of a batch-1 decode step of the 1.1B model, 39 us on an H200, where this
kernel's 16 take 37 us (docs/performance.md, issue 25). One program per token rotates all its query and key heads,
reading q and k where the QKV projection left them (column slices of its output) and writing them contiguous, as the
attention kernels read them.

Each product and the sum round to the tensors' dtype as PyTorch's eager operators do (cos and sin rounded to it
first), and the kernel is launched without fused multiply-adds, so its output equals the eager expression's bit for
bit (the compiled expression rounds bf16 once, at the end). On the CPU it runs in Triton's interpreter when
TRITON_INTERPRET=1 was set before triton was imported (tests only); the model calls it for CUDA tensors alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_shift.kernels import next_pow2


@triton.jit
def _rotate_heads(x_ptr, stride_h, out_ptr, heads, num_heads, dims, dim_ok, cos1, cos2, sin1, sin2,
                  HALF: tl.constexpr):
    """out[h] = x[h] * cos + rotate_half(x[h]) * sin for the heads of one token, halves apart."""
    ok = (heads[:, None] < num_heads) & dim_ok[None, :]
    first = x_ptr + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out1 = (x1 * cos1[None, :]).to(dtype).to(tl.float32) + ((-x2) * sin1[None, :]).to(dtype).to(tl.float32)
    out2 = (x2 * cos2[None, :]).to(dtype).to(tl.float32) + (x1 * sin2[None, :]).to(dtype).to(tl.float32)
    at = out_ptr + heads[:, None] * (2 * HALF) + dims[None, :]
    tl.store(at, out1.to(dtype), mask=ok)
    tl.store(at + HALF, out2.to(dtype), mask=ok)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, positions_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, num_positions,
                   Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                   K_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    # the engine keeps positions within the table (max_model_len <= max_position_embeddings); clamped for safety
    position = tl.minimum(tl.maximum(tl.load(positions_ptr + token).to(tl.int64), 0), num_positions - 1)
    dims = tl.arange(0, HALF_PAD)
    dim_ok = dims < HALF
    cos_row = cos_sin_ptr + position * (2 * HALF) + dims  # cos_sin [2, num_positions, 2 * HALF]
    sin_row = cos_row + num_positions * (2 * HALF)
    dtype = q_out_ptr.dtype.element_ty
    cos1 = tl.load(cos_row, mask=dim_ok, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_row + HALF, mask=dim_ok, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_row, mask=dim_ok, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_row + HALF, mask=dim_ok, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, q_out_ptr + token * (Q_HEADS * 2 * HALF),
                  tl.arange(0, Q_HEADS_PAD), Q_HEADS, dims, dim_ok, cos1, cos2, sin1, sin2, HALF)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, k_out_ptr + token * (K_HEADS * 2 * HALF),
                  tl.arange(0, K_HEADS_PAD), K_HEADS, dims, dim_ok, cos1, cos2, sin1, sin2, HALF)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated, contiguous: q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] of unit stride in
    their last dimension, positions [tokens] (int32 or int64, each < cos_sin.shape[1]), cos_sin [2, positions,
    head_dim] float32 contiguous (torch_shift.models.fused.gpu_rotary_applies)."""
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    assert q.stride(2) == k.stride(2) == 1 and head_dim % 2 == 0 and cos_sin.is_contiguous(), (q.stride(), k.stride())
    q_out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, k_heads, head_dim), dtype=k.dtype, device=k.device)
    if tokens:
        half = head_dim // 2
        launch = _rotary_kernel
        if q.device.type == "cpu":
            from triton.runtime.interpreter import InterpretedFunction

            launch = InterpretedFunction(_rotary_kernel.fn)
        elements = next_pow2(q_heads) * next_pow2(half)
        launch[(tokens,)](q, k, positions, cos_sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                          cos_sin.shape[1], Q_HEADS=q_heads, K_HEADS=k_heads, Q_HEADS_PAD=next_pow2(q_heads),
                          K_HEADS_PAD=next_pow2(k_heads), HALF=half, HALF_PAD=next_pow2(half),
                          num_warps=min(8, max(1, elements // 256)), enable_fp_fusion=False)
    return q_out, k_out
