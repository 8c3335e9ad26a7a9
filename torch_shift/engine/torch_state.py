"""The torch settings an engine's steps run under: those it was built under, whatever its caller set since.

Rank 0 is the user's process, and torch's global settings are the user's to change between the engine's calls
(`torch.set_default_dtype`, `torch.use_deterministic_algorithms`, `torch.set_float32_matmul_precision`, an
autocast block around `generate`). dynamo guards on each of them: a compiled engine's next prompt after such a
change raised "Recompilation triggered" (measured), and an eager step would have rounded otherwise than the one
before. The default dtype, deterministic algorithms and matmul precision are the process's: while a server's
engine thread steps under settings its user changed since, the user's other threads see them too. The intra-op
thread count, which dynamo guards too, is the model runner's (engine/model_runner.py).
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from dataclasses import dataclass

import torch

_AUTOCAST_DEVICES = ("cpu", "cuda")
_NOTHING_TO_CHANGE = nullcontext()


def _settings() -> tuple:
    return (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(), torch.get_float32_matmul_precision())


def _apply(settings: tuple) -> None:
    default_dtype, deterministic, warn_only, matmul_precision = settings
    torch.set_default_dtype(default_dtype)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.set_float32_matmul_precision(matmul_precision)


@dataclass(frozen=True)
class TorchState:
    """The default dtype, deterministic algorithms (and their warn-only flag) and float32 matmul precision."""

    settings: tuple

    @classmethod
    def current(cls) -> TorchState:
        return cls(_settings())

    def applied(self) -> ExitStack | nullcontext:
        """A block under this state, without autocast; the caller's state comes back after it (a context manager
        to enter; about 1 us where they are the same, once a step)."""
        autocast = [device for device in _AUTOCAST_DEVICES if torch.is_autocast_enabled(device)]
        caller = _settings()
        if caller == self.settings and not autocast:
            return _NOTHING_TO_CHANGE
        stack = ExitStack()
        for device in autocast:
            stack.enter_context(torch.autocast(device, enabled=False))
        if caller != self.settings:
            _apply(self.settings)
            stack.callback(_apply, caller)
        return stack
