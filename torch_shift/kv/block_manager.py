"""Paged KV block bookkeeping in plain Python: allocation, reference counts, prefix caching.

A block holds `block_size` consecutive tokens of one sequence. A full block whose tokens have
been computed gets a key made of its parent block's key hash and its own token ids; a later
request whose prompt starts with the same tokens reuses the block instead of computing it
again. Freed blocks keep their key and sit in an LRU queue until a new allocation evicts them.

A request of KV width d (its KV spread over d replicas' pools, paper 004's KV adaptor) uses each
block for d * block_size tokens of 1/d of the heads: the same bytes, d times the tokens. Its keys
cover d * block_size tokens, so they never match a width-1 key. Likewise a request whose KV is
in another view of the pool (a pipeline stage's layers with every head, paper 003) has keys rooted
in that view, so a block is only ever found by a request that reads it in the view it was written.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BlockKey = tuple[int, tuple[int, ...]]  # (hash of the parent block's key, this block's token ids)
_ROOT_HASH = 0  # the parent of a prompt's first block in the pool's ordinary view ("heads")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[BlockKey | None] = [None] * num_blocks
        # Blocks with no reference, oldest first; cached ones among them can still be hit.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[BlockKey, int] = {}
        self.req_blocks: dict[str, list[int]] = {}
        self.req_keys: dict[str, list[BlockKey]] = {}  # keys of the request's full, computed blocks
        self.req_width: dict[str, int] = {}  # KV width of requests wider than 1
        self.req_view: dict[str, str] = {}  # KV view of requests in another view than "heads"
        self.num_prefix_hits = 0  # tokens served from the prefix cache, over the manager's life

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool holds at width 1: no sequence can grow past it."""
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def blocks_needed(self, num_tokens: int, width: int = 1) -> int:
        return -(-num_tokens // (self.block_size * width))

    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def _keys(self, token_ids: Sequence[int], num_full_blocks: int, known: list[BlockKey],
              width: int, view: str = "heads") -> list[BlockKey]:
        keys = list(known[:num_full_blocks])
        parent = hash(keys[-1]) if keys else (_ROOT_HASH if view == "heads" else hash(view))
        bs = self.block_size * width
        for i in range(len(keys), num_full_blocks):
            key = (parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            keys.append(key)
            parent = hash(key)
        return keys

    def find_cached_prefix(self, request_id: str, token_ids: Sequence[int], width: int = 1,
                           view: str = "heads") -> list[int]:
        """Blocks of the longest cached prefix of `token_ids` written in `view`, leaving at least one
        token to compute (the step needs a last position to sample from)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // (self.block_size * width)
        keys = self._keys(token_ids, max_blocks, self.req_keys.get(request_id, []), width, view)
        hits: list[int] = []
        for key in keys:
            block = self.cached_blocks.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def _num_to_take(self, request_id: str, num_tokens: int, cached_prefix: Sequence[int], width: int) -> int:
        """Free blocks an allocation would take (new blocks plus revived cached ones); 0: none needed."""
        blocks = self.req_blocks.get(request_id)
        if blocks is None:
            assert not cached_prefix or request_id not in self.req_keys
            num_held = 0
        else:
            assert not cached_prefix, "a cached prefix is only taken by a request that holds no block"
            assert self.req_width.get(request_id, 1) == width, "a request keeps its width while it holds blocks"
            num_held = len(blocks)
        num_new = self.blocks_needed(num_tokens, width) - num_held - len(cached_prefix)
        return max(num_new, 0) + sum(1 for b in cached_prefix if self.ref_counts[b] == 0)

    def can_allocate(self, request_id: str, num_tokens: int, cached_prefix: Sequence[int] = (),
                     width: int = 1) -> bool:
        return self._num_to_take(request_id, num_tokens, cached_prefix, width) <= len(self.free_blocks)

    def allocate(self, request_id: str, num_tokens: int, cached_prefix: Sequence[int] = (), width: int = 1,
                 view: str = "heads") -> bool:
        """Make the request own enough blocks for `num_tokens` tokens (at KV width `width`, written in
        `view`), starting a new request with `cached_prefix`. False (and nothing changed) when the pool
        cannot hold them."""
        blocks = self.req_blocks.get(request_id)
        if blocks is not None and not cached_prefix and num_tokens <= len(blocks) * self.block_size * width:
            return True  # the last block still has room (most decode steps)
        if self._num_to_take(request_id, num_tokens, cached_prefix, width) > len(self.free_blocks):
            return False
        num_new = self.blocks_needed(num_tokens, width) - len(blocks or ()) - len(cached_prefix)
        if blocks is None and width != 1:
            self.req_width[request_id] = width
        if blocks is None and view != "heads":
            self.req_view[request_id] = view
        for b in cached_prefix:
            if self.ref_counts[b] == 0:
                del self.free_blocks[b]
            self.ref_counts[b] += 1
        blocks = self.req_blocks.setdefault(request_id, [])
        blocks.extend(cached_prefix)
        if cached_prefix:
            self.req_keys[request_id] = [self.block_keys[b] for b in cached_prefix]
            self.num_prefix_hits += len(cached_prefix) * self.block_size * width
        for _ in range(max(num_new, 0)):
            block, _ = self.free_blocks.popitem(last=False)
            key = self.block_keys[block]
            if key is not None:  # evict the least recently freed cached block
                if self.cached_blocks.get(key) == block:
                    del self.cached_blocks[key]
                self.block_keys[block] = None
            self.ref_counts[block] = 1
            blocks.append(block)
        return True

    def cache_computed_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the request's blocks that are full of computed tokens, for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        known = self.req_keys.setdefault(request_id, [])
        width = self.req_width.get(request_id, 1)
        num_full = num_computed_tokens // (self.block_size * width)
        if num_full <= len(known):
            return
        blocks = self.req_blocks[request_id]
        keys = self._keys(token_ids, num_full, known, width, self.req_view.get(request_id, "heads"))
        for i in range(len(known), num_full):
            key = keys[i]
            if key not in self.cached_blocks:
                self.cached_blocks[key] = blocks[i]
                self.block_keys[blocks[i]] = key
        self.req_keys[request_id] = keys

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's blocks past those its first `num_tokens` tokens need (KV slots of proposed
        tokens that were rejected); they hold no computed full block, so none is cached."""
        blocks = self.req_blocks[request_id]
        keep = self.blocks_needed(num_tokens, self.req_width.get(request_id, 1))
        while len(blocks) > keep:
            b = blocks.pop()
            assert self.block_keys[b] is None or self.cached_blocks.get(self.block_keys[b]) != b
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks[b] = None

    def free(self, request_id: str) -> None:
        """Drop the request's references; its blocks go to the free queue, tail blocks first, so
        that a prompt's first blocks are the last ones evicted."""
        blocks = self.req_blocks.pop(request_id, [])
        self.req_keys.pop(request_id, None)
        self.req_width.pop(request_id, None)
        self.req_view.pop(request_id, None)
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0
            if self.ref_counts[b] == 0:
                self.free_blocks[b] = None

    def reset_prefix_cache(self) -> None:
        for b in self.free_blocks:
            self.block_keys[b] = None
        self.cached_blocks = {k: b for k, b in self.cached_blocks.items() if self.ref_counts[b] > 0}
