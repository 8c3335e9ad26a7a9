"""torch_shift.custom_ops: operators defined through torch.library.Library, called eagerly and from a compiled graph."""

from __future__ import annotations

import pytest
import torch

from torch_shift.custom_ops import custom_op


@custom_op("torch_shift::test_scaled_rows")
def scaled_rows(x: torch.Tensor, factor: float, rows: int) -> torch.Tensor:
    return x[:rows] * factor


@scaled_rows.register_fake
def _(x: torch.Tensor, factor: float, rows: int) -> torch.Tensor:
    return x.new_empty(rows, *x.shape[1:])


def test_operator_runs_eagerly_and_inside_a_compiled_graph():
    x = torch.randn(5, 3)
    assert torch.equal(scaled_rows(x, 2.0, 4), x[:4] * 2.0)
    assert torch.equal(torch.ops.torch_shift.test_scaled_rows(x, 2.0, 4), x[:4] * 2.0)
    compiled = torch.compile(lambda t: scaled_rows(t + 1, 3.0, 2).sum(0), fullgraph=True, dynamic=True)
    for n in (3, 7):
        t = torch.randn(n, 4)
        torch.testing.assert_close(compiled(t), ((t[:2] + 1) * 3.0).sum(0))


def test_only_the_torch_shift_namespace():
    with pytest.raises(ValueError, match="torch_shift namespace"):
        custom_op("other::op")
