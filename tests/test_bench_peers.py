"""bench/bench_peers.py's report, which bench_moe.py shares: a run measured without the bandwidth around it (as
bench_moe.py's are) is summarized as well as one with it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_peers import batch_tokens, summarize  # noqa: E402

WORK = {"batch": [{"prompt": [1] * 100, "max_tokens": 20}, {"prompt": [2] * 60, "max_tokens": 20}]}


def run(ttft_s: float, batch_s: float, **extra) -> dict:
    return {"ttft_s": ttft_s, "tpot_s": ttft_s / 10, "batch_s": batch_s, "load_s": 1.0, **extra}


def test_runs_without_the_bandwidth_around_them_are_summarized():
    summary = summarize([run(0.3, 2.0), run(0.5, 4.0), run(0.4, 3.0)], WORK)
    assert summary["ttft_s"] == pytest.approx(0.4)
    assert summary["throughput_tok_s"] == pytest.approx(batch_tokens(WORK) / 3.0)
    assert summary["read_bandwidth"] is None and summary["weights_alone_s"] is None
    assert summary["rounds"] == 3


def test_bracketed_runs_keep_their_bandwidth():
    summary = summarize([run(0.3, 2.0, read_bandwidth=20e9), run(0.5, 4.0, read_bandwidth=30e9)], WORK)
    assert summary["read_bandwidth"] == pytest.approx(25e9)
    # one run without it: no median of the others passed off as the whole's
    assert summarize([run(0.3, 2.0, read_bandwidth=20e9), run(0.5, 4.0)], WORK)["read_bandwidth"] is None


def test_each_generation_keeps_the_bandwidth_of_its_own_seconds():
    from peer_vllm import tpot_pairs

    # two generations of 11 tokens, each between two one-token generations of its prompt (0.1 s, then 0.2 s in a
    # slower spell), the three between two read-rate timings
    pairs = tpot_pairs([[0.6, 20e9, 22e9, 0.1, 0.1], [1.2, 40e9, 44e9, 0.19, 0.21]], 11)
    assert pairs == [[pytest.approx(0.05), 20e9, 22e9, True], [pytest.approx(0.1), 40e9, 44e9, True]]
    summary = summarize([run(0.3, 2.0, tpot_pairs=pairs[:1]), run(0.5, 4.0, tpot_pairs=pairs[1:])], WORK)
    assert summary["tpot_pairs"] == pairs


def test_batch_one_tpot_is_set_against_the_generations_whose_read_rate_held():
    from peer_vllm import bytes_over_bandwidth

    # 4 MB at 40 GB/s is 0.1 ms: the steady generations read 1.2x and 1.4x it; the third straddles a change of spell
    pairs = [[1.2e-4, 40e9, 42e9], [1.4e-4, 41e9, 39e9], [0.8e-4, 60e9, 34e9]]
    bound, rate, steady = bytes_over_bandwidth(pairs, 4e6)
    assert steady == 2 and rate == pytest.approx(40.5e9)
    assert bound == pytest.approx((1.2e-4 / (4e6 / 41e9) + 1.4e-4 / (4e6 / 40e9)) / 2)
    # none steady: every generation counts, and the count says so
    bound, rate, steady = bytes_over_bandwidth(pairs[2:], 4e6)
    assert steady == 0 and bound == pytest.approx(0.8e-4 / (4e6 / 47e9))


def test_the_best_tpot_is_a_steady_generations():
    from peer_vllm import best_tpot

    # the third generation straddles a change of spell: its TPOT (its one-token run slow, the whole run fast) is
    # below what any steady one read, and is not the one reported
    pairs = [[1.2e-4, 40e9, 42e9], [1.4e-4, 41e9, 39e9], [0.6e-4, 34e9, 57e9]]
    assert best_tpot(pairs) == 1.2e-4
    assert best_tpot(pairs[2:]) == 0.6e-4  # none steady: the best of them all


def test_a_generation_whose_prompt_timings_disagree_is_not_steady():
    from peer_vllm import best_tpot, bytes_over_bandwidth, tpot_pairs

    # the second generation's first one-token run was slow (1.4 s against 0.7 s after it): its prompt's seconds are
    # unknown, and the TPOT it reads (under the weights' read time) is neither the best one nor in the bound
    pairs = tpot_pairs([[1.9, 40e9, 41e9, 0.7, 0.72], [1.9, 40e9, 41e9, 1.4, 0.7]], 64)
    assert [p[3] for p in pairs] == [True, False]
    assert best_tpot(pairs) == pytest.approx((1.9 - 0.71) / 63)
    bound, _, steady = bytes_over_bandwidth(pairs, 4e6)
    assert steady == 1 and bound == pytest.approx((1.9 - 0.71) / 63 / (4e6 / 40.5e9))


def test_the_read_bandwidth_is_timed_over_huge_pages(monkeypatch):
    """The machine's read rate is a sum over memory on huge pages, as the engines' weights are: a sum over 4 KiB pages
    read 0.74x as fast on a Zen 4 EPYC, which made every TPOT / (B / BW) look closer to the machine's limit."""
    import peer_vllm
    from peer_vllm import HUGE_PAGE, ones_on_huge_pages, read_bandwidth

    ones = ones_on_huge_pages(3 * HUGE_PAGE // 4 + 5)
    assert ones.shape == (3 * HUGE_PAGE // 4 + 5,) and bool((ones == 1).all())
    if sys.platform == "linux":
        assert ones.data_ptr() % HUGE_PAGE == 0
    summed = []
    monkeypatch.setattr(peer_vllm, "ones_on_huge_pages", lambda count: summed.append(count) or ones)
    assert read_bandwidth(1) > 0 and summed == [1 << 28]
