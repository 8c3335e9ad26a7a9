"""Every attention backend against a float64 reference over the same paged KV cache: decode tokens and
prompt chunks in one step, GQA ratios, head dimensions, block sizes, KV widths, sliding windows and dtypes;
and the paged CPU kernel's results independent of the block size and of the other runs of the step."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from torch_shift.attention import attention_backend, canonical_backend_name
from torch_shift.attention.backend import AttentionBatch
from torch_shift.kernels import compiler, cpu_kernels
from torch_shift.kv.cache import KVCache

# where a compiler exists the kernels must build (cpu_kernels() None is then a failure, not a skip)
needs_kernels = pytest.mark.skipif(compiler() is None, reason="no C++ compiler for the CPU kernels")

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def make_step(runs, num_heads, num_kv_heads, head_dim, block_size, dtype, sliding_window=None, num_layers=3,
              seed=0, shuffle=True, sinks=None, step_window=None):
    """A KV cache whose cached positions hold random K/V, and one step of `runs` ((cached tokens, new tokens),
    decodes first) with random q/k/v. Returns (cache, batch, q, k, v, reference per layer). The reference
    attends within `sliding_window` and with `sinks` ([heads] logits beside the keys, as transformers' eager
    GPT-OSS attention); the step's batch carries `sliding_window`, or `step_window` when that is given."""
    g = torch.Generator().manual_seed(seed)  # the contents: the same whatever the block size
    contexts = [c + n for c, n in runs]
    max_blocks = max(-(-c // block_size) for c in contexts)
    num_blocks = len(runs) * max_blocks + 3
    cache = KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    full_k = [torch.randn(c, num_kv_heads, head_dim, generator=g).to(dtype) for c in contexts]
    full_v = [torch.randn(c, num_kv_heads, head_dim, generator=g).to(dtype) for c in contexts]
    num_tokens = sum(n for _, n in runs)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    order = (torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)) if shuffle
             else torch.arange(num_blocks))
    table = order[: len(runs) * max_blocks].view(len(runs), max_blocks).to(torch.int32).numpy().copy()
    for layer in range(num_layers):
        for r, (cached, _) in enumerate(runs):
            pos = torch.arange(cached)
            slots = torch.from_numpy(table[r]).long()[pos // block_size] * block_size + pos % block_size
            cache.write(layer, slots, full_k[r][:cached], full_v[r][:cached])
    starts = np.cumsum([0] + [n for _, n in runs])[:-1]
    slots, positions = [], []
    for r, (cached, n) in enumerate(runs):
        pos = np.arange(cached, cached + n)
        slots.append(table[r][pos // block_size].astype(np.int64) * block_size + pos % block_size)
        positions.append(pos)
    batch = AttentionBatch(
        num_decodes=sum(1 for _, n in runs if n == 1), query_start=starts.astype(np.int32),
        query_len=np.array([n for _, n in runs], np.int32), num_computed=np.array([c for c, _ in runs], np.int32),
        block_table=table, block_table_rows=np.arange(len(runs), dtype=np.int32), tokens_per_block=block_size,
        slot_mapping=torch.from_numpy(np.concatenate(slots)), positions=torch.from_numpy(np.concatenate(positions)),
        sliding_window=sliding_window if step_window is None else step_window)
    k = torch.cat([full_k[r][c:] for r, (c, _) in enumerate(runs)])
    v = torch.cat([full_v[r][c:] for r, (c, _) in enumerate(runs)])
    reference = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float64)
    group = num_heads // num_kv_heads
    for r, (cached, n) in enumerate(runs):
        kk = full_k[r].double().repeat_interleave(group, 1)
        vv = full_v[r].double().repeat_interleave(group, 1)
        qq = q[starts[r]: starts[r] + n].double()
        scores = torch.einsum("qhd,khd->hqk", qq, kk) / math.sqrt(head_dim)
        query_pos = torch.arange(cached, cached + n)[:, None]
        key_pos = torch.arange(cached + n)[None]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink_column = sinks.double()[:, None, None].expand(num_heads, n, 1)
            probs = torch.cat((scores, sink_column), dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        reference[starts[r]: starts[r] + n] = torch.einsum("hqk,khd->qhd", probs, vv)
    return cache, batch, q, k, v, reference


RUNS = [(0, 1), (37, 1), (200, 1), (0, 23), (45, 30), (5, 70)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 16), (4, 4, 64), (16, 2, 32), (6, 3, 16), (4, 1, 8),
                                                     (8, 8, 80)])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_cpu_kernel_matches_the_reference(dtype, heads, kv_heads, head_dim, block_size):
    for window in (None, 9):
        cache, batch, q, k, v, reference = make_step(RUNS, heads, kv_heads, head_dim, block_size, dtype, window)
        attention = attention_backend("cpu", torch.device("cpu"), dtype).build(batch, cache)
        for layer in range(cache.num_layers):
            out = attention(layer, q, k, v)
            assert out.dtype == dtype and out.shape == q.shape
            assert (out.double() - reference).abs().max() < TOLERANCE[dtype] * max(1.0, reference.abs().max())


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("cpu", marks=needs_kernels),
                                     pytest.param("flex", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sinks_and_a_layer_window_in_every_backend(backend, dtype):
    """GPT-OSS's attention: a sink logit per query head beside the keys, and a window that a layer passes
    (alternating windowed and full layers), different from the step's."""
    heads, kv_heads = 8, 2
    sinks = torch.linspace(-2.0, 3.0, heads)  # from negligible to absorbing most of a row's weight
    for step_window, layer_window, sink in [(None, 9, sinks), (None, None, sinks), (9, 300, None), (None, 9, None)]:
        cache, batch, q, k, v, reference = make_step(RUNS, heads, kv_heads, 16, 4, dtype, layer_window,
                                                     sinks=sink, step_window=step_window)
        attention = attention_backend(backend, torch.device("cpu"), dtype).build(batch, cache)
        if backend == "flex" and sink is not None:
            with pytest.raises(ValueError, match="sinks"):
                attention(0, q, k, v, sink, layer_window)
            continue
        out = attention(0, q, k, v, sink, layer_window)
        assert out.dtype == dtype and out.shape == q.shape
        assert (out.double() - reference).abs().max() < TOLERANCE[dtype] * 4 * max(1.0, reference.abs().max())


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("cpu", marks=needs_kernels)])
def test_backends_write_the_step_keys_where_the_reference_reads_them(backend):
    cache, batch, q, k, v, reference = make_step(RUNS, 8, 2, 16, 4, torch.float32)
    attention = attention_backend(backend, torch.device("cpu"), torch.float32).build(batch, cache)
    out = attention(1, q, k, v)
    assert (out.double() - reference).abs().max() < 1e-5
    # the step's own keys and values are in their slots for the next step
    bs = cache.block_size
    blocks, offsets = batch.slot_mapping // bs, batch.slot_mapping % bs
    assert torch.equal(cache.k[1][blocks, offsets], k) and torch.equal(cache.v[1][blocks, offsets], v)


@needs_kernels
def test_cpu_kernel_rounds_the_same_whatever_the_block_size_and_the_other_runs():
    """A row's chunks of keys are aligned to its positions: the result of a run is bitwise the same with
    blocks of 4 to 64 tokens, through a KV width view, and alone or beside other runs of the step."""
    runs = [(100, 1), (0, 40), (57, 9)]
    cpu = attention_backend("cpu", torch.device("cpu"), torch.float32)
    outputs = []
    for block_size in (4, 16, 32, 64):
        cache, batch, q, k, v, _ = make_step(runs, 8, 2, 64, block_size, torch.float32, seed=3)
        outputs.append(cpu.build(batch, cache)(0, q, k, v))
    for other in outputs[1:]:
        assert torch.equal(outputs[0], other)

    # the same step over a pool of twice the heads viewed at KV width 2 (blocks of 2 x 8 tokens)
    cache, batch, q, k, v, _ = make_step(runs, 8, 2, 64, 16, torch.float32, seed=3)
    wide = KVCache(cache.num_layers, cache.num_blocks, 8, 4, 64, torch.float32).view(2)
    assert (wide.block_size, wide.num_kv_heads) == (16, 2)
    wide.k_all.copy_(cache.k_all)
    wide.v_all.copy_(cache.v_all)
    assert torch.equal(cpu.build(batch, wide)(0, q, k, v), outputs[0])

    # run 2 alone (its keys already written by the step above)
    rows = slice(int(batch.query_start[2]), int(batch.query_start[2] + batch.query_len[2]))
    alone = AttentionBatch(num_decodes=0, query_start=np.zeros(1, np.int32), query_len=batch.query_len[2:],
                           num_computed=batch.num_computed[2:], block_table=batch.block_table,
                           block_table_rows=batch.block_table_rows[2:], tokens_per_block=16,
                           slot_mapping=batch.slot_mapping[rows], positions=batch.positions[rows], sliding_window=None)
    assert torch.equal(cpu.build(alone, cache)(0, q[rows], k[rows], v[rows]), outputs[0][rows])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (8, 8), (8, 2), (12, 2), (10, 2)])
def test_cpu_kernel_rounds_a_check_row_as_a_decode_row(dtype, heads, kv_heads):
    """A run of fewer than 64 queries (the check of proposed tokens) rounds each row bitwise as a decode step at
    that position does, whatever the group size: greedy output is the same with and without speculation."""
    cached, n = 150, 17
    cpu = attention_backend("cpu", torch.device("cpu"), dtype)
    cache, batch, q, k, v, _ = make_step([(cached, n)], heads, kv_heads, 32, 16, dtype, seed=5)
    check = cpu.build(batch, cache)(0, q, k, v)
    for i in range(n):
        decode = AttentionBatch(num_decodes=1, query_start=np.zeros(1, np.int32), query_len=np.ones(1, np.int32),
                                num_computed=np.array([cached + i], np.int32), block_table=batch.block_table,
                                block_table_rows=batch.block_table_rows, tokens_per_block=16,
                                slot_mapping=batch.slot_mapping[i:i + 1], positions=batch.positions[i:i + 1],
                                sliding_window=None)
        assert torch.equal(cpu.build(decode, cache)(0, q[i:i + 1], k[i:i + 1], v[i:i + 1]), check[i:i + 1]), i


@needs_kernels
def test_cpu_kernel_uses_every_thread_and_answers_the_same():
    cache, batch, q, k, v, _ = make_step([(300, 1)] * 9 + [(20, 100)], 16, 4, 64, 16, torch.float32)
    attention = attention_backend("cpu", torch.device("cpu"), torch.float32).build(batch, cache)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention(0, q, k, v)
        torch.set_num_threads(2)
        two = attention(0, q, k, v)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_backend_names():
    assert canonical_backend_name("CPU_ATTN") == "cpu"
    assert canonical_backend_name("TORCH_SDPA") == "sdpa"
    assert canonical_backend_name("Flex_Attention") == "flex"
    with pytest.raises(ValueError, match="attention_backend"):
        canonical_backend_name("flash")
    with pytest.raises(TypeError):
        canonical_backend_name(3)
    with pytest.raises(ValueError, match="CPU"):
        attention_backend("cpu", torch.device("meta"), torch.float32)
    auto = attention_backend("auto", torch.device("cpu"), torch.float32)
    assert auto.name == ("cpu" if cpu_kernels() is not None else "sdpa")


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 4, 64), (8, 2, 128), (8, 8, 32), (8, 1, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_kernel_bf16_prompt_tiles_match_the_reference(heads, kv_heads, head_dim, block_size):
    """Runs of 64 queries or more in bfloat16 take the AVX512-BF16 dot-product tiles where the CPU has them
    (probabilities rounded to bfloat16): chunks not aligned to the tiles, rows past a chunk, odd key counts,
    windows and sinks, against the float64 reference: within twice the rounding of the exact result to bf16."""
    runs = [(0, 1), (0, 200), (60, 100), (130, 64), (3, 65), (37, 1)]
    for window, sinks in [(None, None), (50, None), (None, torch.linspace(-2.0, 3.0, heads))]:
        cache, batch, q, k, v, reference = make_step(runs, heads, kv_heads, head_dim, block_size, torch.bfloat16,
                                                     window, sinks=sinks, num_layers=1)
        out = attention_backend("cpu", torch.device("cpu"), torch.bfloat16).build(batch, cache)(0, q, k, v, sinks)
        error = (out.double() - reference).abs().max()
        rounding = (reference.bfloat16().double() - reference).abs().max()  # the exact result stored in bf16
        assert error < 2 * rounding, (window, sinks is not None, error, rounding)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 4, 64), (8, 2, 128), (8, 8, 32), (12, 2, 64)])
def test_cpu_kernel_bf16_prompt_tiles_on_amx(heads, kv_heads, head_dim):
    """On a CPU with AMX the bfloat16 prompt tiles run on the tile unit, 16 rows at a time (the last block of a KV
    head's rows shorter): against the float64 reference as the dot products are, within a unit in the last place
    of theirs (which the kernel runs when told to; the tile unit rounds a pair's two products differently in a few
    sums), and a run's bits the same whatever the block size and the other runs of the step. Skipped where the CPU
    has no AMX."""
    kernels = cpu_kernels()
    if not kernels.attention_amx(-1):
        pytest.skip("this CPU has no AMX (or Linux did not grant its tile state)")
    runs = [(0, 1), (0, 200), (60, 100), (130, 64), (3, 65), (37, 1), (0, 67)]
    attention = attention_backend("cpu", torch.device("cpu"), torch.bfloat16)
    for window, sinks in [(None, None), (50, None), (None, torch.linspace(-2.0, 3.0, heads))]:
        cache, batch, q, k, v, reference = make_step(runs, heads, kv_heads, head_dim, 16, torch.bfloat16, window,
                                                     sinks=sinks, num_layers=1)
        step = attention.build(batch, cache)
        try:
            amx = step(0, q, k, v, sinks)
            assert kernels.attention_amx(0) == 0
            dot = step(0, q, k, v, sinks)
        finally:
            kernels.attention_amx(1)
        rounding = (reference.bfloat16().double() - reference).abs().max()
        assert (amx.double() - reference).abs().max() < 2 * rounding, (window, sinks is not None)
        torch.testing.assert_close(amx.float(), dot.float(), rtol=2 ** -7, atol=2 ** -9)
        assert (amx != dot).float().mean() < 0.01
        # blocks of 32 tokens: the same bits
        cache, batch, q, k, v, _ = make_step(runs, heads, kv_heads, head_dim, 32, torch.bfloat16, window,
                                             sinks=sinks, num_layers=1)
        assert torch.equal(attention.build(batch, cache)(0, q, k, v, sinks), amx)
    # run (60, 100) alone: the same bits as beside the others
    cache, batch, q, k, v, _ = make_step(runs, heads, kv_heads, head_dim, 16, torch.bfloat16, num_layers=1)
    together = attention.build(batch, cache)(0, q, k, v)
    rows = slice(int(batch.query_start[2]), int(batch.query_start[2] + batch.query_len[2]))
    alone = AttentionBatch(num_decodes=0, query_start=np.zeros(1, np.int32), query_len=batch.query_len[2:3],
                           num_computed=batch.num_computed[2:3], block_table=batch.block_table,
                           block_table_rows=batch.block_table_rows[2:3], tokens_per_block=16,
                           slot_mapping=batch.slot_mapping[rows], positions=batch.positions[rows], sliding_window=None)
    assert torch.equal(attention.build(alone, cache)(0, q[rows], k[rows], v[rows]), together[rows])


@needs_kernels
def test_cpu_kernel_on_one_thread_hands_its_items_to_the_decode_pool_with_the_same_bits():
    """On one thread (a pooled step's) the kernel's work items run on the decode pool's threads where the pool is
    armed: each row as one thread alone computes it, decodes and prompt runs, float32 and bfloat16, with windows and
    sinks."""
    kernels = cpu_kernels()
    arm, stop = kernels.library.ts_gemv_pool_arm, kernels.library.ts_gemv_pool_stop
    arm.argtypes, arm.restype, stop.argtypes, stop.restype = [ctypes.c_int], ctypes.c_int, [], None
    runs = [(0, 70), (40, 17), (5, 1), (300, 1), (12, 1)]
    threads = torch.get_num_threads()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            attention = attention_backend("cpu", torch.device("cpu"), dtype)
            for heads, kv_heads, window, sinks in [(8, 2, None, None), (12, 4, 50, torch.linspace(-2.0, 3.0, 12))]:
                cache, batch, q, k, v, _ = make_step(runs, heads, kv_heads, 64, 16, dtype, window, sinks=sinks,
                                                     num_layers=1, seed=4)
                step = attention.build(batch, cache)
                torch.set_num_threads(1)
                alone = step(0, q, k, v, sinks)
                assert arm(1) == 1
                pooled = step(0, q, k, v, sinks)
                arm(0)
                assert torch.equal(alone, pooled), (dtype, heads, kv_heads, window)
    finally:
        torch.set_num_threads(threads)
        stop()


@needs_kernels
@pytest.mark.parametrize("amx", [True, False])
def test_cpu_kernel_bf16_prompt_tiles_round_the_same_whatever_their_work_items(amx):
    """bfloat16 prompt runs put their chunks in pairs once per work item, and take items of up to 256 rows where
    that leaves every thread items (fewer where it would not): a row's bits do not depend on its item. One thread
    (items of 256 rows) against eight (128 rows with 16 heads of 4 KV heads, 64 with 8 of 8; with 12 of 4, items of
    255 and 63 rows, so that a row moves between 16-row blocks that see a whole chunk and blocks that do not), with
    windows and sinks, on the tile unit and in dot products. (On a CPU without AVX512-BF16 no run takes those paths.)"""
    kernels = cpu_kernels()
    if amx and not kernels.attention_amx(-1):
        pytest.skip("this CPU has no AMX (or Linux did not grant its tile state)")
    runs = [(0, 70), (40, 129), (5, 1)]
    attention = attention_backend("cpu", torch.device("cpu"), torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        if not amx:
            kernels.attention_amx(0)
        for heads, kv_heads in [(16, 4), (8, 8), (12, 4)]:
            for window, sinks in [(None, None), (50, torch.linspace(-2.0, 3.0, heads))]:
                cache, batch, q, k, v, _ = make_step(runs, heads, kv_heads, 64, 16, torch.bfloat16, window,
                                                     sinks=sinks, num_layers=1, seed=9)
                step = attention.build(batch, cache)
                torch.set_num_threads(1)
                one = step(0, q, k, v, sinks)
                torch.set_num_threads(8)
                eight = step(0, q, k, v, sinks)
                assert torch.equal(one.view(torch.int16), eight.view(torch.int16)), (heads, kv_heads, window)
    finally:
        torch.set_num_threads(threads)
        if not amx:
            kernels.attention_amx(1)


@needs_kernels
@pytest.mark.slow
def test_bench_attention_times_a_revisions_kernels_against_this_trees(capsys):
    """bench/bench_attention.py --base (the A/B figures in docs/performance.md): the CPU kernels at HEAD built apart and
    alternated with this tree's in one process, a line per work with the ratio and whether the outputs are the same
    bits; an unknown work's name refused."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    sys.path.insert(0, str(root / "bench"))
    from bench_attention import main

    assert main(["--threads", "1", "--dtypes", "float32", "--backends", "cpu", "--work", "decode 1 x 544",
                 "--base", "HEAD"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("decode 1 x 544")]
    assert len(rows) == 2, out  # this tree's timing, then the comparison
    ratio = rows[1].split()[5]
    assert float(ratio.removesuffix("x")) > 0 and rows[1].endswith(("same bits", "OUTPUTS DIFFER")), rows[1]
    with pytest.raises(SystemExit, match="not among"):
        main(["--work", "decode 3 x 5"])


@needs_kernels
def test_bench_attention_cold_times_each_call_after_an_untimed_eviction(capsys):
    """bench/bench_attention.py --cold: every timed call follows a read that is not timed (an engine step's KV comes
    from memory), and the decode rows still print their rate against the streaming read."""
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_attention import call_seconds, main

    evictions = []
    seconds = call_seconds(lambda i: None, 3, lambda: (evictions.append(1), time.sleep(0.05)))
    assert len(evictions) == 3 and seconds < 0.05
    assert main(["--threads", "1", "--dtypes", "float32", "--backends", "cpu", "--work", "decode 1 x 544",
                 "--cold"]) == 0
    out = capsys.readouterr().out
    assert "(--cold)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("decode 1 x 544")]
    assert len(rows) == 1 and rows[0][-2] == "GB/s" and float(rows[0][-1]) > 0, out
