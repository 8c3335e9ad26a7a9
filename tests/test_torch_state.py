"""engine/torch_state.py: an engine's steps under the torch settings of its construction."""

from __future__ import annotations

import torch

from torch_shift.engine.torch_state import TorchState


def test_a_block_runs_under_the_built_state_and_the_callers_comes_back():
    built = TorchState.current()
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_float32_matmul_precision("medium")
    try:
        caller = TorchState.current()
        assert caller != built
        with torch.autocast("cpu", dtype=torch.bfloat16), built.applied():
            assert TorchState.current() == built and not torch.is_autocast_enabled("cpu")
            assert torch.zeros(1).dtype == torch.float32
            with built.applied():  # nested: nothing to change
                assert TorchState.current() == built
        assert TorchState.current() == caller and not torch.is_autocast_enabled("cpu")
    finally:
        torch.set_default_dtype(torch.float32)
        torch.use_deterministic_algorithms(False)
        torch.set_float32_matmul_precision("highest")
    assert TorchState.current() == built


def test_the_callers_state_comes_back_after_an_error():
    built = TorchState.current()
    torch.set_default_dtype(torch.float64)
    try:
        try:
            with built.applied():
                raise KeyError("inside")
        except KeyError:
            pass
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)
