"""Attention backends behind one interface (torch_shift.attention.backend)."""

from __future__ import annotations

import torch

from torch_shift.attention.backend import AttentionBackend, AttentionBatch

BACKEND_NAMES = ("auto", "cpu", "sdpa", "flex", "triton")
# vLLM's names of the same kernels
_ALIASES = {"cpu_attn": "cpu", "torch_sdpa": "sdpa", "flex_attention": "flex", "triton_attn": "triton"}


def canonical_backend_name(name: str) -> str:
    """`name` as one of BACKEND_NAMES (vLLM's names accepted, in any case); ValueError otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"attention_backend must be a string, got {type(name).__name__}")
    canonical = _ALIASES.get(name.lower(), name.lower())
    if canonical not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(map(repr, BACKEND_NAMES))} (or vLLM's "
                         f"{', '.join(n.upper() for n in _ALIASES)}), got {name!r}")
    return canonical


def attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend called `name` for a KV cache of `dtype` on `device`. "auto": on a GPU the paged Triton
    kernel where Triton is installed; on the CPU the paged CPU kernel where it can be built; else SDPA over
    gathered blocks."""
    from torch_shift.attention.cpu import CpuBackend
    from torch_shift.attention.sdpa import SdpaBackend

    name = canonical_backend_name(name)
    if name == "auto" and device.type == "cuda" and _has_triton():
        name = "triton"
    if name == "auto":
        if CpuBackend.supports(device, dtype):
            from torch_shift.kernels import cpu_kernels

            kernels = cpu_kernels()
            if kernels is not None:
                return CpuBackend(kernels)
        return SdpaBackend()
    if name == "cpu":
        if not CpuBackend.supports(device, dtype):
            raise ValueError(f"attention_backend 'cpu' runs on the CPU in float32, bfloat16 or float16; this engine "
                             f"runs {dtype} on {device}")
        return CpuBackend()
    if name == "triton":
        if not _has_triton():
            raise ValueError("attention_backend 'triton' needs the triton package (pip install triton)")
        from torch_shift.attention.triton_paged import TritonBackend

        return TritonBackend()
    if name == "flex":
        from torch_shift.attention.flex import FlexBackend

        return FlexBackend()
    return SdpaBackend()


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


__all__ = ["AttentionBackend", "AttentionBatch", "BACKEND_NAMES", "attention_backend", "canonical_backend_name"]
