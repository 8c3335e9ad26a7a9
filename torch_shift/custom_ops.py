"""The project's custom operators (the calls a compiled graph keeps opaque: packed linears, attention, the
experts, shared-memory collectives), registered through `torch.library.Library`.

`torch.library.custom_op` wraps each call in Python checks (autograd, aliasing, dispatch keys) that cost
7-17 us a call on this machine against ~0.5 us for an operator defined and implemented directly (measured:
a one-row packed linear 7.7 us called directly, 15-25 us through `custom_op`, 7.3 us through the
`Library` operator); a decode step calls one per linear layer and attention call (41 in an 8-layer model).
The operators are inference-only: no autograd formula, and an implementation must return a new tensor
(never one of its inputs or a view of one), as `custom_op` would have checked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARY = torch.library.Library("torch_shift", "FRAGMENT")  # noqa: TOR901 (kept alive for the registrations)


class CustomOp:
    """`torch.ops.torch_shift.<name>.default`, callable, with `register_fake` as `custom_op`'s result has."""

    def __init__(self, name: str, fn: Callable):
        schema = torch.library.infer_schema(fn, mutates_args=())
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        self.qualname = f"torch_shift::{name}"
        self.op = getattr(torch.ops.torch_shift, name).default
        self.__wrapped__ = fn

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def register_fake(self, fn: Callable) -> Callable:
        """The output's shape and dtype from the inputs' (what torch.compile traces with)."""
        return torch.library.register_fake(self.qualname, fn, lib=_LIBRARY)


def custom_op(qualname: str) -> Callable[[Callable], CustomOp]:
    """`@custom_op("torch_shift::name")`: the decorated function (type-annotated, as for `torch.library.custom_op`)
    as an operator of the torch_shift namespace."""
    namespace, _, name = qualname.partition("::")
    if namespace != "torch_shift" or not name:
        raise ValueError(f"custom_op names an operator of the torch_shift namespace, got {qualname!r}")
    return lambda fn: CustomOp(name, fn)
