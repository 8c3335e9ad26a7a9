"""RMSNorm and rotary embeddings in one pass each through the CPU kernels (kernels/cpu_elementwise.cpp), where a
model runs on the CPU; and the sampler's argmax. The PyTorch expressions take 9 operators (RMSNorm) and 7 per tensor
(rotary), each a pass over the activations and a few microseconds of dispatch at a decode step. `rms_norm` and
`rotary` return None where their kernel does not apply (another device or dtype, autograd, no compiler), and the
caller computes the expression (`rms_norm_expression`, `rotary_expression`).

Under torch.compile on the CPU, RMSNorm (with the residual add before it: `add_rms_norm`, one pass over the rows),
rotary and the MLP's `silu(gate) * up` are operators the graph keeps opaque (`torch_shift::cpu_rms_norm`,
`cpu_add_rms_norm`, `cpu_rotary`, `cpu_silu_mul`), which run what the eager forward runs: inductor's own code
for them rounds differently, and a compiled engine runs its steps of up to 64 tokens through the
C++ decoder (native_decoder.py), which rounds as the eager forward. With the operators every step rounds alike, and the
GEMV kernel of small steps adds a float32 row's products in oneDNN's runs (kernels/cpu_linear.cpp;
`PackedWeight.rounds_as_onednn` checks a weight), so a float32 token's logits do not depend on the size of the step that
computed it where the GEMV reads the weights (greedy output is the same with and without speculative decoding, whose
checks change the steps' sizes); in bfloat16 on AMX oneDNN's matmul rounds some row counts otherwise (gate_up_silu).

Results are bitwise the expressions': rotary rounds each product and sum as the operators do, RMSNorm adds its
squares in the order of PyTorch's CPU sum, with the vector width found to reproduce it on this machine (where
none does, RMSNorm keeps the expression), and argmax picks the index torch.argmax picks.

On a GPU, RMSNorm of [tokens, hidden] rows, with the residual add before it, is one Triton kernel
(`torch_shift::gpu_add_rms_norm`, kernels/triton_norm.py), eager or compiled: inductor wrote the add and the norm as
three kernels there (docs/performance.md, issue 25). It rounds as the expression but for the order in which it adds
the squares. Rotary embeddings of q and k on a GPU are one Triton kernel too (`torch_shift::gpu_rotary`,
kernels/triton_rotary.py), equal to the eager expression bit for bit.
"""

from __future__ import annotations

import importlib.util
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F

from torch_shift.custom_ops import custom_op
from torch_shift.kernels import (
    CpuKernels,
    DecoderKernels,
    cpu_kernels,
    decoder_kernels,
    register_native_elementwise,
)
from torch_shift.models.linear import AMX_BF16_CODE, GEMV_MAX_ROWS, PackedWeight, packed_weight

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_SPLIT_ROW = 32768  # PyTorch's grain size: a single row this long is summed in parts over threads


@cache
def _sum_lanes() -> int | None:
    """The vector width (floats) with which the kernel adds a row's squares in the order of PyTorch's CPU sum, found
    by trying it against `x.pow(2).mean(-1)` on rows of several lengths (8 on x86: PyTorch's sum kernel runs its
    AVX2 build on AVX-512 CPUs too); None if no width reproduces it, and RMSNorm keeps the expression."""
    kernels = cpu_kernels()
    if kernels is None:
        return None
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(4, dim, generator=generator) * torch.rand(4, 1, generator=generator) * 8
            for dim in (5, 8, 17, 64, 192, 1000, 4100)]
    for lanes in (8, 16, 4):
        for x in rows:
            weight = torch.randn(x.shape[-1], generator=generator)
            expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
            if not torch.equal(_rms_norm(kernels, x, weight, 1e-6, lanes), expected):
                break
        else:
            return lanes
    return None


def _kernels(x: torch.Tensor) -> CpuKernels | None:
    if (not x.is_cpu or x.dtype not in _DTYPE_CODES or torch.compiler.is_compiling()
            or (x.requires_grad and torch.is_grad_enabled())):
        return None
    return cpu_kernels()


def _compiling_on_cpu(*tensors: torch.Tensor) -> bool:
    """Whether torch.compile traces an inference call on CPU tensors (which then takes the opaque operator)."""
    return (torch.compiler.is_compiling() and all(t.is_cpu for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def rms_norm_expression(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)` over the last dimension (in float32), for x of 2 or 3
    dimensions whose last is contiguous: [tokens, hidden], or [tokens, heads, head_dim] (a q/k norm)."""
    if _compiling_on_cpu(x, weight):
        return cpu_rms_norm(x, weight, eps)
    kernels = _kernels(x)
    if (kernels is None or x.dim() not in (2, 3) or x.stride(-1) != 1 or weight.dtype != x.dtype
            or not weight.is_contiguous() or weight.shape != x.shape[-1:] or weight.device != x.device
            or (weight.requires_grad and torch.is_grad_enabled()) or x.shape[-1] >= _SPLIT_ROW):
        return None
    lanes = _sum_lanes()
    return None if lanes is None else _rms_norm(kernels, x, weight, eps, lanes)


@custom_op("torch_shift::cpu_rms_norm")
def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager forward's RMSNorm on the CPU, kept whole by torch.compile (the module's docstring)."""
    out = rms_norm(x, weight, eps)
    return rms_norm_expression(x, weight, eps) if out is None else out


# the Python implementations under names of their own, which the C++ ones (kernels/cpu_ops.cpp) call where their
# kernels do not apply
custom_op("torch_shift::cpu_rms_norm_python")(cpu_rms_norm.__wrapped__)


@cpu_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(RMSNorm(x + residual), x + residual) in one pass over the rows on the CPU, bitwise the two operators: a
    decoder layer's residual add and the norm after it. None where the kernel does not apply (as rms_norm's, and
    x and residual contiguous, of one shape and dtype)."""
    if _compiling_on_cpu(x, residual, weight):
        return cpu_add_rms_norm(x, residual, weight, eps)
    kernels = _kernels(x)
    if (kernels is None or x.dim() < 1 or not x.is_contiguous() or not residual.is_contiguous()
            or residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device
            or (residual.requires_grad and torch.is_grad_enabled()) or weight.dtype != x.dtype
            or not weight.is_contiguous() or weight.shape != x.shape[-1:] or weight.device != x.device
            or (weight.requires_grad and torch.is_grad_enabled()) or x.shape[-1] >= _SPLIT_ROW):
        return None
    lanes = _sum_lanes()
    if lanes is None:
        return None
    out, total = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    status = kernels.add_rms_norm(_DTYPE_CODES[x.dtype], x.data_ptr(), residual.data_ptr(), rows, x.shape[-1],
                                  weight.data_ptr(), eps, lanes, total.data_ptr(), out.data_ptr())
    assert status == 0, (status, x.dtype)
    return out, total


@custom_op("torch_shift::cpu_add_rms_norm")
def cpu_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager forward's residual add and RMSNorm on the CPU, kept whole by torch.compile (the module's
    docstring)."""
    out = add_rms_norm(x, residual, weight, eps)
    if out is not None:
        return out
    total = x + residual
    return cpu_rms_norm.__wrapped__(total, weight, eps), total


custom_op("torch_shift::cpu_add_rms_norm_python")(cpu_add_rms_norm.__wrapped__)


@cpu_add_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    return torch.empty(total.shape, dtype=torch.promote_types(total.dtype, weight.dtype), device=x.device), total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` of gate_up [..., 2 * intermediate] (gate first). On the CPU in one pass of the C++
    decoder's loop where that is bitwise PyTorch's on this machine (checked once per dtype and width), else PyTorch's
    two operators; under torch.compile as the opaque `torch_shift::cpu_silu_mul`. A 512-token prefill of the 106M
    model spent 11 ms of 207 in those two on a 2-core Sapphire Rapids (docs/performance.md, issue 20)."""
    if _compiling_on_cpu(gate_up):
        return cpu_silu_mul(gate_up)
    out = _native_silu_mul(gate_up) if gate_up.is_cpu else None
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@custom_op("torch_shift::cpu_silu_mul")
def cpu_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul` on the CPU, kept whole by torch.compile (the module's docstring)."""
    return silu_mul(gate_up)


def _native_silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    intermediate = gate_up.shape[-1] // 2
    kernels = decoder_kernels()
    if (gate_up.dtype not in _DTYPE_CODES or gate_up.dim() < 2 or gate_up.requires_grad or gate_up.numel() == 0
            or kernels is None):
        return None
    lanes = _silu_lanes(gate_up.dtype, intermediate)
    if lanes is None:
        return None
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], intermediate)
    tokens = gate_up.numel() // gate_up.shape[-1]
    if kernels.silu_mul(_DTYPE_CODES[gate_up.dtype], lanes, gate_up.data_ptr(), tokens, intermediate,
                                  out.data_ptr()) != 0:
        return None
    return out


custom_op("torch_shift::cpu_silu_mul_python")(cpu_silu_mul.__wrapped__)


@cpu_silu_mul.register_fake
def _(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


# Rows of a packed float32 gate/up projection computed and activated at a time: about 8 MiB of projection, still in
# the caches when `silu(gate) * up` reads it. A step's whole projection went to memory and back, and above 32 MiB
# (glibc maps such blocks afresh for every call) its pages were faulted in on every layer: 6-10% of the CPU time of a
# float32 prefill in 2048-token steps of the 106M model (docs/performance.md, issue 20). bfloat16 packed for AMX too:
# oneDNN's AMX matmul of Qwen2.5-0.5B's gate/up (896 -> 9,728) ran at 1,200-1,450 GFLOP/s from about 1,900 rows on and
# at 2,000-2,800 up to 1,536; in 431-row chunks a 2,000-token prefill took 1.3x less time and the 64-request batch
# 1.2x (an AMX Xeon, 2 threads; docs/performance.md).
GATE_UP_CHUNK_BYTES = 8 << 20
# and at least this many rows where their projection stays under GATE_UP_MAX_CHUNK_BYTES (glibc's blocks above 32 MiB
# are the ones faulted in afresh): oneDNN's float32 matmul of the 106M model's gate/up (1,024 -> 5,632) took 1.4-2.1%
# less time on steps of 384-1,024 rows in chunks of up to 512 rows than of up to 372 (the bytes' bound), and the same
# on 2,048 (an AMX Xeon, 2 threads; docs/performance.md)
GATE_UP_MIN_CHUNK_ROWS = 512
GATE_UP_MAX_CHUNK_BYTES = 16 << 20


def gate_up_silu(gate_up_proj: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a fused gate/up projection of x [..., hidden]: a packed float32 one on the CPU, or a
    bfloat16 one packed for AMX, in chunks of rows (GATE_UP_CHUNK_BYTES, GATE_UP_MIN_CHUNK_ROWS), under torch.compile
    as the opaque `torch_shift::cpu_gate_up_silu`; eager and compiled steps chunk alike. In float32, the bits of the
    whole projection where a row's sums do not depend on how many rows oneDNN multiplies at once and PyTorch's SiLU
    splits the chunks' elements over its threads on vector boundaries, as on the machines measured (two threads;
    tests/test_fused.py); where it splits a row elsewhere the split's last elements take its scalar exp, as they already
    do in steps of other sizes. bfloat16 rows on AMX depend on the row count of oneDNN's matmul (a 128 x 1024 weight:
    100 rows at once round otherwise than 300) as they did on the step's. bfloat16 packed otherwise (AVX512-BF16
    without AMX) stays whole: not measured."""
    packed = getattr(gate_up_proj, "packed", None)
    if (packed is None or not x.is_cpu or x.dtype != packed.dtype
            or not (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and packed.gemv_code == AMX_BF16_CODE
                                                 and not packed.blocked))
            or getattr(gate_up_proj, "bias", None) is not None or getattr(gate_up_proj, "biases", None) is not None):
        return silu_mul(gate_up_proj(x))
    row_bytes = packed.out_features * x.element_size()
    chunk_rows = max(4 * GEMV_MAX_ROWS, min(GATE_UP_MIN_CHUNK_ROWS, GATE_UP_MAX_CHUNK_BYTES // row_bytes),
                     GATE_UP_CHUNK_BYTES // row_bytes)
    if _compiling_on_cpu(x):
        return cpu_gate_up_silu(x, packed.handle, packed.out_features, chunk_rows)
    return _gate_up_silu_chunks(packed, x, chunk_rows)


def _gate_up_silu_chunks(packed: PackedWeight, x: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows <= chunk_rows:
        return silu_mul(packed(x, None))
    # chunks of equal rows (or one more): each at least chunk_rows / 2, above GEMV_MAX_ROWS, so that every chunk
    # takes oneDNN's matmul, as the whole step does
    count = -(-rows // chunk_rows)
    sizes = [rows // count + (i < rows % count) for i in range(count)]
    flat = x.reshape(rows, x.shape[-1])
    out = torch.cat([silu_mul(packed(part, None)) for part in flat.split(sizes)])
    return out.view(*x.shape[:-1], packed.out_features // 2)


@custom_op("torch_shift::cpu_gate_up_silu")
def cpu_gate_up_silu(x: torch.Tensor, handle: int, out_features: int, chunk_rows: int) -> torch.Tensor:
    """gate_up_silu of the packed weight `handle`, kept whole by torch.compile (C++ in kernels/cpu_ops.cpp)."""
    return _gate_up_silu_chunks(packed_weight(handle), x, chunk_rows)


@cpu_gate_up_silu.register_fake
def _(x: torch.Tensor, handle: int, out_features: int, chunk_rows: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features // 2)


@cache
def _silu_lanes(dtype: torch.dtype, intermediate: int) -> int | None:
    """The width of PyTorch's vectorised exp (16: AVX-512, 8: AVX2) with which the C++ `silu(gate) * up` is bitwise
    PyTorch's on this machine for rows of `intermediate` (PyTorch may run its AVX2 build on an AVX-512 CPU), or None."""
    kernels = decoder_kernels()
    # the width of the build PyTorch runs (ATEN_CPU_CAPABILITY may pick AVX2 on an AVX-512 CPU), checked: the other
    # width can pass the check on its values and still round another row's remainder differently (measured)
    lanes = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability())
    found = lanes if lanes and kernels.silu_lanes & lanes and _silu_mul_matches(kernels, dtype, intermediate,
                                                                                 lanes) else None
    kernels.note_silu_lanes(_DTYPE_CODES[dtype], intermediate, found or 0)  # for the C++ operator
    return found


def register_native_operators() -> bool:
    """The C++ implementations of the three CPU operators above (kernels/cpu_ops.cpp), registered with PyTorch's
    dispatcher, so that a compiled forward's calls run no Python where their kernels apply; False where the operator
    library does not build."""
    return register_native_elementwise(_sum_lanes() or 0)


def _silu_mul_matches(kernels: DecoderKernels, dtype: torch.dtype, intermediate: int, lanes: int) -> bool:
    """Whether the C++ `silu(gate) * up` with an exp of `lanes` floats is bitwise PyTorch's for rows of
    `intermediate`: every finite bfloat16 (as gate, with up 1 and random), or a spread of float32 values over the
    whole range."""
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.bfloat16:
        gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        gate = gate[torch.isfinite(gate)]
    else:
        gate = torch.cat([torch.randn(1 << 16, generator=generator) * scale for scale in (1.0, 8.0, 100.0)])
        gate = torch.cat([gate, torch.tensor([0.0, -0.0, 88.0, -88.0, 104.0, -104.0, 1e-30, -1e-30])])
    rows = -(-len(gate) // intermediate)
    gate = torch.cat([gate, torch.zeros(rows * intermediate - len(gate), dtype=dtype)]).view(rows, intermediate)
    for up in (torch.ones_like(gate), torch.randn(gate.shape, generator=generator).to(dtype)):
        gate_up = torch.cat([gate, up], dim=1)
        expected = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        out = torch.empty_like(expected)
        if kernels.silu_mul(_DTYPE_CODES[dtype], lanes, gate_up.data_ptr(), rows, intermediate, out.data_ptr()) != 0:
            return False
        if not torch.equal(out, expected):
            return False
    return True


_HAS_TRITON = importlib.util.find_spec("triton") is not None
_GPU_NORM_MAX_HIDDEN = 16384  # torch_shift.kernels.triton_norm.MAX_HIDDEN, without importing triton to read it


def gpu_rms_norm_applies(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether RMSNorm of `x` (after adding `residual`) runs as one Triton kernel: CUDA rows [tokens, hidden] of
    unit stride, weight and residual alike, no autograd."""
    return (x.is_cuda and _HAS_TRITON and x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] <= _GPU_NORM_MAX_HIDDEN
            and weight.dtype == x.dtype and weight.is_contiguous() and weight.shape == x.shape[-1:]
            and weight.device == x.device
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.stride(-1) == 1 and residual.device == x.device
                                      and not (torch.is_grad_enabled() and residual.requires_grad))))


@custom_op("torch_shift::gpu_rms_norm")
def gpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from torch_shift.kernels import triton_norm

    return triton_norm.rms_norm(x, weight, eps)[0]


@gpu_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


@custom_op("torch_shift::gpu_add_rms_norm")
def gpu_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of x + residual, x + residual) in one kernel."""
    from torch_shift.kernels import triton_norm

    return triton_norm.rms_norm(x, weight, eps, residual)


@gpu_add_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


# On a GPU, rotary embeddings of a step's q and k run as one Triton kernel (torch_shift::gpu_rotary); False: the
# PyTorch expression (two kernels where inductor compiles it)
GPU_TRITON_ROTARY = True


def gpu_rotary_applies(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> bool:
    """Whether the rotary embeddings of q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] run as one
    Triton kernel: CUDA tensors of one dtype, unit stride in the head dimension, the float32 table on the same device,
    integer positions, no autograd. The token counts are not compared: under torch.compile that would add a guard
    on the step's (dynamic, unbacked) token count."""
    return (GPU_TRITON_ROTARY and q.is_cuda and _HAS_TRITON and q.dim() == 3 and k.dim() == 3
            and k.dtype == q.dtype and q.dtype.is_floating_point and q.stride(-1) == 1 and k.stride(-1) == 1
            and q.shape[-1] % 2 == 0 and k.shape[-1] == q.shape[-1]
            and cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and cos_sin.shape[-1] == q.shape[-1]
            and k.device == q.device and cos_sin.device == q.device and positions.device == q.device
            and positions.dim() == 1 and positions.dtype in (torch.int32, torch.int64)
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)))


@custom_op("torch_shift::gpu_rotary")
def gpu_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated, contiguous, in one kernel (kernels/triton_rotary.py)."""
    from torch_shift.kernels import triton_rotary

    return triton_rotary.rotary(positions, q, k, cos_sin)


@gpu_rotary.register_fake
def _(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
      cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _rms_norm(kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor, eps: float, lanes: int) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype)
    inner, inner_stride = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    status = kernels.rms_norm(_DTYPE_CODES[x.dtype], x.data_ptr(), x.shape[0], inner, x.stride(0), inner_stride,
                              x.shape[-1], weight.data_ptr(), eps, lanes, out.data_ptr())
    assert status == 0, (status, x.dtype)
    return out


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`x * cos + rotate_half(x) * sin` for q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim], cos and
    sin the rows of `cos_sin` ([2, positions, head_dim], float32) at each token's position, rounded to x's dtype."""
    if _compiling_on_cpu(positions, q, k, cos_sin):
        return cpu_rotary(positions, q, k, cos_sin)
    kernels = _kernels(q)
    if (kernels is None or k.dtype != q.dtype or q.dim() != 3 or k.dim() != 3 or q.stride(-1) != 1
            or k.stride(-1) != 1 or q.shape[-1] % 2 or k.shape[-1] != q.shape[-1] or cos_sin.dtype != torch.float32
            or not cos_sin.is_contiguous() or cos_sin.shape[-1] != q.shape[-1] or cos_sin.device != q.device
            or positions.shape != q.shape[:1] or positions.device != q.device
            or (k.requires_grad and torch.is_grad_enabled())):
        return None
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    rotated = []
    for x in (q, k):
        out = torch.empty(x.shape, dtype=x.dtype)
        status = kernels.rotary(_DTYPE_CODES[x.dtype], x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), x.stride(1),
                                x.shape[2], positions.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[1],
                                out.data_ptr())
        if status == -3:
            raise IndexError(f"a position is outside the rotary table of {cos_sin.shape[1]} positions")
        assert status == 0, (status, x.dtype)
        rotated.append(out)
    return rotated[0], rotated[1]


def rotary_expression(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin = cos_sin[:, positions].to(q.dtype).unsqueeze(2)  # [2, T, 1, head_dim]
    cos, sin = cos_sin[0], cos_sin[1]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@custom_op("torch_shift::cpu_rotary")
def cpu_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager forward's rotary embeddings on the CPU, kept whole by torch.compile (the module's docstring)."""
    out = rotary(positions, q, k, cos_sin)
    return rotary_expression(positions, q, k, cos_sin) if out is None else out


custom_op("torch_shift::cpu_rotary_python")(cpu_rotary.__wrapped__)


@cpu_rotary.register_fake
def _(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
      cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _argmax_kernels(x: torch.Tensor) -> CpuKernels | None:
    """The kernels where the CPU argmax kernel takes `x` (2-D, non-empty rows, contiguous along them), else None."""
    kernels = _kernels(x)
    if kernels is None or x.dim() != 2 or x.shape[1] == 0 or x.stride(-1) != 1:
        return None
    return kernels


def _argmax_into(kernels: CpuKernels, x: torch.Tensor, out_address: int) -> None:
    status = kernels.argmax(_DTYPE_CODES[x.dtype], x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out_address)
    assert status == 0, (status, x.dtype)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for x [rows, cols] (the first of equal maxima; the first NaN where a row has one): one
    vectorised pass per row through the CPU kernel where it applies (PyTorch's CPU argmax reads a row one element
    at a time: 0.46 ms for 128k bfloat16 logits), else torch's."""
    kernels = _argmax_kernels(x)
    if kernels is None:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _argmax_into(kernels, x, out.data_ptr())
    return out


def sample_rows(x: torch.Tensor, draws: np.ndarray) -> torch.Tensor | None:
    """A token drawn from each row of x [rows, cols] by the CPU kernel (cpu_elementwise.cpp's `sample_row`) with
    `draws`, float32 [5, rows]: each row's temperature (0: its argmax), top_k (0: all), top_p, min_p and uniform in
    [0, 1); None where the kernel does not take x. The C++ decoder's launched steps draw with the same kernel."""
    kernels = _argmax_kernels(x)
    if kernels is None:
        return None
    assert draws.dtype == np.float32 and draws.shape == (5, x.shape[0]) and draws.flags.c_contiguous
    out = torch.empty(x.shape[0], dtype=torch.int64)
    status = kernels.sample_rows(_DTYPE_CODES[x.dtype], x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                                 draws.ctypes.data, out.data_ptr())
    assert status == 0, (status, x.dtype)
    return out


# a logits tensor's attribute: each row's argmax (int64 numpy array), found by the code that made the logits (the C++
# decoder, while they were in cache); a tensor made from it (a slice, a copy) has none, but for logits_rows' slices
ROW_ARGMAX = "_torch_shift_row_argmax"


def logits_rows(logits: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """`logits[start:stop]`, with those rows' ROW_ARGMAX where `logits` has it."""
    rows = logits[start:stop]
    known = getattr(logits, ROW_ARGMAX, None)
    if known is not None:
        setattr(rows, ROW_ARGMAX, known[start:stop])
    return rows


def argmax_lists(parts: list[torch.Tensor], width: int) -> list[int]:
    """`argmax_list` over the rows of `parts` in order, each row's argmax among its first `width` columns: the parts'
    ROW_ARGMAX where every part has it and is that wide (no logits read), else over their concatenation."""
    known = [getattr(part, ROW_ARGMAX, None) for part in parts]
    if parts[0].shape[1] == width and all(k is not None for k in known):
        return (known[0] if len(known) == 1 else np.concatenate(known)).tolist()
    rows = parts[0] if len(parts) == 1 else torch.cat(parts)
    return argmax_list(rows if rows.shape[1] == width else rows[:, :width])


def argmax_list(x: torch.Tensor) -> list[int]:
    """`argmax(x).tolist()`, with the CPU kernel writing into a numpy array: what the host's sampling needs, in fewer
    calls (each costs 5-15 us after a step's weights went through the caches); the rows' ROW_ARGMAX where x has it."""
    known = getattr(x, ROW_ARGMAX, None)
    if known is not None:
        return known.tolist()
    kernels = _argmax_kernels(x)
    if kernels is None:
        return x.argmax(dim=-1).tolist()
    out = np.empty(x.shape[0], dtype=np.int64)
    _argmax_into(kernels, x, out.__array_interface__["data"][0])
    return out.tolist()
