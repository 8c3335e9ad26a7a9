"""Linear layers whose weights are prepared once for the machine's fastest matmul.

On the CPU that is oneDNN with the weight reordered into its blocked layout once (`PackedWeight`): MKL,
where `F.linear` sends float32, reaches 2/3 of oneDNN's rate on large batches and 1/3 to 1/2 on the few
rows of a decode step (docs/performance.md); vLLM's CPU build packs its weights the same way. Every
module that multiplies by a weight (`Linear` in the model files, the parallel layers of
torch_shift.parallel.layers) calls `linear(x, weight, bias, packed)`: with `packed` set it runs the
packed weight, else `F.linear`. `prepare_linears(model)` packs a built model's weights (every layout
of it) and drops the dense copies it no longer needs.

Under torch.compile the packed matmul is the custom op `torch_shift::packed_linear`, which names its
weight by a handle: an opaque oneDNN tensor never enters the graph.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

_packed_by_handle: weakref.WeakValueDictionary[int, PackedWeight] = weakref.WeakValueDictionary()
_handles = itertools.count()


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed matmul: CPUs with oneDNN, float32, or bfloat16 where the CPU has bf16 instructions
    (elsewhere oneDNN would emulate them, slower than F.linear)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


class PackedWeight:
    """A [out_features, in_features] weight in oneDNN's blocked layout, with its own matmul."""

    def __init__(self, weight: torch.Tensor):
        assert weight.dim() == 2 and weight.device.type == "cpu", (weight.shape, weight.device)
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.nbytes = weight.numel() * weight.element_size()
        self.handle = next(_handles)
        _packed_by_handle[self.handle] = self

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, bias)
        return _run(x, self.tensor, bias, self.out_features)


def _run(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    if x.shape[0] == 0:  # oneDNN refuses an empty matmul
        return x.new_empty(0, out_features)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("torch_shift::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int, bias: torch.Tensor | None) -> torch.Tensor:
    weight = _packed_by_handle[handle]
    return _run(x.contiguous(), weight.tensor, bias, weight.out_features)


@packed_linear.register_fake
def _(x: torch.Tensor, handle: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _packed_by_handle[handle].out_features)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """x @ weight.T + bias, through `packed` when the weight was prepared."""
    if packed is not None:
        return packed(x, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear, whose weight `prepare_linears` may pack."""

    packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def prepare_linears(model: nn.Module, drop_dense: bool = True) -> int:
    """Pack the weight of every module of `model` that has a `packed` slot (Linear and the parallel layers),
    where the device and dtype allow it; with `drop_dense`, the module's dense weight is then replaced by
    an empty tensor (its memory is freed unless another module still holds it: a tied embedding, a view).
    Returns the bytes packed."""
    total = 0
    for module in model.modules():
        if not hasattr(module, "packed") or module.packed is not None:
            continue
        weight = module.dense_weight() if hasattr(module, "dense_weight") else module.weight
        if weight is None or not packing_supported(weight.device, weight.dtype):
            continue
        module.packed = PackedWeight(weight)
        total += module.packed.nbytes
        if drop_dense:
            module.drop_dense() if hasattr(module, "drop_dense") else _drop(module, "weight")
    return total


def _drop(module: nn.Module, name: str) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(old.new_empty(0), requires_grad=False))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s weights: the storages of its parameters (views of one storage count it once) and
    its packed weights (each as the dense tensor it was packed from)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    packed = {m.packed.handle: m.packed.nbytes for m in model.modules() if getattr(m, "packed", None) is not None}
    return sum(storages.values()) + sum(packed.values())
