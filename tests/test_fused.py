"""The one-pass CPU kernels for RMSNorm and rotary embeddings (torch_shift.models.fused) against the PyTorch
expressions they replace in eager models: bitwise, in float32 and bfloat16, for the shapes the models pass."""

from __future__ import annotations

import platform

import pytest
import torch

from torch_shift.config import RopeConfig
from torch_shift.kernels import compiler
from torch_shift.models import fused
from torch_shift.models.decoder import RMSNorm
from torch_shift.models.fused import _rotate_half
from torch_shift.models.rope import RotaryEmbedding

needs_kernels = pytest.mark.skipif(compiler() is None, reason="no C++ compiler for the CPU kernels")


def _norm_expression(x, weight, eps):
    return weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@needs_kernels
def test_both_kernel_libraries_build_against_the_installed_torch():
    """Where a compiler exists, both libraries build with this torch's headers. A failed build only warns (the
    engine keeps slower PyTorch paths) and the tests that need the operators skip, so without this test a torch
    whose headers need another C++ standard (2.14: C++20) would pass CI with half the kernels missing."""
    import warnings

    from torch_shift.kernels import cpu_kernels, cpu_ops

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the build's failure, with the compiler's error, as this test's
        assert cpu_kernels() is not None
        assert cpu_ops()


@needs_kernels
def test_the_libraries_build_together_and_one_that_fails_leaves_the_other(tmp_path, monkeypatch, caplog):
    """`_build` compiles every library's sources at once, a shared source once; a library whose source does not
    compile gets the compiler's error, cached so that later runs do not build it again, while the others are built
    and cached; a failure that may pass on another try (a timeout, a kill) is not cached."""
    import ctypes
    import logging

    import torch_shift.kernels as kernels_module

    sources = tmp_path / "sources"
    sources.mkdir()
    for header in kernels_module._HEADERS:
        (sources / header).write_text("")
    (sources / "shared.cpp").write_text('extern "C" int shared_value() { return 7; }\n')
    (sources / "broken.cpp").write_text("int broken( {\n")
    monkeypatch.setattr(kernels_module, "_LIBRARIES", {"libgood.so": ("shared.cpp",),
                                                       "libbad.so": ("shared.cpp", "broken.cpp")})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    compiled, timed_out = [], []
    compile_sources = kernels_module._compile

    def counted(cxx, files, *args, **kwargs):
        compiled.append(sorted(f.name for f in files))
        failures = compile_sources(cxx, files, *args, **kwargs)
        return {f: (kernels_module.BuildFailure("c++ ran past 300 s", lasting=False) if timed_out and failure else
                    failure) for f, failure in failures.items()}

    monkeypatch.setattr(kernels_module, "_compile", counted)

    built = kernels_module._build(sources)
    assert isinstance(built["libbad.so"], str) and "broken.cpp" in built["libbad.so"]
    assert ctypes.CDLL(str(built["libgood.so"])).shared_value() == 7
    assert compiled == [["broken.cpp", "shared.cpp"]] * 2  # -march=native, then without it
    good_built_at = built["libgood.so"].stat().st_mtime_ns

    compiled.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torch_shift.kernels"):
        again = kernels_module._build(sources)
    assert again["libgood.so"] == built["libgood.so"] and again["libgood.so"].stat().st_mtime_ns == good_built_at
    assert built["libbad.so"] in again["libbad.so"] and "delete it to build again" in again["libbad.so"]
    assert compiled == [] and not caplog.records

    (error_file,) = (tmp_path / "cache").rglob("libbad.so.error")
    error_file.unlink()
    timed_out.append(True)
    for _ in range(2):  # not cached: built again
        compiled.clear()
        assert kernels_module._build(sources)["libbad.so"] == "c++ ran past 300 s"
        assert compiled == [["broken.cpp", "shared.cpp"]] * 2
        assert not list((tmp_path / "cache").rglob("libbad.so.error"))


@needs_kernels
def test_the_sum_order_of_pytorch_is_found_on_x86():
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert fused._sum_lanes() is not None


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bitwise_the_expression(dtype):
    if fused._sum_lanes() is None:
        pytest.skip("no vector width reproduces PyTorch's sum here")
    g = torch.Generator().manual_seed(0)
    for dim in (1, 3, 8, 15, 16, 17, 32, 63, 64, 100, 192, 1000, 1024, 2048, 4096, 5120, 16384):
        for rows in (1, 2, 7, 64):
            x = (torch.randn(rows, dim, generator=g) * torch.rand(rows, 1, generator=g) * 10).to(dtype)
            weight = torch.randn(dim, generator=g).to(dtype)
            got = fused.rms_norm(x, weight, 1e-6)
            assert got is not None and torch.equal(got, _norm_expression(x, weight, 1e-6)), (dim, rows)
            # with the residual add before it, one pass: the same bits as the add, then the norm
            residual = (torch.randn(rows, dim, generator=g) * 10).to(dtype)
            total = x + residual
            got = fused.add_rms_norm(x, residual, weight, 1e-6)
            assert got is not None and torch.equal(got[1], total), (dim, rows)
            assert torch.equal(got[0], _norm_expression(total, weight, 1e-6)), (dim, rows)
    # the add's rounding where the sums are NaN, infinite, denormal or zero (bfloat16 rounds those vectors apart)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-39, -3e-40, 0.0, -0.0, 2e-38])
    for rows in (1, 5):
        x = (torch.randn(rows, 64, generator=g) * 1e-38).to(dtype)
        x.view(-1)[::7] = special.to(dtype)[torch.arange(len(x.view(-1)[::7])) % len(special)]
        residual = torch.zeros_like(x)
        residual.view(-1)[3::11] = -x.view(-1)[3::11]
        weight = torch.randn(64, generator=g).to(dtype)
        got = fused.add_rms_norm(x, residual, weight, 1e-6)
        total = x + residual
        torch.testing.assert_close(got[1], total, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got[0], _norm_expression(total, weight, 1e-6), rtol=0, atol=0, equal_nan=True)
    # a q/k norm: [tokens, heads, head_dim] viewed out of a wider qkv row
    qkv = torch.randn(9, 24 * 32, generator=g).to(dtype)
    q = qkv[:, 64:64 + 4 * 32].view(9, 4, 32)
    weight = torch.randn(32, generator=g).to(dtype)
    assert torch.equal(fused.rms_norm(q, weight, 1e-5), _norm_expression(q, weight, 1e-5))
    # the module takes the kernel in eager mode and gives the same result
    module = RMSNorm(192, 1e-5).to(dtype)
    module.weight.data = torch.randn(192, generator=g).to(dtype)
    x = torch.randn(5, 192, generator=g).to(dtype)
    with torch.no_grad():
        assert torch.equal(module(x), _norm_expression(x, module.weight, 1e-5))
        residual = torch.randn(5, 192, generator=g).to(dtype)
        normed, total = module(x, residual)
        assert torch.equal(total, x + residual) and torch.equal(normed, _norm_expression(total, module.weight, 1e-5))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 16, 6])  # halves of 16-float vectors, of 8, and the scalar loop
def test_rotary_is_bitwise_the_expression(dtype, head_dim):
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0), head_dim, 512)
    qkv = torch.randn(11, (8 + 2 * 2) * head_dim, generator=g).to(dtype)
    q = qkv[:, :8 * head_dim].view(11, 8, head_dim)  # strided views, as the model splits
    k = qkv[:, 8 * head_dim:10 * head_dim].view(11, 2, head_dim)
    positions = torch.tensor([0, 1, 2, 100, 511, 7, 7, 300, 64, 65, 3])
    got = fused.rotary(positions, q, k, rope.cos_sin)
    assert got is not None
    cos_sin = rope.cos_sin[:, positions].to(dtype).unsqueeze(2)
    cos, sin = cos_sin[0], cos_sin[1]
    assert torch.equal(got[0], q * cos + _rotate_half(q) * sin)
    assert torch.equal(got[1], k * cos + _rotate_half(k) * sin)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(rope(positions, q, k), got, strict=True))
    with pytest.raises(IndexError, match="rotary table"):
        fused.rotary(torch.tensor([512] * 11), q, k, rope.cos_sin)


@needs_kernels
def test_the_kernels_step_aside_where_they_do_not_apply():
    x = torch.randn(3, 16)
    assert fused.rms_norm(x.half(), torch.ones(16).half(), 1e-6) is None  # float16: the expression
    assert fused.rms_norm(x.requires_grad_(), torch.ones(16), 1e-6) is None  # autograd: the expression
    assert fused.rms_norm(torch.randn(16), torch.ones(16), 1e-6) is None  # one dimension
    assert fused.rms_norm(torch.randn(16, 3).t(), torch.ones(16), 1e-6) is None  # last dimension strided
    y, w = torch.randn(3, 16), torch.ones(16)
    assert fused.add_rms_norm(y.half(), y.half(), w.half(), 1e-6) is None  # float16
    assert fused.add_rms_norm(y, y.bfloat16(), w, 1e-6) is None  # dtypes differ
    assert fused.add_rms_norm(y, torch.randn(1, 16), w, 1e-6) is None  # a broadcast residual
    assert fused.add_rms_norm(torch.randn(16, 3).t(), y, w, 1e-6) is None  # not contiguous
    q = torch.randn(2, 4, 16)
    assert fused.rotary(torch.tensor([0, 1]), q, q.half(), torch.randn(2, 8, 16)) is None  # dtypes differ
    assert fused.rotary(torch.tensor([0, 1]), q, q, torch.randn(2, 8, 16).double()) is None  # table not float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_graphs_keep_the_eager_operators(dtype):
    """Under torch.compile on the CPU, RMSNorm, rotary and `silu(gate) * up` are each one operator the graph keeps
    opaque, which runs the eager computation: inductor's fused code rounded differently, and a compiled engine
    mixes compiled steps with the C++ decoder's, which rounds as the eager forward."""
    g = torch.Generator().manual_seed(5)
    x, weight = torch.randn(5, 64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    q, k = torch.randn(5, 4, 16, generator=g).to(dtype), torch.randn(5, 2, 16, generator=g).to(dtype)
    positions, cos_sin = torch.tensor([0, 3, 4, 9, 2]), torch.randn(2, 12, 16, generator=g)
    gate_up = torch.randn(5, 2 * 40, generator=g).to(dtype)

    def step(x, weight, q, k, gate_up):
        return (fused.rms_norm(x, weight, 1e-6), fused.rotary(positions, q, k, cos_sin), fused.silu_mul(gate_up),
                fused.add_rms_norm(x, x * 2, weight, 1e-6))

    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module

    compiled = torch.compile(step, backend=backend, fullgraph=True)(x, weight, q, k, gate_up)
    targets = {node.target for node in graphs[0].graph.nodes}
    assert {torch.ops.torch_shift.cpu_rms_norm.default, torch.ops.torch_shift.cpu_rotary.default,
            torch.ops.torch_shift.cpu_silu_mul.default, torch.ops.torch_shift.cpu_add_rms_norm.default} <= targets
    eager = step(x, weight, q, k, gate_up)
    assert torch.equal(compiled[0], eager[0] if eager[0] is not None else fused.rms_norm_expression(x, weight, 1e-6))
    expected_rotary = eager[1] if eager[1] is not None else fused.rotary_expression(positions, q, k, cos_sin)
    assert all(torch.equal(a, b) for a, b in zip(compiled[1], expected_rotary))
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(compiled[2], torch.nn.functional.silu(gate) * up)
    total = x + x * 2
    assert torch.equal(compiled[3][1], total)
    assert torch.equal(compiled[3][0], fused.rms_norm_expression(total, weight, 1e-6))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_silu_operator_is_pytorchs_at_every_thread_count(dtype):
    """`torch_shift::cpu_silu_mul` runs the C++ decoder's loop in one pass where that is bitwise PyTorch's here, its
    parts (TensorIterator's split above 32768 elements) on torch's threads: a prompt's rows and a few, on one
    thread and two, as `F.silu(gate) * up`; NaN and infinities included (a NaN's bits are not compared: PyTorch's
    vectorised and scalar loops write different ones)."""
    g = torch.Generator().manual_seed(6)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for tokens, intermediate in ((512, 2816), (3, 352), (37, 1000), (1, 2816), (0, 352)):
                gate_up = (torch.randn(tokens, 2 * intermediate, generator=g) * 4).to(dtype)
                # denormals and zeros too: the AVX512-BF16 rounding takes a vector holding one the slow way
                special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-39, -3e-40, 0.0, -0.0,
                                        2e-38], dtype=dtype)
                gate_up.view(-1)[::97] = special[torch.arange(len(gate_up.view(-1)[::97])) % len(special)]
                gate, up = gate_up.chunk(2, dim=-1)
                out = torch.ops.torch_shift.cpu_silu_mul(gate_up)
                expected = torch.nn.functional.silu(gate) * up
                torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True,
                                           msg=f"{count} threads, {tokens} x {intermediate}")
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_operators_cpp_implementations_are_the_python_ones(dtype):
    """Once registered (as a compiled CPU forward does), the four operators run C++ on the CPU (kernels/cpu_ops.cpp):
    the same bits as their Python implementations, which they call where their kernels do not apply."""
    from torch_shift.kernels import cpu_ops

    if not cpu_ops() or not fused.register_native_operators():
        pytest.skip("the C++ operator library does not build here")
    for name in ("cpu_rms_norm", "cpu_add_rms_norm", "cpu_rotary", "cpu_silu_mul"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torch_shift::{name}", "CPU"), name
    ops = torch.ops.torch_shift
    g = torch.Generator().manual_seed(8)
    for tokens in (0, 1, 7, 300):
        x = torch.randn(tokens, 1024 + 64, generator=g).to(dtype)[:, 64:]  # rows strided
        weight = torch.randn(1024, generator=g).to(dtype)
        assert torch.equal(ops.cpu_rms_norm(x, weight, 1e-5), ops.cpu_rms_norm_python(x, weight, 1e-5))
        residual = torch.randn(tokens, 1024, generator=g).to(dtype)
        for rows in (x, x.contiguous()):  # strided rows take the Python implementation, contiguous ones C++
            total = rows + residual
            normed, got_total = ops.cpu_add_rms_norm(rows, residual, weight, 1e-5)
            assert torch.equal(got_total, total)
            assert torch.equal(normed, fused.rms_norm_expression(total, weight, 1e-5))
        qkv = torch.randn(tokens, 24 * 64, generator=g).to(dtype)
        q, k = qkv[:, :16 * 64].view(tokens, 16, 64), qkv[:, 16 * 64:20 * 64].view(tokens, 4, 64)
        assert torch.equal(ops.cpu_rms_norm(q, weight[:64], 1e-5), ops.cpu_rms_norm_python(q, weight[:64], 1e-5))
        positions, cos_sin = torch.randint(0, 500, (tokens,), generator=g), torch.randn(2, 500, 64, generator=g)
        for a, b in zip(ops.cpu_rotary(positions, q, k, cos_sin), ops.cpu_rotary_python(positions, q, k, cos_sin)):
            assert torch.equal(a, b)
        gate_up = (torch.randn(tokens, 2 * 352, generator=g) * 4).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        for _ in range(2):  # the first call finds the vector width in Python, the second runs C++
            assert torch.equal(ops.cpu_silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
    if tokens:
        with pytest.raises(IndexError, match="rotary table"):
            ops.cpu_rotary(positions + 500, q, k, cos_sin)
    # where the kernels do not apply, the Python implementations' expressions
    half = torch.randn(3, 64, generator=g).half()
    assert torch.equal(ops.cpu_rms_norm(half, torch.ones(64).half(), 1e-6),
                       fused.rms_norm_expression(half, torch.ones(64).half(), 1e-6))
    q16 = torch.randn(3, 2, 16, generator=g)
    for a, b in zip(ops.cpu_rotary(torch.tensor([0, 1, 2]), q16, q16.half(), torch.randn(2, 4, 16, generator=g)),
                    fused.rotary_expression(torch.tensor([0, 1, 2]), q16, q16.half(), torch.randn(2, 4, 16,
                                                                                              generator=g))):
        assert a.shape == b.shape and a.dtype == b.dtype


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torchs(dtype):
    """The first of equal maxima, the first NaN where a row has one, the first of a row of -inf; any width and row
    stride (logits sliced to the vocabulary)."""
    g = torch.Generator().manual_seed(2)
    for cols in (1, 5, 16, 17, 100, 3072, 8195):
        x = torch.randn(9, cols + 3, generator=g).to(dtype)[:, :cols]
        x[1] = x[1].round()  # many ties
        x[2] = float("-inf")
        x[3, cols // 2] = float("nan")
        x[4, -1] = float("nan")
        x[5] = 0.0
        x[6, :: max(cols // 3, 1)] = 1e4  # equal maxima in several lanes
        assert torch.equal(fused.argmax(x), x.argmax(dim=-1)), cols
        assert fused.argmax_list(x) == x.argmax(dim=-1).tolist(), cols


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("march", [None, pytest.param("x86-64-v3", marks=pytest.mark.skipif(
    platform.machine() != "x86_64", reason="an x86 instruction set"))])
def test_the_kernels_build_and_agree_without_native_flags(tmp_path, march):
    """Where the compiler does not know this CPU (-march=native fails), the library is built for the baseline
    instruction set, its AVX-512 paths chosen at run time: it must build and answer as the native build does
    (bitwise where no multiply-add contraction can differ: RMSNorm and argmax; attention against the reference).
    Built for x86-64-v3, it is what -march=native makes on a CPU with AVX2 but not AVX-512: each 16-float vector
    two registers."""
    from pathlib import Path

    from test_attention_backends import TOLERANCE, make_step

    import torch_shift.kernels as kernels_module
    from torch_shift.attention.cpu import CpuBackend
    from torch_shift.kernels import CpuKernels, cpu_kernels
    from torch_shift.models.linear import PackedWeight, blocked_layout, packing_supported

    sources = [Path(kernels_module.__file__).parent / name for name in kernels_module._SOURCES]
    error = kernels_module._compile_and_link(compiler(), sources, tmp_path / "libbaseline.so", native=False,
                                             extra_flags=(f"-march={march}",) if march else ())
    assert error is None, error
    baseline, native = CpuKernels(tmp_path / "libbaseline.so"), cpu_kernels()
    assert baseline.packed_gemv_dtypes == native.packed_gemv_dtypes
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 300, generator=g).to(dtype)
        weight = torch.randn(300, generator=g).to(dtype)
        lanes = fused._sum_lanes() or 8
        norms = [fused._rms_norm(kernels, x, weight, 1e-6, lanes) for kernels in (baseline, native)]
        assert torch.equal(norms[0], norms[1])
        out = [torch.empty(5, dtype=torch.int64) for _ in range(2)]
        for kernels, o in zip((baseline, native), out, strict=True):
            assert kernels.argmax(fused._DTYPE_CODES[dtype], x.data_ptr(), 5, 300, 300, o.data_ptr()) == 0
        assert torch.equal(out[0], out[1])
        # paged attention (decodes, a check, a prompt of 70 queries: in bf16 the dot-product tiles) against the
        # float64 reference; the two builds round differently where the native one contracts into multiply-adds
        cache, batch, q, k, v, reference = make_step([(0, 1), (90, 1), (40, 9), (5, 70)], 16, 4, 64, 16, dtype,
                                                     num_layers=1)
        for kernels in (baseline, native):
            out = CpuBackend(kernels).build(batch, cache)(0, q, k, v)
            assert (out.double() - reference).abs().max() < TOLERANCE[dtype] * max(1.0, reference.abs().max())
        # the GEMV on weights in oneDNN's layout (on AMX, bf16 on the tile unit): the same bits
        if not packing_supported(torch.device("cpu"), dtype) or blocked_layout(dtype):
            continue
        packed = PackedWeight(torch.randn(128, 256, generator=g).to(dtype), blocked=False)
        if packed.gemv is not None:
            rows = torch.randn(7, 256, generator=g).to(dtype)
            out = [torch.empty(7, 128, dtype=dtype) for _ in range(2)]
            for kernels, o in zip((baseline, native), out, strict=True):
                assert kernels.packed_gemv(packed.gemv_code, rows.data_ptr(), 256, 7, packed.address, 128, 256, None,
                                           o.data_ptr(), 128) == 0
            assert torch.equal(out[0], out[1])
            assert baseline.gemv_amx(-1) == native.gemv_amx(-1)


@needs_kernels
@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86 instruction set")
def test_the_operators_compile_for_avx2_cpus(tmp_path):
    """The operators' library's own sources (the test above builds and runs the others) for x86-64-v3, as
    -march=native makes them on a CPU with AVX2 but not AVX-512: each 16-float vector two registers (a register
    constraint on one vector did not compile there, and would have left such CPUs without the kernels)."""
    import subprocess
    from pathlib import Path

    import torch_shift.kernels as kernels_module

    directory = Path(kernels_module.__file__).parent
    sources = sorted(set(kernels_module._OPS_SOURCES) - set(kernels_module._SOURCES))
    flags = [*kernels_module._compile_flags(native=False), "-march=x86-64-v3"]
    compiles = [subprocess.Popen([compiler(), *flags, "-c", str(directory / name), "-o", str(tmp_path / f"{name}.o")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for name in sources]
    stderr = [process.communicate(timeout=600)[1] for process in compiles]
    errors = {name: err[-2000:] for name, process, err in zip(sources, compiles, stderr, strict=True)
              if process.returncode != 0}
    assert not errors, errors


@needs_kernels
@pytest.mark.parametrize("blocked,dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)])
def test_a_packed_gate_up_projection_in_chunks_of_rows_is_the_whole_one(blocked, dtype, monkeypatch):
    """fused.gate_up_silu runs a packed float32 projection's rows in chunks (GATE_UP_CHUNK_BYTES): the bits of the
    whole projection followed by `silu(gate) * up`, eagerly and through its C++ operator (what a compiled forward
    runs), in oneDNN's layout and in the AVX2 kernel's blocks; no chunk is a GEMV's few rows. bfloat16 packed for AMX
    is chunked too (its rows round by the matmul's row count): the bits of each chunk's projection and activation."""
    from torch_shift.kernels import cpu_ops
    from torch_shift.models.linear import AMX_BF16_CODE, GEMV_MAX_ROWS, Linear, PackedWeight, packing_supported

    g = torch.Generator().manual_seed(9)
    # K = 1024: oneDNN sums each row in two runs of k-steps; chunks of at least chunk_rows / 2 > GEMV_MAX_ROWS
    hidden, intermediate, chunk_rows = 1024, 64, 4 * GEMV_MAX_ROWS
    proj = Linear(hidden, 2 * intermediate, bias=False)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(proj.weight.shape, generator=g) * 0.1)
    proj = proj.to(dtype)
    if not packing_supported(torch.device("cpu"), dtype):
        pytest.skip(f"{dtype} is not packed here")
    try:
        proj.packed = PackedWeight(proj.weight.detach(), blocked=blocked)
    except ValueError as e:
        pytest.skip(str(e))
    if dtype == torch.bfloat16 and (proj.packed.blocked or proj.packed.gemv_code != AMX_BF16_CODE):
        pytest.skip("bfloat16 is chunked where oneDNN packs it for AMX")
    monkeypatch.setattr(fused, "GATE_UP_CHUNK_BYTES", chunk_rows * 2 * intermediate * proj.weight.element_size())
    monkeypatch.setattr(fused, "GATE_UP_MIN_CHUNK_ROWS", chunk_rows)
    native = cpu_ops() and fused.register_native_operators()
    assert not native or torch._C._dispatch_has_kernel_for_dispatch_key("torch_shift::cpu_gate_up_silu", "CPU")
    # at most 32768 elements: PyTorch's silu in one part, as the chunks'; 257 and 300 tokens: two chunks of 129 or 150
    for tokens in (1, 16, 17, 65, 256, 257, 300, 512):
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        whole = fused.silu_mul(proj(x))
        if dtype == torch.bfloat16:  # chunks of equal rows (or one more)
            count = -(-tokens // chunk_rows)
            sizes = [tokens // count + (i < tokens % count) for i in range(count)]
            whole = torch.cat([fused.silu_mul(proj(part)) for part in x.split(sizes)])
        assert torch.equal(fused.gate_up_silu(proj, x), whole), tokens
        if native:
            assert torch.equal(torch.ops.torch_shift.cpu_gate_up_silu(x, proj.packed.handle, 2 * intermediate,
                                                                      chunk_rows), whole), tokens
