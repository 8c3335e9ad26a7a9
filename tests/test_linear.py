"""Packed linear layers: oneDNN's matmul and torch_shift's GEMV kernel on the same prepared weight, against
F.linear in float64."""

import contextlib
import ctypes
import os

import pytest
import torch
import torch.nn.functional as F

from torch_shift.kernels import compiler, cpu_kernels, gemv_on_tile_unit
from torch_shift.models import linear
from torch_shift.models.linear import (
    AMX_BF16_CODE,
    AMX_DOT_GEMV_MAX_ROWS,
    GEMV_MAX_ROWS,
    PackedWeight,
    _gemv_kernel,
    packing_supported,
)

DTYPES = [dt for dt in (torch.float32, torch.bfloat16) if packing_supported(torch.device("cpu"), dt)]
# the AVX2 kernel's 16-feature blocks run on every CPU with AVX2 and FMA (the engine takes them where the AVX-512
# kernel does not run): tested wherever they run
BLOCKED = compiler() is not None and cpu_kernels() is not None and bool(cpu_kernels().packed_gemv_dtypes & 4)
# (dtype, PackedWeight's `blocked`): this CPU's choice for each dtype, and the blocks forced where they run
VARIANTS = [(dt, None) for dt in DTYPES] + ([(dt, True) for dt in (torch.float32, torch.bfloat16)] if BLOCKED else [])
VARIANT_IDS = [f"{str(dt)[6:]}-{'blocked' if b else 'auto'}" for dt, b in VARIANTS]


def gemv_expected(dtype: torch.dtype, shape: tuple[int, int] | None = None) -> bool:
    """Where the GEMV kernel must be taken: a compiler builds it, the CPU has the instructions and, for a float32
    weight of `shape`, this torch's oneDNN packs it in blocks of 64 features (onednn_blocks_by_64)."""
    kernels = cpu_kernels() if compiler() is not None else None
    return (kernels is not None and bool(kernels.packed_gemv_dtypes & (1 if dtype == torch.float32 else 2))
            and (dtype != torch.float32 or shape is None or onednn_blocks_by_64(*shape)))


def onednn_blocks_by_64(out_features: int, in_features: int) -> bool:
    """Whether oneDNN packs a float32 weight of this shape in blocks of 64 features, element (n, k) at
    ((n / 64) * K + k) * 64 + n % 64, the layout the GEMV reads. The oneDNN of torch 2.13 to 2.15 does for every
    shape the tests use; torch 2.11's transposes a weight of fewer than 512 inputs whole (element (n, k) at
    k * N + n), which the GEMV leaves to oneDNN's matmul."""
    if out_features % 64:
        return False
    weight = torch.arange(out_features * in_features, dtype=torch.float32).view(out_features, in_features)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    raw = (ctypes.c_char * weight.nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    blocks = torch.frombuffer(raw, dtype=torch.float32).view(-1, in_features, 64).transpose(1, 2)
    return torch.equal(blocks.reshape(out_features, in_features), weight)


def reference(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def assert_close(out, expected, dtype, in_features):
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * in_features ** 0.5)
    else:  # both round the float32 sum to bfloat16 once: within a unit in the last place or two
        torch.testing.assert_close(out.double(), expected, rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("dtype,blocked", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("shape", [(192, 96), (1536, 1024), (100, 64), (128, 33), (40, 7), (688, 128), (128, 344),
                                   (1001, 96)])
def test_packed_matches_reference_for_every_row_count(dtype, blocked, shape):
    torch.manual_seed(0)
    out_features, in_features = shape
    weight = torch.randn(shape).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    packed = PackedWeight(weight, blocked)
    if packed.blocked:  # every shape, every row count: the blocked kernel
        assert packed.gemv is not None
    elif dtype == torch.bfloat16 and in_features % 2:  # the kernel reads pairs of k
        assert packed.gemv is None
    else:
        # oneDNN's packing where the kernel reads it (features padded to whole blocks of 64), else a copy of the
        # kernel's own (oneDNN pads K to 16 in float32 and 32 in bfloat16, features to 32 where it packs for AMX, and
        # torch 2.11's transposes float32 weights of fewer than 512 inputs); float32 where a row rounds as oneDNN's,
        # as it did on every torch measured (2.11, 2.13)
        assert (packed.gemv is not None) == gemv_expected(dtype)
        assert packed.gemv is None or dtype != torch.float32 or packed.rounds_as_onednn
    for rows in [0, 1, 2, 3, 4, 5, 6, 7, 8, 13, packed.gemv_max_rows + 1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 100]:
        x = torch.randn(rows, in_features).to(dtype)
        for b in (None, bias):
            out = packed(x, b)
            assert out.shape == (rows, out_features) and out.dtype == dtype
            assert_close(out, reference(x, weight, b), dtype, in_features)


@pytest.mark.parametrize("dtype,blocked", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("in_features", [128, 1408])
def test_gemv_rows_are_independent_and_inputs_may_be_views(dtype, blocked, in_features):
    """Each row of a few-row matmul equals that row alone, and a strided or 3-D input gives what its
    contiguous copy gives: the decode step's batch never changes a request's result. 1,408 inputs with a bias, and 2-18
    rows: the AVX-512 GEMV's one group of up to 9 rows, float32's half blocks of 10-14 rows (10-17 on Intel CPUs) and
    its groups of up to 6, bfloat16's half blocks of 9-17 rows and its sets of them beyond, across oneDNN's runs of
    k-steps in float32."""
    torch.manual_seed(1)
    weight = torch.randn(256, in_features).to(dtype)
    bias = torch.randn(256).to(dtype)
    packed = PackedWeight(weight, blocked)
    # the GEMV's rows (fewer in bf16 packed for AMX where the tile unit cannot run: larger batches run oneDNN's matmul,
    # rounding its own way)
    dots_on_amx = packed.gemv_code == AMX_BF16_CODE and packed.gemv_max_rows == AMX_DOT_GEMV_MAX_ROWS
    max_rows = AMX_DOT_GEMV_MAX_ROWS if dots_on_amx else GEMV_MAX_ROWS
    x = torch.randn(max_rows, 2 * in_features).to(dtype)[:, :in_features]  # strided rows
    for b in (None, bias):
        together = packed(x, b)
        assert_close(together, reference(x, weight, b), dtype, in_features)
        for row in range(max_rows):
            assert torch.equal(packed(x[row:row + 1], b), together[row:row + 1])
        for rows in [r for r in (2, 3, 7, 9, 10, 12, 13, 14, 15, 17, 18) if r < max_rows]:
            assert torch.equal(packed(x[:rows], b), together[:rows])
        lead = next(d for d in (4, 2, 1) if max_rows % d == 0)  # the rows as a 3-D view
        assert torch.equal(packed(x.reshape(lead, -1, in_features), b), together.reshape(lead, -1, 256))


@pytest.mark.skipif(torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN packs bfloat16 on this CPU")
def test_bfloat16_in_onednns_layout_where_onednn_cannot_pack_it_is_a_value_error():
    """Without AVX-512 oneDNN refuses to pack bfloat16 (a RuntimeError of its own): PackedWeight says so, and names
    the 16-feature blocks, which run it there."""
    with pytest.raises(ValueError, match="16-feature blocks"):
        PackedWeight(torch.randn(64, 32).to(torch.bfloat16), blocked=False)


@pytest.mark.skipif(not gemv_expected(torch.float32), reason="the AVX-512 GEMV kernel does not run here")
@pytest.mark.parametrize("in_features", [96, 512, 640, 1024, 1408, 2816])
def test_a_float32_row_rounds_alike_through_the_gemv_and_onednn(in_features):
    """oneDNN's float32 matmul sums K in runs of k-steps (512 up to K = 1,024, else 1,024) added in order, and the GEMV
    sums so too: a row's outputs are the same bits on either side of the GEMV's rows, with and without a bias, so that
    a token's logits do not depend on its step's size (the checks of speculative decoding change it)."""
    torch.manual_seed(3)
    weight = torch.randn(128, in_features) * 0.05
    bias = torch.randn(128)
    packed = PackedWeight(weight, blocked=False)
    assert packed.gemv is not None and packed.rounds_as_onednn
    assert packed.gemv_max_rows == GEMV_MAX_ROWS
    x = torch.randn(GEMV_MAX_ROWS + 1, in_features)
    for b in (None, bias):
        together = packed(x, b)  # one row more than the GEMV takes: oneDNN's matmul
        for row in (0, 7, GEMV_MAX_ROWS):
            assert torch.equal(packed(x[row:row + 1], b), together[row:row + 1]), (in_features, row)
        for rows in (7, 10, 14, 16, 17, 18, 41, GEMV_MAX_ROWS):  # one group, half blocks, groups of up to 6
            assert torch.equal(packed(x[:rows], b), together[:rows]), (in_features, rows)


@pytest.mark.skipif(not gemv_expected(torch.bfloat16), reason="no bfloat16 GEMV here")
@pytest.mark.parametrize("in_features", [96, 1024])
def test_bf16_dot_products_read_both_layouts_alike(in_features):
    """oneDNN's bfloat16 blocks of 64 features and its AMX layout's blocks of 32 (read by the dot products where the
    tile unit cannot run), each packed here by its formula (cpu_linear.cpp's header): every output the same chain of
    dot products either way, so the same bits at every row count, one group, half blocks and sets of them."""
    torch.manual_seed(5)
    out_features = 192
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    pairs = weight.view(out_features, in_features // 2, 2)
    layouts = {code: pairs.view(out_features // width, width, in_features // 2, 2).transpose(1, 2).contiguous()
               for code, width in ((1, 64), (AMX_BF16_CODE, 32))}
    x = torch.randn(GEMV_MAX_ROWS, 2 * in_features).to(torch.bfloat16)[:, :in_features]
    kernels = cpu_kernels()
    with gemv_on_tile_unit_off():
        for rows in (1, 2, 8, 9, 12, 17, 18, 35, GEMV_MAX_ROWS):
            for b in (None, bias):
                outs = []
                for code, packed in layouts.items():
                    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
                    assert kernels.packed_gemv(code, x.data_ptr(), x.stride(0), rows, packed.data_ptr(), out_features,
                                               in_features, None if b is None else b.data_ptr(), out.data_ptr(),
                                               out_features) == 0
                    outs.append(out)
                assert torch.equal(outs[0], outs[1]), rows
                assert_close(outs[0], reference(x[:rows], weight, b), torch.bfloat16, in_features)


@contextlib.contextmanager
def gemv_on_tile_unit_off():
    """The dot products on a CPU with AMX too (a no-op elsewhere)."""
    on = gemv_on_tile_unit()
    if on:
        gemv_on_tile_unit(0)
    try:
        yield
    finally:
        if on:
            gemv_on_tile_unit(1)


@pytest.mark.parametrize("shape", [(192, 1024), (64, 4096), (1536, 96)])
def test_bf16_gemv_on_the_tile_unit_against_the_dot_products(shape):
    """On a CPU with AMX, bfloat16 packed for it runs the GEMV on the tile unit (a block of 32 features at a time, in
    passes of up to 32 rows, each one or two tiles of up to 16): against float64 as the AVX512-BF16 dot products are,
    within a unit in the last place of theirs in a few outputs (the unit rounds a pair's two products into a sum its
    own way), and each row's bits the same at every row count. Skipped where the CPU has no AMX."""
    if compiler() is None or not gemv_on_tile_unit():
        pytest.skip("the GEMV does not run on a tile unit here")
    torch.manual_seed(4)
    out_features, in_features = shape
    weight = torch.randn(shape).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    packed = PackedWeight(weight, blocked=False)
    if packed.gemv_code != AMX_BF16_CODE:
        pytest.skip("oneDNN did not pack bfloat16 in its AMX layout")
    assert packed.gemv_max_rows == GEMV_MAX_ROWS
    x = torch.randn(70, in_features).to(torch.bfloat16)
    differ = 0
    for b in (None, bias):
        tiles = packed._gemv(x, b, 70)
        try:
            assert not gemv_on_tile_unit(0)
            dots = packed._gemv(x, b, 70)
        finally:
            gemv_on_tile_unit(1)
        assert_close(tiles, reference(x, weight, b), torch.bfloat16, in_features)
        ulps = (tiles.view(torch.int16).int() - dots.view(torch.int16).int()).abs()
        assert ((ulps <= 1) | ((tiles.float() - dots.float()).abs() < 1e-5)).all()  # (or both about 0)
        assert (tiles != dots).float().mean() < 0.01
        differ += int((tiles != dots).sum())
        for rows in (1, 2, 5, 16, 17, 32, 33, 48, 64):
            assert torch.equal(packed._gemv(x[:rows], b, rows), tiles[:rows]), rows
        for row in (20, 69):
            assert torch.equal(packed._gemv(x[row:row + 1], b, 1), tiles[row:row + 1])
    assert differ > 0  # the tile unit ran: its roundings differ from the dot products' in a few outputs (1-9 here)


@pytest.mark.skipif(not BLOCKED, reason="the AVX2 kernel does not run on this CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_blocked_matmul_rows_equal_the_gemvs_rows(dtype):
    """The blocked kernel's matmul (K in runs of 256, x packed, sums waiting in float32 between runs) gives every row
    the bits the GEMV gives it alone: a prefill chunk and a decode step compute a token alike. K of 600 (a partial
    run), 40 features (a partial block; three blocks: a pair and one, as AVX-512 tiles take them), rows that are no
    multiple of the 6-row panels, odd and even counts of panels (AVX-512 tiles take two at a time), a strided
    input."""
    torch.manual_seed(2)
    weight = torch.randn(40, 600).to(dtype)
    bias = torch.randn(40).to(dtype)
    packed = PackedWeight(weight, blocked=True)
    x = torch.randn(131, 700).to(dtype)[:, :600]
    for b in (None, bias):
        together = packed(x, b)
        assert_close(together, reference(x, weight, b), dtype, 600)
        for row in (0, 1, 5, 6, 97, 130):
            assert torch.equal(packed(x[row:row + 1], b), together[row:row + 1]), row
        for rows in (17, 30, 125):  # 3, 5 and 21 panels (20 and 1 in the kernel's ranges of panels)
            assert torch.equal(packed(x[:rows], b), together[:rows]), rows


def test_a_weight_packed_in_another_layout_keeps_onednn():
    """The layout check reads the real weight: a packed tensor whose elements are not where the kernel's
    formula puts them gives no kernel."""
    torch.manual_seed(2)
    weight = torch.randn(128, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    assert (_gemv_kernel(weight, packed) is not None) == gemv_expected(torch.float32, (128, 64))
    assert _gemv_kernel(weight.flip(0).contiguous(), packed) is None
    assert _gemv_kernel(weight, weight) is None  # a dense tensor is not a packed one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_zero_weight_takes_the_layout_of_the_others(dtype):
    """An all-zero weight reads alike in every layout the GEMV knows (bench_spec's widened down projections on a TP-2
    rank); it takes the one the dtype's other weights have, so that the C++ decoder runs a model that has one."""
    if not packing_supported(torch.device("cpu"), dtype):
        pytest.skip(f"no packed {dtype} here")
    torch.manual_seed(4)
    usual = PackedWeight(torch.randn(192, 1024).to(dtype))
    zero = PackedWeight(torch.zeros(192, 1024, dtype=dtype))
    assert (zero.gemv is None) == (usual.gemv is None)
    assert zero.gemv_code == usual.gemv_code
    x = torch.randn(3, 1024).to(dtype)
    assert torch.equal(zero(x, None), torch.zeros(3, 192, dtype=dtype))


@pytest.mark.skipif(not gemv_expected(torch.bfloat16), reason="no bfloat16 GEMV here")
@pytest.mark.parametrize("usual", [1, AMX_BF16_CODE])
def test_a_bf16_weight_that_reads_alike_in_both_layouts_takes_the_usual_one(usual, monkeypatch):
    """As above on any CPU whose GEMV reads bfloat16, whichever layout oneDNN packs in: made each in turn."""
    monkeypatch.setattr(linear, "_gemv_layout", lambda dtype: (cpu_kernels(), usual))
    assert PackedWeight(torch.zeros(192, 1024, dtype=torch.bfloat16)).gemv_code == usual


@pytest.mark.parametrize("dtype,blocked", VARIANTS, ids=VARIANT_IDS)
def test_compiled_packed_linear_takes_both_paths(dtype, blocked):
    """Under torch.compile the custom op runs the same two paths: one row and many give the eager results."""
    torch.manual_seed(3)
    weight = torch.randn(128, 64).to(dtype)
    packed = PackedWeight(weight, blocked)
    compiled = torch.compile(lambda x: packed(x, None), fullgraph=True)
    for rows in (1, 3, 17):
        x = torch.randn(rows, 64).to(dtype)
        assert torch.equal(compiled(x), packed(x, None))


@pytest.mark.parametrize("dtype,blocked", VARIANTS, ids=VARIANT_IDS)
def test_the_operators_cpp_implementation_is_the_python_one(dtype, blocked):
    """torch_shift::packed_linear's CPU implementation in C++ (kernels/cpu_ops.cpp), which serves eager and compiled
    calls where it builds, gives bitwise what PackedWeight.run (the Python implementation) gives: every row count on
    both sides of the GEMV's limit, with and without bias, strided and 3-D inputs, no rows; a weight freed is
    forgotten."""
    from torch_shift.kernels import cpu_ops

    if compiler() is None or not cpu_ops():
        pytest.skip("torch_shift's CPU operators cannot be built here")
    assert "cpu_ops.cpp" in torch._C._dispatch_dump_table("torch_shift::packed_linear")  # the CPU kernel
    torch.manual_seed(4)
    weight = torch.randn(192, 128).to(dtype)
    bias = torch.randn(192).to(dtype)
    packed = PackedWeight(weight, blocked)
    assert packed.native
    for rows in [0, 1, 2, 5, packed.gemv_max_rows + 1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 100]:
        x = torch.randn(rows, 256).to(dtype)[:, :128]
        for b in (None, bias):
            out = packed(x, b)
            assert out.shape == (rows, 192) and torch.equal(out, packed.run(x, b)), (rows, b is None)
    x = torch.randn(2, 3, 128).to(dtype)
    assert torch.equal(packed(x, bias), packed.run(x, bias))
    handle = packed.handle
    del packed
    with pytest.raises(RuntimeError, match="no packed weight"):
        torch.ops.torch_shift.packed_linear(x, handle, 192, None)


@pytest.mark.skipif(not BLOCKED, reason="the blocked kernel does not run here (no compiler, or no AVX2)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_kernel_sums_exactly_and_rounds_as_torch(dtype):
    """Integer weights and inputs make every float32 sum exact: the kernel's result is then bitwise torch's rounding
    of it (to nearest even for bfloat16), for the GEMV and the panelled matmul, a last block of fewer than 16 features
    and a bias; infinities and NaN pass through as IEEE says; an input of another dtype runs F.linear on the weight."""
    torch.manual_seed(5)
    for out_features, in_features in [(16, 1), (37, 100), (2816, 64), (64, 3000)]:
        weight = torch.randint(-8, 9, (out_features, in_features)).to(dtype)
        bias = torch.randint(-300, 301, (out_features,)).to(dtype)
        packed = PackedWeight(weight, blocked=True)
        for rows in (1, 5, packed.gemv_max_rows, packed.gemv_max_rows + 1, 200):
            x = torch.randint(-8, 9, (rows, in_features)).to(dtype)
            for b in (None, bias):
                exact = reference(x, weight, b)
                assert exact.abs().max() < 2 ** 24  # every partial sum exact in float32
                for out in (packed(x, b), packed.run(x, b)):
                    assert torch.equal(out, exact.to(dtype)), (out_features, in_features, rows)
    x = torch.ones(2, 37, dtype=dtype)
    x[0, 0], x[1, 0] = float("inf"), float("nan")
    weight = torch.ones(20, 37, dtype=dtype)
    out = PackedWeight(weight, blocked=True)(x, None)
    assert torch.isinf(out[0]).all() and torch.isnan(out[1]).all()
    other = torch.float64 if dtype == torch.float32 else torch.float32
    x_other = torch.randn(3, 37, dtype=other)
    torch.testing.assert_close(PackedWeight(weight, blocked=True)(x_other, None), F.linear(x_other, weight.to(other)))


def _huge_pages_offered() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _anon_huge_bytes(address: int, nbytes: int) -> int:
    """AnonHugePages of this process's mappings that overlap [address, address + nbytes) (/proc/self/smaps;
    advice splits a mapping where it starts and ends)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < address + nbytes and address < end
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32), reason="no oneDNN")
def test_packed_weights_move_into_huge_pages_where_the_kernel_offers_them():
    from torch_shift.memory import HUGE_PAGE, advise_huge_pages

    assert advise_huge_pages(HUGE_PAGE + 1, HUGE_PAGE) == 0  # no whole huge page inside: nothing advised
    weight = torch.randn(4096, 1024)  # 16 MiB
    packed = PackedWeight(weight)
    x = torch.randn(3, 1024)
    torch.testing.assert_close(packed(x, None), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    if not (_huge_pages_offered() and os.path.exists("/proc/self/smaps")):
        pytest.skip("this kernel offers no transparent huge pages")
    huge = _anon_huge_bytes(packed.address, packed.nbytes)
    if huge == 0:
        pytest.skip("the kernel refused to collapse (Linux < 6.1, or no free huge pages)")
    assert huge >= packed.nbytes - 2 * HUGE_PAGE  # all but the partial pages at either end


def _mapping(address: int) -> tuple[int, int, str, dict[str, int]]:
    """The mapping of this process that holds `address` (/proc/self/smaps): its start, end, permissions and numeric
    fields (kB, or flags)."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            words = line.split()
            if "-" in words[0] and not words[0].endswith(":"):
                start, end = (int(x, 16) for x in words[0].split("-"))
                current = (start, end, words[1], {}) if start <= address < end else None
                found = found or current
            elif current is not None and words[0].endswith(":") and words[1].isdigit():
                current[3][words[0][:-1]] = int(words[1])
    assert found is not None, hex(address)
    return found


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32), reason="no oneDNN")
def test_packed_weights_lie_one_after_another_and_other_allocations_keep_the_default_allocator():
    """oneDNN packs inside `huge_page_allocations()`: two weights of 5.5 MiB lie one right after the other, in one
    mapping advised huge pages (kernels/cpu_ops.cpp's HugePageArena), where PyTorch's allocator would have left a
    partial huge page at either end of each, which only 4 KiB pages can back. Freed after the scope (oneDNN frees
    through the raw deleter of the allocator installed then), their memory goes back to the system and their
    addresses stay reserved. Another thread's allocations during the scope, small ones, and every allocation after it
    keep PyTorch's default allocator (outside the arena's mapping)."""
    import gc
    import sys
    import threading

    from torch_shift.kernels import huge_page_scope
    from torch_shift.memory import HUGE_PAGE, huge_page_allocations

    if sys.platform != "linux" or huge_page_scope() is None:
        pytest.skip("the operator library does not build here")
    weight = torch.randn(1408, 1024)
    first, second = PackedWeight(weight), PackedWeight(weight)
    first_address, second_address = first.address, second.address
    # oneDNN's packing of this shape, or the 16-feature blocks where the AVX2 kernel runs: as many bytes
    assert second_address == first_address + weight.nbytes
    start, end, permissions, fields = _mapping(first_address)
    assert start <= first_address and second_address + weight.nbytes <= end and permissions == "rw-p"
    if _huge_pages_offered() and "THPeligible" in fields:  # (Linux 5.0+)
        assert fields["THPeligible"] == 1
    x = torch.randn(3, 1024)
    torch.testing.assert_close(second(x, None), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    address = first_address
    del first, second
    gc.collect()
    _, _, permissions, fields = _mapping(address)
    assert permissions == "---p" and fields["Rss"] == 0

    def sizes():
        return [torch.empty(3 * HUGE_PAGE + 4096 * i, dtype=torch.uint8) for i in range(4)]

    elsewhere = []
    with huge_page_allocations():
        inside = torch.empty(3 * HUGE_PAGE + 4096, dtype=torch.uint8)
        with huge_page_allocations():  # scopes nest
            nested = torch.empty(3 * HUGE_PAGE + 4096, dtype=torch.uint8)
        outer = torch.empty(3 * HUGE_PAGE + 4096, dtype=torch.uint8)
        thread = threading.Thread(target=lambda: elsewhere.extend(sizes()))
        thread.start()
        thread.join()
        small = [torch.empty(32 << 10, dtype=torch.uint8) for _ in range(4)]
    after = sizes()
    assert nested.data_ptr() == inside.data_ptr() + inside.nbytes
    assert outer.data_ptr() == nested.data_ptr() + nested.nbytes
    arena_start, arena_end, _, _ = _mapping(inside.data_ptr())
    for t in elsewhere + small + after:
        assert not arena_start <= t.data_ptr() < arena_end


def test_bench_linear_prints_every_shape_and_row_count(capsys):
    """bench/bench_linear.py (the figures in docs/performance.md) runs here, over two copies of each weight: a line per
    weight and row count, each way that runs on this CPU timed, and the layout the engine takes named."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_linear import SHAPES, main

    rows = [1, GEMV_MAX_ROWS + 1]
    assert main(["--rows", ",".join(map(str, rows)), "--dtypes", "float32", "--repeats", "1", "--copies", "2"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("float32 ")]
    assert len(lines) == len(rows) * len(SHAPES)
    for line in lines:
        few = int(line[2]) <= GEMV_MAX_ROWS
        expected = ("blocks" if BLOCKED and not gemv_expected(torch.float32) else "GEMV" if few
                    and gemv_expected(torch.float32) else "oneDNN")
        assert line[-1] == expected, line


@pytest.mark.skipif(not BLOCKED, reason="the AVX2 kernel does not run on this CPU")
def test_ab_cpu_linear_builds_both_revisions_and_compares_their_bits(capsys):
    """bench/ab_cpu_linear.py (the A/B figures in docs/performance.md): this tree's kernel and HEAD's, built apart and
    loaded into one process, a line per dtype and row count with both rates and whether their outputs agree."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    sys.path.insert(0, str(root / "bench"))
    from ab_cpu_linear import main

    assert main(["--base", "HEAD", "--rows", "1,17", "--dtypes", "float32", "--layers", "1", "--repeats", "1"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("float32 ")]
    assert [line[1] for line in lines] == ["1", "17"]
    assert all(float(line[-2]) > 0 and line[-1] in ("True", "False") for line in lines)
    # weights of other shapes (a TP rank's MLP), in bfloat16
    assert main(["--base", "HEAD", "--rows", "7", "--dtypes", "bfloat16", "--layers", "1", "--repeats", "1",
                 "--shapes", "gate/up=96x64,down=32x48"]) == 0
    out = capsys.readouterr().out
    assert "1 layers of gate/up, down" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("bfloat16 ")] == ["7"]
    with pytest.raises(SystemExit, match="not name=NxK"):
        main(["--shapes", "down=32by48"])
    if gemv_expected(torch.float32):  # the AVX-512 GEMV on oneDNN's packed weights: the same file, the same bits
        assert main(["--kernel", "packed", "--base", "HEAD", "--rows", "1,7", "--dtypes", "float32", "--layers", "1",
                     "--repeats", "1"]) == 0
        lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("float32 ")]
        assert [line[1] for line in lines] == ["1", "7"] and all(line[-1] == "True" for line in lines)


@pytest.mark.skipif(not gemv_expected(torch.bfloat16), reason="this CPU has no AVX-512 bf16 GEMV kernel")
def test_gemv_reads_both_onednn_bf16_layouts_alike():
    """oneDNN packs bfloat16 in blocks of 64 features on AVX-512 CPUs and of 32 where it packs for AMX; the GEMV
    reads either (codes 1 and 4) and gives the same bits in its dot products, whichever this CPU's oneDNN makes: both
    built here by the layout formulas of kernels/cpu_linear.cpp, every row count up to the GEMV's limit, with bias. (On
    a CPU with AMX, code 4 runs on the tile unit, which rounds a few sums otherwise:
    test_bf16_gemv_on_the_tile_unit_against_the_dot_products.)"""
    tiles = gemv_on_tile_unit()
    gemv_on_tile_unit(0)
    try:
        _read_both_bf16_layouts(cpu_kernels())
    finally:
        gemv_on_tile_unit(int(tiles))


def _read_both_bf16_layouts(kernels):
    torch.manual_seed(5)
    out_features, in_features = 192, 96
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)

    def layout(width):  # element (n, k) at (((n / width) * (K / 2) + k / 2) * width + n % width) * 2 + k % 2
        return weight.view(-1, width, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()

    for rows in range(1, GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        outs = []
        for code, width in ((1, 64), (4, 32)):
            packed = layout(width)
            out = torch.empty(rows, out_features, dtype=torch.bfloat16)
            assert kernels.packed_gemv(code, x.data_ptr(), in_features, rows, packed.data_ptr(), out_features,
                                       in_features, bias.data_ptr(), out.data_ptr(), out_features) == 0
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), rows
        assert_close(outs[1], reference(x, weight, bias), torch.bfloat16, in_features)


@pytest.mark.skipif(not gemv_expected(torch.float32), reason="the AVX-512 GEMV kernel does not run here")
def test_a_prompts_logprobs_do_not_depend_on_its_steps_size(tmp_path):
    """The engine end to end, on a Llama whose MLP is wide enough (a down projection of K = 1,088, which oneDNN sums in
    two runs) that the GEMV's old single chain rounded otherwise: the logprobs of 64 prompt tokens computed in one
    64-token step (the GEMV) and in a 65-token step (oneDNN's matmul) are the same bits."""
    from torch_shift import LLM, SamplingParams
    from torch_shift.models.toy import tiny_llama_config, write_random_checkpoint

    model_dir = write_random_checkpoint(tmp_path / "model", tiny_llama_config(intermediate_size=1088,
                                                                              num_hidden_layers=2), init_std=0.05)
    llm = LLM(str(model_dir), dtype=torch.float32, compile=False, enable_prefix_caching=False, seed=0)
    try:
        n = GEMV_MAX_ROWS
        prompt = list(range(6, 7 + n))  # n + 1 tokens
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
        alone, longer = (llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].prompt_logprobs
                         for p in (prompt[:n], prompt))
        logprobs = [[sorted((t, lp.logprob) for t, lp in position.items()) for position in lps[1:n]]
                    for lps in (alone, longer)]
        assert logprobs[0] == logprobs[1]
    finally:
        llm.shutdown()
