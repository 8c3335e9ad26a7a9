"""Linear layers whose weights are prepared once for the machine's fastest matmul.

On the CPU that is oneDNN with the weight reordered into its blocked layout once (`PackedWeight`): MKL,
where `F.linear` sends float32, reaches 2/3 of oneDNN's rate on large batches and 1/3 to 1/2 on the few
rows of a decode step (docs/performance.md); vLLM's CPU build packs its weights the same way. Every
module that multiplies by a weight (`Linear` in the model files, the parallel layers of
torch_shift.parallel.layers) calls `linear(x, weight, bias, packed)`: with `packed` set it runs the
packed weight, else `F.linear`. `prepare_linears(model)` packs a built model's weights (every layout
of it) and drops the dense copies it no longer needs. On a GPU nothing is packed: a matmul goes through the
operator `torch_shift::gpu_linear`, which runs cuBLAS or, for a few rows, the kernel timed fastest for its shape,
a Triton tile or cuBLAS (torch_shift.kernels.triton_linear).

A matmul of at most `GEMV_MAX_ROWS` rows (a decode step of up to that many requests, or one that checks proposed
tokens) reads the same packed weight through torch_shift's own kernel (kernels/cpu_linear.cpp), which streams it at
the memory's rate: oneDNN's one-row matmul reads about two thirds of that (docs/performance.md).
The kernel knows oneDNN's AVX-512 layout; each weight is checked against it once, when it is packed. A shape oneDNN
pads otherwise than the kernel reads (a vocabulary or an MLP that is no multiple of 64, such as CodeLlama's 32,016
tokens) gets a copy in the kernel's layout beside oneDNN's, for its steps of few rows; a weight the kernel still cannot
read keeps oneDNN for every batch. In float32 it adds a row's products in the runs oneDNN's matmul adds them
in, so a row gets the same bits through either, whatever its step's row count (`PackedWeight.rounds_as_onednn` checks
it). Where oneDNN packs bfloat16 for AMX (Sapphire Rapids and later: blocks of 32 features, not 64), the kernel reads
that layout too, on the tile unit (and where that cannot run, in dot products up to `AMX_DOT_GEMV_MAX_ROWS` rows).

On a CPU with AVX2 but without the AVX-512 instructions that kernel needs for a dtype (Zen 3, many cloud VMs), the
weight goes instead into torch_shift's own 16-feature blocks (`blocked_layout`), which one AVX2 kernel of
kernels/cpu_linear.cpp reads for every row count: the GEMV for up to `BLOCKED_GEMV_ROWS` rows (on the same decode
pool) and a matmul in panels of rows for more, at or above oneDNN's float32 rate on those CPUs; bfloat16 is summed in
float32 there, where oneDNN and F.linear emulate it at a sixth of that rate (docs/performance.md). Where the CPU has
AVX-512 but not its bfloat16 instructions (Ice Lake, Cascade Lake, a VM that hides them), bfloat16 takes these blocks
too, and the kernel runs them in 512-bit registers: the GEMV at 1.3-1.8x (4-16 rows) and the matmul at 1.7-1.8x the
AVX2 loops' rate, the GEMV up to 24 rows.

The packed matmul is the custom op `torch_shift::packed_linear`, which names its weight by a handle: an opaque
oneDNN tensor never enters a compiled graph. Its CPU implementation is C++ (kernels/cpu_ops.cpp) where that builds,
for eager and compiled calls alike: `PackedWeight.run` in Python costs 120-180 us a call once the weight before it
has flushed the caches, against 4-7 us warm, and a decode step runs one after every weight (docs/performance.md).
`run` is its Python implementation, and the one used where the C++ one does not build.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from torch_shift.custom_ops import custom_op
from torch_shift.memory import advise_huge_pages, huge_page_allocations

# Rows of x up to which a matmul on oneDNN's AVX-512 layout runs the GEMV kernel instead of oneDNN's matmul: each
# weight block read from memory once, again from L2 for every further 6 rows (cpu_linear.cpp); a decode step of up to
# this many requests, or a check of proposed tokens. Eight layers of the 106M peer model's linears on a 2-core Zen 5
# EPYC, alternated in one process: 1.04-1.16x oneDNN's rate in bfloat16 and 1.04-1.36x in float32 at 16-96 rows, on
# one thread and on two (an earlier CPU measured float32 on one thread level at 48 rows and slower at 64); the C++
# decoder runs such steps whole (native_decoder.MAX_TOKENS), 1.1-1.4x faster than the compiled forward at 17-64
# (docs/performance.md). A float32 row rounds as oneDNN's where `PackedWeight.rounds_as_onednn` holds, so there the
# line moves no result.
GEMV_MAX_ROWS = 64
# bfloat16 packed for AMX (Sapphire Rapids and later) runs the GEMV on the tile unit (cpu_linear.cpp's amx_block), up to
# 32 rows of x against each weight tile as it streams by, in passes of 32 rows for more: flat from 1 to 16 rows where
# the AVX512-BF16 dot products ran out of compute at a few. Eight cold copies of a weight on 2 threads of an AMX Xeon,
# GB/s at 1 / 4 / 16 rows: 5,632 x 1,024 52 / 53 / 48-49 (dot products 52 / 47 / -, oneDNN 41 / 40 / 38); at 24 / 32 /
# 48 / 64 rows 1.46 / 1.44 / 1.00 / 1.07x oneDNN's rate (1,024 x 2,816: 1.36 / 1.35 / 1.32 / 1.52x). Decode steps of
# the 106M peer model, 6 / 8 / 12 / 16 requests: 9.5-10.1 / 10.2 / 11.3-11.7 / 12.3-13.0 ms through oneDNN (and the
# compiled forward) against 6.3-6.9 / 7.5-8.0 / 7.8-8.0 / 8.7-9.7 through the tile unit's GEMV (and the C++ decoder),
# 1-4 requests level; 24 / 32 / 48 requests 12.7-13.6 / 13.6-15.5 / 18.8-19.4 against 15.4-15.9 / 17.7-18.3 /
# 21.2-22.2 through oneDNN's matmul in the C++ decoder, 64 alike (docs/performance.md, issue 20). A row's bits are the
# same at every row count, so a check of proposed tokens rounds each as a plain decode step does.
# Where the GEMV cannot use the tile unit (built by a compiler without its intrinsics, or inputs not a multiple of the
# tiles' 32), its dot products read that layout up to this many rows, oneDNN's AMX matmul above: 1.1-1.2x faster than
# oneDNN at 2-3 rows and 1.04-1.13x at 5, slower from 6.
AMX_DOT_GEMV_MAX_ROWS = 5
# the kernel on torch_shift's 16-feature blocks runs every row count, as its GEMV up to this many rows and as a
# matmul in panels of rows above (ts_blocked_linear): in AVX2 registers; in AVX-512 ones, up to 24
# (ts_blocked_gemv_rows, which PackedWeight takes)
BLOCKED_GEMV_ROWS = 16
_GEMV_DTYPES = {torch.float32: (0, 1), torch.bfloat16: (1, 2)}  # the kernel's dtype code, its capability bit
_GEMV_BLOCK = 64
AMX_BF16_CODE = 4  # the GEMV kernel's code for bfloat16 in oneDNN's AMX layout (blocks of 32 features)
# torch_shift's own 16-feature blocks (kernels/cpu_linear.cpp's AVX2 kernel): each dtype's code in the operator's
# registry and in ts_blocked_linear, the kernel's capability bit, the block's width
_BLOCKED_CODES = {torch.float32: (3, 0), torch.bfloat16: (2, 1)}
_BLOCKED_BIT, _BLOCKED_WIDTH = 4, 16

_packed_by_handle: weakref.WeakValueDictionary[int, PackedWeight] = weakref.WeakValueDictionary()
_handles = itertools.count()


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """A CPU with oneDNN: float32, and bfloat16 where the CPU has bf16 instructions, packed for oneDNN or in
    torch_shift's 16-feature blocks (`blocked_layout`); bfloat16 elsewhere only in the blocks, where they run."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) or blocked_layout(dtype)
    return False


def blocked_layout(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` go in torch_shift's 16-feature blocks for its AVX2 kernel (kernels/cpu_linear.cpp)
    rather than oneDNN's layout: on a CPU with AVX2 but without the AVX-512 GEMV kernel's instructions for the dtype.
    There oneDNN emulates bfloat16 at a sixth of its float32 rate (20 against 126 GFLOP/s on a 2-core Zen 3;
    docs/performance.md) and F.linear runs no faster, and the blocks give float32 the GEMV kernel's decode pool."""
    if dtype not in _BLOCKED_CODES:
        return False
    kernels = _blocked_kernel(dtype)[0]
    if kernels is None or (dtype == torch.bfloat16 and native_bf16()):
        return False
    return not kernels.packed_gemv_dtypes & _GEMV_DTYPES[dtype][1]


def native_bf16() -> bool:
    """Whether the CPU has bfloat16 instructions (AVX512_BF16 or AMX), which oneDNN's bfloat16 matmuls use. Without
    them oneDNN emulates bfloat16 on AVX-512 (`torch.ops.mkldnn._is_mkldnn_bf16_supported()` is true from AVX-512
    on), at a quarter of its float32 rate on a Xeon without AMX, and a row alone comes out with other bits than in a
    matmul of more rows: the blocks run bfloat16 there."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


class PackedWeight:
    """A [out_features, in_features] weight in oneDNN's blocked layout (or, on a CPU without the AVX-512 GEMV kernel,
    in torch_shift's 16-feature blocks: `blocked_layout`), with its own matmul."""

    def __init__(self, weight: torch.Tensor, blocked: bool | None = None):
        """`blocked`: a float32 or bfloat16 weight in the 16-feature blocks (True; where the AVX2 kernel runs),
        oneDNN's layout (False), or the one this CPU runs faster (None)."""
        assert weight.dim() == 2 and weight.device.type == "cpu", (weight.shape, weight.device)
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        weight = weight.detach().contiguous()
        self.nbytes = weight.numel() * weight.element_size()  # what a step reads (the GEMV's copy held beside: as much)
        self.blocked = weight.dtype in _BLOCKED_CODES and (blocked_layout(weight.dtype) if blocked is None else blocked)
        # the GEMV's own copy of the weight, where it cannot read oneDNN's packing of this shape (`_copy_for_gemv`)
        self.gemv_tensor: torch.Tensor | None = None
        if self.blocked:  # element (n, k) at ((n / 16) * K + k) * 16 + n % 16, the last block padded with zeros
            self.gemv = _blocked_kernel(self.dtype)
            if self.gemv[0] is None:
                raise ValueError("the 16-feature blocks need torch_shift's AVX2 kernel, which does not run here")
            padded = F.pad(weight, (0, 0, 0, -self.out_features % _BLOCKED_WIDTH))
            with huge_page_allocations():
                self.tensor = padded.view(-1, _BLOCKED_WIDTH, self.in_features).transpose(1, 2).contiguous()
            self.address = self.tensor.data_ptr()
        else:
            if self.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
                raise ValueError("bfloat16 in oneDNN's layout needs AVX-512 (or AVX-NE-CONVERT), which this CPU "
                                 "lacks; the 16-feature blocks (blocked=True) run it here")
            with huge_page_allocations():
                self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            self.address = torch.ops.mkldnn.data_ptr(self.tensor)
            self.gemv = _gemv_kernel(weight, self.tensor)
            if self.gemv is None:
                self._copy_for_gemv(weight)
        # the code the kernel's call takes for this weight's dtype and layout (ts_packed_gemv's: 0 float32, 1 bfloat16,
        # 4 bfloat16 packed for AMX; ts_blocked_linear's for the blocks), also where no GEMV reads it
        self.gemv_code = self.gemv[1] if self.gemv is not None else _GEMV_DTYPES[self.dtype][0]
        # matmuls of up to this many rows run the GEMV (0: none); the blocked kernel runs every row count
        from torch_shift.kernels import gemv_on_tile_unit

        self.gemv_max_rows = (0 if self.gemv is None else self.gemv[0].blocked_gemv_rows if self.blocked
                              else GEMV_MAX_ROWS if self.gemv_code != AMX_BF16_CODE
                              or (gemv_on_tile_unit() and self.in_features % 32 == 0)
                              else AMX_DOT_GEMV_MAX_ROWS)
        # a decode step streams every weight once: the GEMV kernel reads 1.05-1.2x faster from huge pages (one thread
        # of a Zen 4 EPYC: 1.7x), here where the weight was allocated outside huge_page_allocations' reach
        gemv_bytes = self.gemv_tensor.nbytes if self.gemv_tensor is not None else self.nbytes
        advise_huge_pages(self.address, self.tensor.nbytes if self.blocked else gemv_bytes, collapse=True)
        self._weight_ptr = self.address if self.gemv is not None else None
        self.handle = next(_handles)
        _packed_by_handle[self.handle] = self
        # the operator's C++ implementation (kernels/cpu_ops.cpp) finds the weight by its handle
        self.native = _native_operator()
        if self.native:
            torch.ops.torch_shift_cpu.register_packed(
                self.tensor, self.handle, self.address, self.gemv_max_rows, self.out_features,
                self.in_features, _BLOCKED_CODES[self.dtype][0] if self.blocked else self.gemv_code)
            weakref.finalize(self, torch.ops.torch_shift_cpu.unregister_packed, self.handle).atexit = False

    def _copy_for_gemv(self, weight: torch.Tensor) -> None:
        """A weight whose oneDNN packing the GEMV cannot read (a vocabulary or MLP that is no multiple of 64, which
        oneDNN pads) gets a copy in the GEMV's layout beside it, so that its small steps stream it as every other
        weight's (and the C++ decoder, which needs every weight of a model on the GEMV, runs the model): oneDNN's
        packing serves the matmuls of more rows. A float32 copy only where a row's outputs come out as oneDNN's
        (`rounds_as_onednn`), so that its logits still do not depend on its step's row count."""
        found = _gemv_layout(self.dtype)
        if found is None or (self.dtype == torch.bfloat16 and self.in_features % 2):
            return
        # made outside the huge-page arena and moved there once kept (a float32 copy that does not round as oneDNN's
        # is dropped, which takes the copy to find out), so that no dropped copy leaves a hole between the weights there
        self.gemv_tensor = _gemv_copy(weight, found[1])
        self.gemv, self.address = found, self.gemv_tensor.data_ptr()
        self._weight_ptr = self.address
        self.gemv_max_rows = GEMV_MAX_ROWS
        if self.dtype == torch.float32 and not self.rounds_as_onednn:
            self.gemv = self.gemv_tensor = None
            self.address = torch.ops.mkldnn.data_ptr(self.tensor)
        else:
            with huge_page_allocations():
                self.gemv_tensor = self.gemv_tensor.clone()
            self.address = self._weight_ptr = self.gemv_tensor.data_ptr()
        self.__dict__.pop("rounds_as_onednn", None)  # computed again for the weight as it ends up

    @functools.cached_property
    def rounds_as_onednn(self) -> bool:
        """Whether the GEMV kernel gives a row oneDNN's bits for this weight (kernels/cpu_linear.cpp sums K in
        oneDNN's runs for float32), so that a row's outputs do not depend on which of the two its step's row count
        picks: three random rows through the GEMV against them in a matmul of one row more than the GEMV takes
        (oneDNN's, as in a step), with and without a random bias. False where no GEMV reads the weight."""
        if self.gemv is None or self.blocked:
            return False
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.gemv_max_rows + 1, self.in_features, generator=g).to(self.dtype)
        bias = torch.randn(self.out_features, generator=g).to(self.dtype)
        onednn = torch.ops.mkldnn._linear_pointwise
        return all(torch.equal(self._gemv(x[:3], b, 3), onednn(x, self.tensor, b, "none", [], "")[:3])
                   for b in (None, bias))

    def _blocked_dense(self) -> torch.Tensor:
        """A blocked weight as a dense [out_features, in_features] tensor (a copy)."""
        return self.tensor.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features].contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling() or self.native:
            return packed_linear(x, self.handle, self.out_features, bias)
        return self.run(x, bias)

    def run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows == 0:  # oneDNN refuses an empty matmul
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self.blocked:
            if x.dtype != self.dtype or (bias is not None and bias.dtype != self.dtype):
                return F.linear(x, self._blocked_dense().to(x.dtype), bias)
            return self._gemv(x, bias, rows)
        if (rows <= self.gemv_max_rows and x.dtype == self.dtype
                and (bias is None or bias.dtype == self.dtype)):
            return self._gemv(x, bias, rows)
        return torch.ops.mkldnn._linear_pointwise(x, self.tensor, bias, "none", [], "")

    def _gemv(self, x: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        kernels, code = self.gemv
        x = x.contiguous()
        bias = None if bias is None else bias.contiguous()
        out = x.new_empty(*x.shape[:-1], self.out_features)
        if self.blocked:
            status = kernels.blocked_linear(code, x.data_ptr(), self.in_features, rows, self._weight_ptr,
                                            self.out_features, self.in_features,
                                            None if bias is None else bias.data_ptr(), out.data_ptr(),
                                            self.out_features, self.gemv_max_rows)
        else:
            status = kernels.packed_gemv(code, x.data_ptr(), self.in_features, rows, self._weight_ptr,
                                         self.out_features, self.in_features, None if bias is None else bias.data_ptr(),
                                         out.data_ptr(), self.out_features)
        assert status == 0, (self.out_features, self.in_features, self.dtype)
        return out


def _native_operator() -> bool:
    """Whether `torch_shift::packed_linear` runs its C++ implementation on the CPU (kernels/cpu_ops.cpp): a call
    then never runs Python, which after a weight streamed through the caches costs 120-180 us cold (issue 20)."""
    from torch_shift.kernels import cpu_ops

    return cpu_ops()


def _blocked_kernel(dtype: torch.dtype):
    """(kernels, ts_blocked_linear's dtype code), kernels None where the AVX2 kernel does not run."""
    from torch_shift.kernels import cpu_kernels

    kernels = cpu_kernels()
    return (kernels if kernels is not None and kernels.packed_gemv_dtypes & _BLOCKED_BIT else None,
            _BLOCKED_CODES[dtype][1])


def _gemv_kernel(weight: torch.Tensor, packed: torch.Tensor, probing: bool = False):
    """(kernels, dtype code) where the GEMV kernel can read `packed`: this CPU runs it for the dtype, and every
    element of `weight` sits where the kernel's layout formula says, its features padded with zeros to whole blocks
    of 64 (the kernel reads whole blocks and stores the first N outputs) and its K not padded; else None. `probing`:
    `weight` finds the layout oneDNN packs the dtype in (_gemv_layout)."""
    from torch_shift.kernels import cpu_kernels

    if weight.dtype not in _GEMV_DTYPES or packed.layout != torch._mkldnn:
        return None
    code, bit = _GEMV_DTYPES[weight.dtype]
    out_features, in_features = weight.shape
    if weight.dtype == torch.bfloat16 and in_features % 2:
        return None
    kernels = cpu_kernels()
    if kernels is None or not kernels.packed_gemv_dtypes & bit:
        return None
    nbytes = -(-out_features // _GEMV_BLOCK) * _GEMV_BLOCK * in_features * weight.element_size()
    if out_features % _GEMV_BLOCK and _allocated_bytes(packed) < nbytes:  # oneDNN padded less than the kernel reads
        return None
    raw = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    buffer = torch.frombuffer(raw, dtype=weight.dtype)
    # bfloat16 in blocks of 64 features on AVX-512 CPUs, of 32 where oneDNN packs for AMX (the kernel's AMX_BF16_CODE).
    # A weight that reads alike in both (all zeros: bench_spec's widened down projections on a TP-2 rank) takes the
    # layout of the dtype's other weights, as the C++ decoder runs a model whose weights share one layout
    codes = (code,) if weight.dtype == torch.float32 else (code, AMX_BF16_CODE)
    usual = None if probing or len(codes) == 1 else _gemv_layout(weight.dtype)
    if usual is not None:
        codes = (usual[1], *(c for c in codes if c != usual[1]))
    for layout_code in codes:
        if torch.equal(buffer, _gemv_copy(weight, layout_code).view(-1)):
            return kernels, layout_code
    return None


def _allocated_bytes(packed: torch.Tensor) -> int:
    """The bytes oneDNN allocated for a packed weight (its padded shape's); 0 where this torch cannot say."""
    nbytes = getattr(torch.ops.mkldnn, "_nbytes", None)
    return nbytes(packed) if nbytes is not None else 0


@functools.cache
def _gemv_layout(dtype: torch.dtype):
    """(kernels, dtype code) of the layout the GEMV reads oneDNN's packing of `dtype` in on this CPU, for a weight of
    whole blocks (float32: always the kernel's own; bfloat16: 64 or 32 features a block, as oneDNN packs), or None."""
    from torch_shift.kernels import cpu_kernels

    kernels = cpu_kernels()
    code, bit = _GEMV_DTYPES[dtype]
    if kernels is None or not kernels.packed_gemv_dtypes & bit:
        return None
    if dtype == torch.float32:
        return kernels, code
    probe = torch.randn(_GEMV_BLOCK, 4 * _GEMV_BLOCK, generator=torch.Generator().manual_seed(0)).to(dtype)
    return _gemv_kernel(probe, torch.ops.mkldnn._reorder_linear_weight(probe, None), probing=True)


def _gemv_copy(weight: torch.Tensor, code: int) -> torch.Tensor:
    """`weight` in the GEMV's layout `code`, its features padded with zeros to whole blocks of 64: what _gemv_kernel
    finds oneDNN's packing to be, and the copy for a shape whose oneDNN packing the kernel cannot read (K padded, or
    too few features padded)."""
    out_features, in_features = weight.shape
    whole = F.pad(weight, (0, 0, 0, -out_features % _GEMV_BLOCK))
    if weight.dtype == torch.float32:  # element (n, k) at ((n / 64) * K + k) * 64 + n % 64
        return whole.view(-1, _GEMV_BLOCK, in_features).transpose(1, 2).contiguous()
    # pairs of k in blocks of `width` features: (((n / width) * (K / 2) + k / 2) * width + n % width) * 2 + k % 2
    width = _GEMV_BLOCK // 2 if code == AMX_BF16_CODE else _GEMV_BLOCK
    return whole.view(-1, width, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


# out_features travels beside the handle: where one compiled graph serves several weights, dynamo makes the
# handle a symbolic int, which the fake kernel cannot look up.
@custom_op("torch_shift::packed_linear")
def packed_linear(x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return _packed_by_handle[handle].run(x.contiguous(), bias)


@packed_linear.register_fake
def _(x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


# On a GPU, a matmul of a few rows runs the kernel timed fastest for its shape, a Triton tile or cuBLAS
# (torch_shift.kernels.triton_linear); False: always cuBLAS.
GPU_TRITON_LINEARS = True
_HAS_TRITON = importlib.util.find_spec("triton") is not None


@custom_op("torch_shift::gpu_linear")
def gpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from torch_shift.kernels import triton_linear

    return triton_linear.linear(x, weight, bias)


@gpu_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """x @ weight.T + bias, through `packed` when the weight was prepared."""
    if packed is not None:
        return packed(x, bias)
    if x.is_cuda and GPU_TRITON_LINEARS and _HAS_TRITON:  # the operator picks the kernel by the rows it gets
        return gpu_linear(x, weight, bias)
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
        if hasattr(module, "pack"):  # several weights of its own (torch_shift.models.moe.Experts)
            total += module.pack(drop_dense)
            continue
        weight = module.dense_weight() if hasattr(module, "dense_weight") else module.weight
        if weight is None or not packing_supported(weight.device, weight.dtype):
            continue
        module.packed = PackedWeight(weight)
        total += module.packed.nbytes
        if drop_dense:
            module.drop_dense() if hasattr(module, "drop_dense") else drop_parameter(module, "weight")
    return total


def gemv_rows(model: nn.Module) -> int:
    """The most rows of a step of `model` whose matmuls all run the GEMV kernel (they then run no other matmul, and
    may run on the kernel's decode pool: torch_shift.kernels.arm_gemv_pool); 0 where some matmul reads no packed
    weight that the GEMV reads."""
    weights = []
    for module in model.modules():
        if hasattr(module, "packed"):
            packed = module.packed
            if packed is None:
                return 0
            weights += [*packed.gate_up, *packed.down] if hasattr(packed, "gate_up") else [packed]
    return min((w.gemv_max_rows for w in weights), default=0)


def drop_parameter(module: nn.Module, name: str) -> None:
    """`module.<name>` replaced by an empty parameter: its memory is freed unless something else holds it."""
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(old.new_empty(0), requires_grad=False))


def packed_weight(handle: int) -> PackedWeight:
    return _packed_by_handle[handle]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s weights: the storages of its parameters (views of one storage count it once) and
    its packed weights (each as the dense tensor it was packed from)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    packed = {m.packed.handle: m.packed.nbytes for m in model.modules() if getattr(m, "packed", None) is not None}
    return sum(storages.values()) + sum(packed.values())
