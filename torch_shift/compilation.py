"""torch.compile for the model forward, with attention as one opaque custom op.

The step's attention (paged, and in the base layout wrapped in the Ulysses all-to-alls) depends
on per-step metadata: block tables, chunk boundaries, token counts. Passed into a compiled
function, every step would guard-fail and recompile. Instead the compiled graph calls the custom
op `torch_shift::attention(q, k, v, layer_idx, sinks, sliding_window)`, which runs the attention
object installed for the current step: the graph sees only tensors with a dynamic token dimension,
so changing batch sizes reuse one graph, one-token steps included.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch

from torch_shift.custom_ops import custom_op
from torch_shift.models.decoder import AttentionFn

_current: list[AttentionFn] = []


@custom_op("torch_shift::attention")
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, sinks: torch.Tensor | None,
                  sliding_window: int | None) -> torch.Tensor:
    extras = () if sinks is None and sliding_window is None else (sinks, sliding_window)
    return _current[-1](layer_idx, q, k, v, *extras)  # models without either: any 4-argument attention


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, sinks: torch.Tensor | None,
      sliding_window: int | None) -> torch.Tensor:
    return torch.empty_like(q)  # every attention path returns q's shape (heads and tokens as given)


def attention_op(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """The `attention` argument a compiled forward receives."""
    return _attention_op(q, k, v, layer_idx, sinks, sliding_window)


@contextmanager
def step_attention(attention: AttentionFn):
    _current.append(attention)
    try:
        yield
    finally:
        _current.pop()


def compile_forward(model: torch.nn.Module) -> Callable:
    """`forward(input_ids, positions, attention)` compiled with a dynamic token dimension; call it
    under `step_attention(...)` with `attention_op` as the attention argument."""
    compiled = torch.compile(model, dynamic=True)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        # an unbacked token count: a one-token step reuses the graph instead of specialising on size 1
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        with step_attention(attention):
            return compiled(input_ids, positions, attention_op)

    return forward
