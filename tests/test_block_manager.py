"""BlockManager: allocation accounting, reference counts, prefix caching, LRU eviction (plain Python)."""

from __future__ import annotations

import copy
import random

import pytest

from torch_shift.kv.block_manager import BlockManager

BS = 4


def make_bm(num_blocks: int = 8, block_size: int = BS, prefix: bool = True) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def admit(bm: BlockManager, rid: str, tokens: list[int], computed: bool = True) -> list[int]:
    """Admit a request the way the scheduler does (prefix lookup, then allocate the whole prompt);
    with `computed`, mark the whole prompt computed. Returns the prefix-hit blocks."""
    hits = bm.find_cached_prefix(rid, tokens)
    assert bm.allocate(rid, len(tokens), hits)
    if computed:
        bm.cache_computed_blocks(rid, tokens, len(tokens))
    return hits


def snapshot(bm: BlockManager):
    return copy.deepcopy((bm.ref_counts, list(bm.free_blocks), bm.block_keys, bm.cached_blocks, bm.req_blocks,
                          bm.req_keys, bm.num_prefix_hits))


def check_consistent(bm: BlockManager) -> None:
    """Reference counts equal the number of owners; the free queue holds exactly the unreferenced
    blocks; every cached key points to a block that carries that key."""
    owners = [0] * bm.num_blocks
    for blocks in bm.req_blocks.values():
        for b in blocks:
            owners[b] += 1
    assert owners == bm.ref_counts
    assert set(bm.free_blocks) == {b for b in range(bm.num_blocks) if bm.ref_counts[b] == 0}
    for key, b in bm.cached_blocks.items():
        assert bm.block_keys[b] == key


def free_all(bm: BlockManager) -> None:
    for rid in list(bm.req_blocks):
        bm.free(rid)
    check_consistent(bm)
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.usage == 0.0


# -- allocation accounting ------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens, blocks", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed(num_tokens, blocks):
    assert make_bm().blocks_needed(num_tokens) == blocks


def test_invalid_sizes_rejected():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_allocate_grow_and_free_accounting():
    bm = make_bm(8)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    assert bm.allocate("a", 5)
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 6
    assert bm.usage == pytest.approx(0.25)
    assert bm.allocate("a", 8)  # still fits in two blocks
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 6
    table = list(bm.block_table("a"))
    assert bm.allocate("a", 9)  # grows by one, keeps the old blocks in place
    assert bm.block_table("a")[:2] == table and len(bm.block_table("a")) == 3
    assert bm.allocate("b", 4)
    assert set(bm.block_table("a")).isdisjoint(bm.block_table("b"))
    assert bm.num_free_blocks == 4
    check_consistent(bm)
    bm.free("a")
    assert bm.block_table("a") == [] and bm.num_free_blocks == 7
    bm.free("a")  # freeing twice is harmless
    assert bm.num_free_blocks == 7
    free_all(bm)


def test_allocate_whole_pool_then_fail():
    bm = make_bm(4)
    assert bm.allocate("a", 4 * BS)
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    assert not bm.allocate("b", 1)
    assert not bm.allocate("a", 4 * BS + 1)
    free_all(bm)


def test_failed_allocate_changes_nothing():
    bm = make_bm(6)
    admit(bm, "a", prompt(9))  # 3 blocks, two of them full and cached
    bm.free("a")
    assert bm.allocate("b", 6)  # 2 blocks, taken from never-used ones
    before = snapshot(bm)
    # growing past the pool
    assert not bm.allocate("b", 7 * BS)
    assert snapshot(bm) == before
    # a new request with a cached (free) prefix plus more new blocks than remain
    hits = bm.find_cached_prefix("c", prompt(9) + prompt(20, 500))
    assert len(hits) == 2
    assert not bm.allocate("c", 29, hits)
    assert snapshot(bm) == before
    assert bm.block_table("c") == []
    # the same request fits once enough is asked for
    assert bm.allocate("c", 12, hits)
    assert bm.block_table("c")[:2] == hits
    check_consistent(bm)
    free_all(bm)


# -- reference counts and prefix caching ----------------------------------------------------------------

def test_shared_prefix_blocks_are_reference_counted():
    bm = make_bm(8)
    p = prompt(10)
    admit(bm, "a", p)  # blocks: 2 full + 1 partial
    a_table = list(bm.block_table("a"))
    hits = admit(bm, "b", p, computed=False)
    assert hits == a_table[:2]
    assert bm.block_table("b")[:2] == a_table[:2]
    assert bm.block_table("b")[2] != a_table[2]  # the partial block is never shared
    assert [bm.ref_counts[b] for b in a_table] == [2, 2, 1]
    assert bm.num_free_blocks == 8 - 4
    assert bm.num_prefix_hits == 2 * BS
    check_consistent(bm)

    bm.free("a")  # b still holds the shared blocks
    assert [bm.ref_counts[b] for b in a_table[:2]] == [1, 1]
    assert not set(a_table[:2]) & set(bm.free_blocks)
    assert bm.num_free_blocks == 8 - 3
    # the shared blocks survive any amount of allocation pressure
    assert bm.allocate("c", 5 * BS)
    assert bm.num_free_blocks == 0
    assert bm.find_cached_prefix("d", p) == a_table[:2]
    check_consistent(bm)
    bm.free("c")
    bm.free("b")
    assert bm.num_free_blocks == 8
    free_all(bm)


def test_three_requests_share_a_prefix():
    bm = make_bm(8)
    p = prompt(5)
    admit(bm, "a", p)
    admit(bm, "b", p)
    admit(bm, "c", p)
    first = bm.block_table("a")[0]
    assert bm.block_table("b")[0] == bm.block_table("c")[0] == first
    assert bm.ref_counts[first] == 3
    assert bm.num_free_blocks == 8 - 4
    bm.free("b")
    bm.free("a")
    assert bm.ref_counts[first] == 1 and first not in bm.free_blocks
    free_all(bm)


def test_prefix_hits_only_for_registered_full_computed_blocks():
    bm = make_bm(8)
    p = prompt(11)
    assert bm.allocate("a", len(p))
    assert bm.find_cached_prefix("x", p) == []  # allocated but nothing computed
    bm.cache_computed_blocks("a", p, 3)  # less than a block
    assert bm.find_cached_prefix("x", p) == []
    bm.cache_computed_blocks("a", p, 7)  # one full block
    table = bm.block_table("a")
    assert bm.find_cached_prefix("x", p) == table[:1]
    bm.cache_computed_blocks("a", p, 11)  # two full blocks; the third is partial
    assert bm.find_cached_prefix("x", p) == table[:2]
    assert bm.find_cached_prefix("x", p + prompt(20, 900)) == table[:2]
    # a prompt that differs in its first block hits nothing, even where its second block matches
    q = [7] + p[1:]
    assert bm.find_cached_prefix("x", q) == []
    # a prompt that differs in its second block hits only the first
    r = p[:BS] + [7] + p[BS + 1:]
    assert bm.find_cached_prefix("x", r) == table[:1]
    # shorter prompts: only whole blocks that leave a token to compute
    assert bm.find_cached_prefix("x", p[:BS]) == []
    assert bm.find_cached_prefix("x", p[:BS + 1]) == table[:1]
    free_all(bm)


def test_incremental_cache_registration_during_decode():
    bm = make_bm(8)
    tokens = prompt(6)
    admit(bm, "a", tokens)
    assert len(bm.cached_blocks) == 1
    # generated tokens fill the second block; once computed it is cached too
    tokens = tokens + [1, 2]
    assert bm.allocate("a", len(tokens))
    bm.cache_computed_blocks("a", tokens, 7)
    assert len(bm.cached_blocks) == 1
    bm.cache_computed_blocks("a", tokens, 8)
    assert len(bm.cached_blocks) == 2
    assert bm.find_cached_prefix("x", tokens + [3]) == bm.block_table("a")[:2]
    free_all(bm)


def test_fully_cached_prompt_leaves_a_token_to_compute():
    bm = make_bm(8)
    p = prompt(2 * BS)  # exactly two full blocks
    admit(bm, "a", p)
    assert len(bm.cached_blocks) == 2
    hits = bm.find_cached_prefix("b", p)
    assert len(hits) == 1 and len(hits) * BS < len(p)
    assert len(bm.find_cached_prefix("b", p[:BS])) == 0
    assert len(bm.find_cached_prefix("b", p + [5])) == 2
    free_all(bm)


def test_freed_cached_blocks_can_be_revived():
    bm = make_bm(4)
    p = prompt(9)
    admit(bm, "a", p)
    a_table = list(bm.block_table("a"))
    bm.free("a")
    assert bm.num_free_blocks == 4
    hits = admit(bm, "b", p, computed=False)
    assert hits == a_table[:2]
    assert bm.num_free_blocks == 4 - 3
    assert [bm.ref_counts[b] for b in hits] == [1, 1]
    check_consistent(bm)
    free_all(bm)


def test_lru_evicts_tail_blocks_first_and_evicted_blocks_miss():
    bm = make_bm(6)
    p = prompt(3 * BS + 1)
    admit(bm, "a", p)  # blocks a0 a1 a2 (cached) + a3 (partial)
    a = list(bm.block_table("a"))
    bm.free("a")
    assert len(bm.find_cached_prefix("x", p)) == 3
    # two never-used blocks go first: the cache is intact
    assert bm.allocate("n1", 2 * BS)
    assert bm.find_cached_prefix("x", p) == a[:3]
    # then the tail: the partial block a3, then a2
    assert bm.allocate("n2", 1)
    assert bm.block_table("n2") == [a[3]]
    assert bm.find_cached_prefix("x", p) == a[:3]
    assert bm.allocate("n3", 1)
    assert bm.block_table("n3") == [a[2]]
    assert bm.find_cached_prefix("x", p) == a[:2]
    assert bm.block_keys[a[2]] is None
    assert bm.allocate("n4", 1)
    assert bm.block_table("n4") == [a[1]]
    assert bm.find_cached_prefix("x", p) == a[:1]
    assert bm.allocate("n5", 1)
    assert bm.block_table("n5") == [a[0]]
    assert bm.find_cached_prefix("x", p) == []
    assert bm.cached_blocks == {}
    check_consistent(bm)
    free_all(bm)


def test_lru_evicts_least_recently_freed_request_first():
    bm = make_bm(4)
    pa, pb = prompt(BS + 1, 100), prompt(BS + 1, 200)
    admit(bm, "a", pa)
    admit(bm, "b", pb)
    bm.free("a")
    bm.free("b")
    # a was freed first: its blocks are evicted before b's
    assert bm.allocate("n", 2 * BS)
    assert bm.find_cached_prefix("x", pa) == []
    assert len(bm.find_cached_prefix("x", pb)) == 1
    bm.free("n")
    # reviving b's block and freeing it again moves it to the young end of the queue
    admit(bm, "b2", pb)
    bm.free("b2")
    assert bm.allocate("m", 3 * BS)
    assert len(bm.find_cached_prefix("x", pb)) == 1
    free_all(bm)


def test_recomputed_block_after_eviction_is_cached_again():
    bm = make_bm(2)
    p = prompt(BS + 1)
    admit(bm, "a", p)
    bm.free("a")
    assert bm.allocate("n", 2 * BS)  # evicts everything
    bm.free("n")
    assert bm.find_cached_prefix("x", p) == []
    admit(bm, "b", p)
    assert bm.find_cached_prefix("x", p) == bm.block_table("b")[:1]
    free_all(bm)


def test_prefix_caching_disabled():
    bm = make_bm(8, prefix=False)
    p = prompt(10)
    admit(bm, "a", p)
    assert bm.cached_blocks == {}
    assert bm.find_cached_prefix("b", p) == []
    admit(bm, "b", p)
    assert set(bm.block_table("a")).isdisjoint(bm.block_table("b"))
    assert bm.num_prefix_hits == 0
    free_all(bm)


def test_reset_prefix_cache():
    bm = make_bm(8)
    pa, pb = prompt(9, 100), prompt(9, 200)
    admit(bm, "a", pa)
    admit(bm, "b", pb)
    bm.free("a")
    assert len(bm.find_cached_prefix("x", pa)) == 2
    bm.reset_prefix_cache()
    assert bm.find_cached_prefix("x", pa) == []  # freed blocks lose their keys
    assert all(bm.block_keys[b] is None for b in bm.free_blocks)
    check_consistent(bm)
    # the pool is whole: the same prompt is computed from scratch in fresh blocks
    admit(bm, "a2", pa)
    assert len(bm.find_cached_prefix("x", pa)) == 2
    free_all(bm)


def test_no_leak_under_random_operations():
    rng = random.Random(0)
    bm = make_bm(24)
    prefixes = [prompt(rng.randint(1, 3 * BS), 100 * k) for k in range(4)]
    live: dict[str, list[int]] = {}
    for step in range(400):
        if live and (rng.random() < 0.4 or bm.num_free_blocks == 0):
            rid = rng.choice(sorted(live))
            bm.free(rid)
            del live[rid]
        elif live and rng.random() < 0.5:  # decode a few tokens
            rid = rng.choice(sorted(live))
            tokens = live[rid] + [rng.randint(0, 9) for _ in range(rng.randint(1, 5))]
            if bm.allocate(rid, len(tokens)):
                live[rid] = tokens
                bm.cache_computed_blocks(rid, tokens, len(tokens))
        else:
            rid = f"r{step}"
            tokens = rng.choice(prefixes) + [rng.randint(0, 9) for _ in range(rng.randint(1, 6))]
            hits = bm.find_cached_prefix(rid, tokens)
            assert len(hits) * BS < len(tokens)
            if bm.allocate(rid, len(tokens), hits):
                live[rid] = tokens
                bm.cache_computed_blocks(rid, tokens, len(tokens))
            else:
                assert bm.block_table(rid) == []
        check_consistent(bm)
        assert bm.num_free_blocks + len({b for t in bm.req_blocks.values() for b in t}) == bm.num_blocks
    assert bm.num_prefix_hits > 0
    free_all(bm)
