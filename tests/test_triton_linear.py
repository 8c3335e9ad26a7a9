"""The GPU's few-row linears in Triton (torch_shift.kernels.triton_linear) against a float64 reference, and the
choice between them and cuBLAS: on a GPU natively, on the CPU in Triton's interpreter (a subprocess with
TRITON_INTERPRET=1, set before triton is imported). The engine with these kernels against transformers on a GPU
is in tests/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

# (rows, out_features, in_features): rows padded to 1, 2, 4 and 8; inputs a multiple of every tile's BLOCK_K, and not
SHAPES = [(1, 40, 1024), (2, 24, 300), (3, 33, 512), (5, 16, 2048), (8, 20, 260), (1, 7, 700)]


def check_tiles(device: str, dtypes: list[torch.dtype]) -> None:
    """Every candidate tile for each shape, with and without a bias, on a contiguous weight and on a column slice
    of a wider one (a view, as a tensor-parallel shard can be), against float64."""
    from torch_shift.kernels import triton_linear

    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for rows, out_features, in_features in SHAPES:
            wide = torch.randn(out_features, in_features + 24, generator=gen)
            x = torch.randn(rows, in_features, generator=gen)
            bias = torch.randn(out_features, generator=gen)
            tiles = triton_linear.tiles_for(triton_linear.padded_rows(rows), in_features)
            assert tiles, (rows, in_features)
            for weight in (wide[:, :in_features].contiguous(), wide[:, 24:]):
                ref = x.double() @ weight.double().T
                w, xs, b = (t.to(device, dtype) for t in (weight, x, bias))
                tol = 1e-4 if dtype == torch.float32 else 3e-2
                for tile in tiles:
                    for with_bias in (False, True):
                        out = triton_linear.run_tile(xs, w, b if with_bias else None, tile)
                        assert out.dtype == dtype and out.shape == (rows, out_features)
                        expected = ref + bias.double() if with_bias else ref
                        torch.testing.assert_close(out.double().cpu(), expected, rtol=tol, atol=tol * 8,
                                                   msg=lambda m: f"{dtype} {rows}x{in_features} {tile}: {m}")


def check_choice(device: str) -> None:
    """`linear` runs the tile timed fastest for the shape (once timed, kept), cuBLAS where that was fastest or
    the rows are too many, on x of any leading shape."""
    import torch.nn.functional as F

    from torch_shift.kernels import triton_linear

    timed = []

    def fake_timings(rows, out_features, in_features, dtype, device):
        timed.append((rows, out_features, in_features))
        tiles = triton_linear.tiles_for(rows, in_features)
        # cuBLAS wins for 40 outputs; elsewhere the last candidate
        return {None: 1.0, **{t: 2.0 if out_features == 40 else 0.5 + i for i, t in enumerate(tiles[::-1])}}

    launched = []
    run_tile = triton_linear.run_tile

    def spy(x, weight, bias, tile):
        launched.append(tile)
        return run_tile(x, weight, bias, tile)

    saved = triton_linear.time_candidates, triton_linear.run_tile, dict(triton_linear._choices)
    triton_linear.time_candidates, triton_linear.run_tile = fake_timings, spy
    try:
        gen = torch.Generator().manual_seed(1)
        weight = torch.randn(24, 512, generator=gen).to(device)
        for shape in ((1, 512), (1, 3, 512), (2, 2, 512), (5, 512)):
            x = torch.randn(*shape, generator=gen).to(device)
            torch.testing.assert_close(triton_linear.linear(x, weight, None), F.linear(x, weight), rtol=1e-4,
                                       atol=1e-4)
        assert timed == [(1, 24, 512), (4, 24, 512), (8, 24, 512)], timed  # rows 3 and 4 padded to 4, 5 to 8
        assert launched == [triton_linear.tiles_for(rows, 512)[-1] for rows in (1, 4, 4, 8)], launched
        launched.clear()
        cublas = torch.randn(40, 512, generator=gen).to(device)
        x = torch.randn(1, 512, generator=gen).to(device)
        torch.testing.assert_close(triton_linear.linear(x, cublas, None), F.linear(x, cublas))
        many = torch.randn(triton_linear.MAX_ROWS + 1, 512, generator=gen).to(device)
        torch.testing.assert_close(triton_linear.linear(many, weight, None), F.linear(many, weight))
        assert launched == [] and len(timed) == 4, (launched, timed)
    finally:
        triton_linear.time_candidates, triton_linear.run_tile = saved[:2]
        triton_linear._choices.clear()
        triton_linear._choices.update(saved[2])


def test_tiles_match_the_reference():
    if torch.cuda.is_available():
        check_tiles("cuda", [torch.float32, torch.bfloat16, torch.float16])
    else:
        from test_triton_attention import _interpreted

        _interpreted("import torch, test_triton_linear as t; t.check_tiles('cpu', [torch.float32, torch.bfloat16])")


def test_linear_runs_the_kernel_timed_fastest():
    if torch.cuda.is_available():
        check_choice("cuda")
    else:
        from test_triton_attention import _interpreted

        _interpreted("import test_triton_linear as t; t.check_choice('cpu')")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_timing_on_the_gpu_keeps_one_kernel_per_shape():
    from torch_shift.kernels import triton_linear

    timings = triton_linear.time_candidates(1, 2048, 2048, torch.bfloat16, torch.device("cuda"))
    assert None in timings and len(timings) == 1 + len(triton_linear.tiles_for(1, 2048))
    assert all(0 < seconds < 1e-3 for seconds in timings.values()), timings
    weight = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    first = triton_linear.linear(x, weight, None)
    key = (weight.device, torch.bfloat16, 1, 2048, 2048)
    assert key in triton_linear._choices
    torch.testing.assert_close(first, x @ weight.T, rtol=2e-2, atol=2e-2)
    assert torch.equal(triton_linear.linear(x, weight, None), first)
