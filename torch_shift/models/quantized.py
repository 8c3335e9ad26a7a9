"""Linear layers' weights stored quantized, read as the weights they stand for: GPTQ (AutoGPTQ's and GPTQModel's
"gptq" and "gptq_v2" formats), AWQ (AutoAWQ's GEMM layout), FP8 with block scales (transformers' FineGrainedFP8, as
Qwen3's -FP8 checkpoints) and compressed-tensors (llm-compressor's checkpoints: integer weights packed or not,
float8 weights). Each weight is dequantized as its format's reference code computes it: FP8 in float32 as
transformers does, the integer formats in the dtype of their scales (GPTQModel, AutoAWQ, compressed-tensors), so
the engine's parameters hold what those libraries' dequantized layers hold."""

from __future__ import annotations

import math

import torch

from torch_shift.config import WeightQuantization

# The tensors beside a quantized linear layer's name stem: the one that marks it, the others it needs and the
# others it may have. For FP8 and compressed-tensors' unpacked formats the mark is `.weight`, which unquantized
# layers (and norms, embeddings) have too: those hold no scale beside it.
_PACKED_INT = (".qweight", (".qzeros", ".scales"), (".g_idx",))
TENSORS = {
    "gptq": _PACKED_INT,
    "awq": (".qweight", (".qzeros", ".scales"), ()),
    "fp8": (".weight", (".weight_scale_inv",), ()),
    "pack-quantized": (".weight_packed", (".weight_scale", ".weight_shape"), (".weight_zero_point", ".weight_g_idx")),
    "compressed": (".weight", (".weight_scale",), (".weight_zero_point", ".weight_g_idx")),
}
# AutoAWQ packs output columns 0, 2, 4, 6, 1, 3, 5, 7 of each eight into a word's nibbles, lowest first; a word's
# nibbles in this order are the columns in theirs.
_AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)


def tensor_names(quant: WeightQuantization) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(the suffix that marks a quantized weight, the suffixes it needs, the ones it may have) for `quant`."""
    return TENSORS[_kind(quant)]


class QuantizedWeight:
    """A linear layer's weight [out, in] from its quantized tensors (safetensors slices or tensors, by suffix:
    TENSORS), read as a safetensors slice is: `get_shape()`, `[rows]`, `[rows, columns]`. A read dequantizes only
    the rows asked for (and the packed words around them), every column of them, then cuts the columns."""

    def __init__(self, name: str, tensors: dict[str, object], quant: WeightQuantization):
        self.name, self.tensors, self.quant = name, tensors, quant
        try:
            self.shape = _SHAPES[_kind(quant)](self)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def get_shape(self) -> tuple[int, int]:
        return self.shape

    def __getitem__(self, key) -> torch.Tensor:
        rows, columns = key if isinstance(key, tuple) else (key, slice(None))
        if not all(isinstance(k, slice) and k.step in (None, 1) for k in (rows, columns)):
            raise TypeError(f"{self.name}: quantized weights are read in windows of rows and columns, not {key!r}")
        first, end, _ = rows.indices(self.shape[0])
        try:
            values = _DEQUANTIZE[_kind(self.quant)](self, first, max(first, end))
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        return values[:, columns]

    def read(self, suffix: str, *key) -> torch.Tensor:
        tensor = self.tensors[suffix]
        return tensor[key] if key else tensor[:]

    def tensor_shape(self, suffix: str) -> tuple[int, ...]:
        tensor = self.tensors[suffix]
        return tuple(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)


def _kind(quant: WeightQuantization) -> str:
    """The key of `quant`'s layout in TENSORS, _SHAPES and _DEQUANTIZE."""
    if quant.method != "compressed-tensors":
        return quant.method
    return "pack-quantized" if quant.format == "pack-quantized" else "compressed"


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits codes each along `dim` (0 or 1), the lowest bits first, in [0, 2 ** bits)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = words.unsqueeze(dim + 1) >> shifts.view((1, -1, 1) if dim == 0 else (1, 1, -1))
    return (codes & ((1 << bits) - 1)).flatten(dim, dim + 1)


def _expect(shape: tuple[int, ...], implied: tuple[int, ...], what: str) -> None:
    if tuple(shape) != tuple(implied):
        raise ValueError(f"{what} has shape {tuple(shape)}, the weight implies {tuple(implied)}")


def _groups(columns: int, group_size: int) -> int:
    return math.ceil(columns / group_size) if group_size else 1


def _group_of_column(weight: QuantizedWeight, columns: int, g_idx: str | None, groups: int) -> torch.Tensor:
    """Each input column's group of `groups`: the checkpoint's g_idx (act-order), else consecutive runs."""
    if g_idx in weight.tensors:
        group = weight.read(g_idx).long()
        if bool((group < 0).any()) or bool((group >= groups).any()):
            raise ValueError(f"{g_idx} names groups outside the {groups} of its scales")
        return group
    group_size = weight.quant.group_size or columns
    return torch.arange(columns) // group_size


# GPTQ: qweight [in * bits / 32, out] packs input rows; qzeros [groups, out * bits / 32] packs output columns;
# scales [groups, out]; g_idx [in]. The weight [out, in] is (scales[g] * (code - zero[g])).t().

def _gptq_shape(weight: QuantizedWeight) -> tuple[int, int]:
    bits, group_size = weight.quant.bits, weight.quant.group_size
    packed_rows, out = weight.tensor_shape(".qweight")
    columns = packed_rows * 32 // bits
    groups = _groups(columns, group_size)
    _expect(weight.tensor_shape(".scales"), (groups, out), ".scales")
    _expect(weight.tensor_shape(".qzeros"), (groups, math.ceil(out * bits / 32)), ".qzeros")
    if ".g_idx" in weight.tensors:
        _expect(weight.tensor_shape(".g_idx"), (columns,), ".g_idx")
    return out, columns


def _gptq(weight: QuantizedWeight, first: int, end: int) -> torch.Tensor:
    bits, in_features = weight.quant.bits, weight.shape[1]
    per_word = 32 // bits
    codes = unpack(weight.read(".qweight", slice(None), slice(first, end)), bits, 0)
    word = first // per_word
    zeros = unpack(weight.read(".qzeros", slice(None), slice(word, math.ceil(end / per_word))), bits, 1)
    zeros = zeros[:, first - word * per_word:end - word * per_word] + weight.quant.zero_offset
    scales = weight.read(".scales", slice(None), slice(first, end))
    group = _group_of_column(weight, in_features, ".g_idx", scales.shape[0])
    return (scales[group] * (codes - zeros[group])).t()


# AWQ (GEMM): qweight [in, out / 8] packs output columns in AutoAWQ's order; qzeros [groups, out / 8] likewise;
# scales [groups, out]. The weight [out, in] is ((code - zero[g]) * scales[g]).t().

def _awq_shape(weight: QuantizedWeight) -> tuple[int, int]:
    columns, packed = weight.tensor_shape(".qweight")
    out = packed * 8
    groups = _groups(columns, weight.quant.group_size)
    _expect(weight.tensor_shape(".scales"), (groups, out), ".scales")
    _expect(weight.tensor_shape(".qzeros"), (groups, packed), ".qzeros")
    return out, columns


def _awq_codes(words: torch.Tensor, first: int, end: int, word: int) -> torch.Tensor:
    codes = unpack(words, 4, 1)
    codes = codes.view(codes.shape[0], -1, 8)[..., list(_AWQ_COLUMNS)].flatten(1)
    return codes[:, first - word * 8:end - word * 8]


def _awq(weight: QuantizedWeight, first: int, end: int) -> torch.Tensor:
    word, last_word = first // 8, math.ceil(end / 8)
    codes = _awq_codes(weight.read(".qweight", slice(None), slice(word, last_word)), first, end, word)
    zeros = _awq_codes(weight.read(".qzeros", slice(None), slice(word, last_word)), first, end, word)
    scales = weight.read(".scales", slice(None), slice(first, end))
    group = _group_of_column(weight, weight.shape[1], None, scales.shape[0])
    return ((codes - zeros[group]) * scales[group]).t()


def _block_scales(scales: torch.Tensor, block: tuple[int, int], first: int, end: int, columns: int) -> torch.Tensor:
    """Scales of blocks [block_rows, block_columns] (the last ones cut at the weight's edge), read for the block
    rows that hold rows [first, end) -> one per element of those rows [end - first, columns]."""
    rows, cols = block
    expanded = scales.repeat_interleave(rows, 0)[first - first // rows * rows:][:end - first]
    return expanded.repeat_interleave(cols, 1)[:, :columns]


def _block_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


# FP8 (transformers' FineGrainedFP8): weight float8_e4m3fn [out, in], weight_scale_inv float [out / 128, in / 128]
# (E8M0 bytes where scale_fmt is ue8m0), the product in float32.

def _fp8_shape(weight: QuantizedWeight) -> tuple[int, int]:
    shape = weight.tensor_shape(".weight")
    if len(shape) != 2:
        raise ValueError(f".weight has shape {shape}, not a linear layer's [out, in]")
    block = weight.quant.block or shape
    _expect(_squeezed(weight.tensor_shape(".weight_scale_inv")), _block_grid(shape, block), ".weight_scale_inv")
    return shape


def _squeezed(shape: tuple[int, ...]) -> tuple[int, int]:
    """A scale's shape as a [rows, columns] grid: one per tensor may be stored as [] or [1]."""
    return (1, 1) if len(shape) < 2 and math.prod(shape) == 1 else shape


def _fp8(weight: QuantizedWeight, first: int, end: int) -> torch.Tensor:
    block = weight.quant.block or weight.shape
    values = weight.read(".weight", slice(first, end)).float()
    scales = weight.read(".weight_scale_inv").reshape(_block_grid(weight.shape, block))[first // block[0]:
                                                                                          math.ceil(end / block[0])]
    scales = (scales.float() - 127).exp2() if scales.dtype == torch.uint8 else scales.float()
    return values * _block_scales(scales, block, first, end, weight.shape[1])


# compressed-tensors: integers stored as int8 (int-quantized, naive-quantized), or packed 32 / bits to an int32
# along each row with 2 ** (bits - 1) added (pack-quantized: weight_packed, weight_shape; an asymmetric scheme's
# zero points packed along dim 0); float8 weights (float-quantized). A scale [1] (tensor), [out, 1] (channel),
# [out, in / group_size] (group) or per block; the weight is (value - zero) * scale in the scale's dtype.

def _compressed_shape(weight: QuantizedWeight) -> tuple[int, int]:
    if ".weight_shape" in weight.tensors:
        shape = tuple(int(d) for d in weight.read(".weight_shape").tolist())
        _expect(weight.tensor_shape(".weight_packed"), (shape[0], math.ceil(shape[1] * weight.quant.bits / 32)),
                ".weight_packed")
    else:
        shape = weight.tensor_shape(".weight")
    if len(shape) != 2:
        raise ValueError(f"the weight's shape {shape} is not a linear layer's [out, in]")
    grid = _compressed_grid(weight.quant, shape)
    _expect(_squeezed(weight.tensor_shape(".weight_scale")), grid, ".weight_scale")
    if ".weight_zero_point" in weight.tensors:
        implied = (math.ceil(grid[0] * weight.quant.bits / 32), grid[1]) if _packed_zero_points(weight.quant) else grid
        _expect(_squeezed(weight.tensor_shape(".weight_zero_point")), implied, ".weight_zero_point")
    if ".weight_g_idx" in weight.tensors:
        _expect(weight.tensor_shape(".weight_g_idx"), (shape[1],), ".weight_g_idx")
    return shape


def _packed_zero_points(quant: WeightQuantization) -> bool:
    """pack-quantized packs a group or channel scheme's zero points along dim 0 (a tensor's one is stored as it is)."""
    return quant.format == "pack-quantized" and quant.strategy in ("group", "channel")


def _compressed_grid(quant: WeightQuantization, shape: tuple[int, int]) -> tuple[int, int]:
    if quant.strategy == "tensor":
        return 1, 1
    if quant.strategy == "channel":
        return shape[0], 1
    if quant.strategy == "group":
        return shape[0], _groups(shape[1], quant.group_size)
    return _block_grid(shape, quant.block)


def _compressed_rows(weight: QuantizedWeight, suffix: str, first: int, end: int) -> torch.Tensor:
    """Rows [first, end) of a scale or zero point, one per element of those rows [end - first, in] (a tensor's
    one scale as [1, 1])."""
    quant, columns = weight.quant, weight.shape[1]
    grid = _compressed_grid(quant, weight.shape)
    if suffix == ".weight_zero_point" and _packed_zero_points(quant):
        per_word = 32 // quant.bits
        word = first // per_word
        words = weight.read(suffix).reshape(-1, grid[1])[word:math.ceil(end / per_word)]
        values = unpack(words, quant.bits, 0)[first - word * per_word:end - word * per_word] - (1 << quant.bits - 1)
    elif quant.strategy in ("tensor", "block"):
        values = weight.read(suffix).reshape(grid)
    else:
        values = weight.read(suffix).reshape(grid)[first:end]
    if quant.strategy == "group":
        return values[:, _group_of_column(weight, columns, ".weight_g_idx", grid[1])]
    if quant.strategy == "block":
        return _block_scales(values[first // quant.block[0]:math.ceil(end / quant.block[0])], quant.block,
                             first, end, columns)
    return values


def _compressed(weight: QuantizedWeight, first: int, end: int) -> torch.Tensor:
    quant = weight.quant
    if quant.format == "pack-quantized":
        codes = unpack(weight.read(".weight_packed", slice(first, end)), quant.bits, 1)
        values = codes[:, :weight.shape[1]] - (1 << quant.bits - 1)
    else:
        values = weight.read(".weight", slice(first, end))
    scales = _compressed_rows(weight, ".weight_scale", first, end)
    values = values.to(scales.dtype)
    if ".weight_zero_point" in weight.tensors:
        values = values - _compressed_rows(weight, ".weight_zero_point", first, end).to(scales.dtype)
    return values * scales


_SHAPES = {"gptq": _gptq_shape, "awq": _awq_shape, "fp8": _fp8_shape, "pack-quantized": _compressed_shape,
           "compressed": _compressed_shape}
_DEQUANTIZE = {"gptq": _gptq, "awq": _awq, "fp8": _fp8, "pack-quantized": _compressed, "compressed": _compressed}
