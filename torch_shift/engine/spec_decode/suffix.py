"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; ArcticInference's `suffix` method, paper 002).

Two suffix trees of depth `max_depth`: one per request over its prompt and the tokens generated so far, one global
over the outputs of earlier requests (the last `max_cached_requests` to finish, evicted first in, first out). Each
step, for every length L of the context's suffix found in a tree, a path is grown from the node of that suffix:
the most frequent child each time, its probability estimated as the product of child count / node count along
the path, until it falls below `min_token_prob`, the tree's depth is reached, or the path holds
`min(num_speculative_tokens, max_spec_factor * L)` tokens (the speculation length adapts to the match length).
The path with the highest score (the sum of its probabilities: the expected number of accepted tokens) wins;
ties go to the longer match, then to the request's own tree.

The trees are implicit: a tree node is the set of end positions of its string in a token array (its count is
their number; its children are the tokens that follow them), found by narrowing the positions of the context's
last token one token further back at a time with numpy. That is the same tree (tests/test_spec_decode.py
checks it against an explicit trie), with memory O(tokens) instead of O(tokens * depth). The global tree is
matched from two tokens on, through an index of token pairs: a single token says little in thousands of outputs.

The functions below are the rule in Python: the reference, and the fallback where torch_shift's CPU kernels cannot
be built. Proposers run the same rule in C++ (kernels/cpu_suffix.cpp, `NativeDraft`): 85 -> 15 us a call on the
edit and agent work (docs/performance.md).
"""

from __future__ import annotations

import ctypes
import weakref
from array import array
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from torch_shift.engine.spec_decode.tokens import PAD, RequestTokens


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    score: float = 0.0  # the sum of the tokens' estimated probabilities
    match_len: int = 0
    scores: list[float] = field(default_factory=list)  # the score after each token

    def add(self, token: int, prob: float) -> None:
        self.token_ids.append(token)
        self.score += prob
        self.scores.append(self.score)

    def cut(self, num_tokens: int) -> Draft:
        """The draft's first `num_tokens` tokens, scored as a walk that stopped there."""
        num_tokens = min(num_tokens, len(self.token_ids))
        return Draft(self.token_ids[:num_tokens], self.scores[num_tokens - 1] if num_tokens else 0.0, self.match_len,
                     self.scores[:num_tokens])


# Occurrences up to which a node's are followed all at once, as a matrix of the tokens around them (and the path
# walked in Python lists), instead of one token at a time with numpy: numpy's ~1 us a call made proposing 0.1-0.5 ms
# at batch 1 on the edit work, 5-25% of a step of the default model (docs/performance.md).
FEW = 32
NATIVE = True  # proposers draft in C++ (kernels/cpu_suffix.cpp) where the CPU kernels build; tests turn it off


def suffix_matches(tokens: np.ndarray, ends: np.ndarray, context: np.ndarray, first_len: int,
                   max_len: int, min_count: int = 1) -> list[np.ndarray]:
    """`ends`: the end positions in `tokens` of the context's last `first_len` tokens, in increasing order. Returns,
    for L = first_len, first_len + 1, ... while at least `min_count` are found (at most `max_len`), the end positions
    of the context's last L tokens, in increasing order."""
    matches = []
    length = first_len
    # one token at a time while there are many occurrences, and for the first token back: in text that does not
    # repeat, that one leaves none or one, and the matrix below would compare every length for nothing
    while len(ends) >= min_count and (len(ends) > FEW or length == first_len):
        matches.append(ends)
        if length >= max_len:
            return matches
        starts = ends - length  # the token before each occurrence
        keep = starts >= 0
        ends, starts = ends[keep], starts[keep]
        ends = ends[tokens[starts] == context[-length - 1]]
        length += 1
    if len(ends) < min_count:
        return matches
    # each remaining occurrence's match length at once: how many of the tokens before it, from the length-th back,
    # equal the context's (context[-k - 1] for k = length ... max_len - 1), up to the first that does not
    back = ends[:, None] - np.arange(length, max(length, max_len))[None, :]
    same = (back >= 0) & (tokens[np.maximum(back, 0)] == context[::-1][length:max(length, max_len)])
    match_len = length + np.argmin(np.concatenate([same, np.zeros((len(ends), 1), dtype=bool)], axis=1), axis=1)
    for match in range(length, max(length, max_len) + 1):
        found = ends if match == length else ends[match_len >= match]
        if len(found) < min_count:
            break
        matches.append(found)
    return matches


def most_frequent(tokens: np.ndarray | list[int]) -> tuple[int, int]:
    """The most frequent token (the smallest of those tied) and its count; `tokens` holds no PAD."""
    if len(tokens) <= 256:  # a dict of Python ints: 3-4x faster than np.unique's sort for a few hundred
        counts: dict[int, int] = {}
        for token in tokens if isinstance(tokens, list) else tokens.tolist():
            counts[token] = counts.get(token, 0) + 1
        best_count = max(counts.values())
        return min(t for t, c in counts.items() if c == best_count), best_count
    values, counts = np.unique(tokens, return_counts=True)
    i = int(counts.argmax())  # the first of the most frequent: the smallest token id
    return int(values[i]), int(counts[i])


def grow_path(tokens: np.ndarray, ends: np.ndarray, max_tokens: int, min_token_prob: float) -> Draft:
    """The most frequent path below the node whose occurrences end at `ends` (`tokens` padded with PAD far enough
    past its end for `max_tokens` reads)."""
    draft = Draft()
    prob = 1.0
    offset = 1
    while len(draft.token_ids) < max_tokens and len(ends) > FEW:
        following = tokens[ends + offset]
        present = following[following != PAD]
        if len(present) == 0:
            return draft
        best, best_count = most_frequent(present)
        prob *= best_count / len(ends)
        if prob < min_token_prob:
            return draft
        draft.add(best, prob)
        ends = ends[following == best]
        offset += 1
    remaining = max_tokens - len(draft.token_ids)
    if remaining <= 0 or len(ends) == 0:
        return draft
    # the tokens after each remaining occurrence, as lists: column j is the path's next token's candidates
    rows = tokens[ends[:, None] + np.arange(offset, offset + remaining)[None, :]].tolist()
    for j in range(remaining):
        if len(rows) == 1:  # one occurrence: the path is what follows it, each token with the same probability
            for token in rows[0][j:]:
                if token == PAD:
                    break
                draft.add(token, prob)
            break
        present = [row[j] for row in rows if row[j] != PAD]
        if not present:
            break
        best, best_count = most_frequent(present)
        prob *= best_count / len(rows)
        if prob < min_token_prob:
            break
        draft.add(best, prob)
        rows = [row for row in rows if row[j] == best]
    return draft


def path_limit(match_len: int, max_depth: int, max_spec_tokens: int, max_spec_factor: float) -> int:
    """The most tokens a path below a match of `match_len` tokens may hold (and so the most it can score)."""
    return min(max_spec_tokens, int(min(match_len * max_spec_factor, max_depth) + 1e-6), max_depth - match_len)


def best_draft(tokens: np.ndarray, matches: list[np.ndarray], first_len: int, max_depth: int, max_spec_tokens: int,
               max_spec_factor: float, min_token_prob: float, beat: float = 0.0) -> Draft:
    """The best path over the matched suffix lengths: the highest score, ties to the longer match; only lengths
    whose path could score more than `beat` are grown. Lengths are tried in order of their path's limit, largest
    first (a score never exceeds its limit, so once a path reaches it the lengths after it are not grown: a
    repeating context grows one path, not one per length)."""
    best = Draft()
    limits = [(path_limit(first_len + i, max_depth, max_spec_tokens, max_spec_factor), first_len + i, ends)
              for i, ends in enumerate(matches)]
    limits.sort(key=lambda item: (item[0], item[1]), reverse=True)
    # the matches are nested (each length's occurrences among the shorter one's), so two of the same count are the
    # same node: its path was walked once, for the largest limit, and a smaller limit only cuts it
    walked: dict[int, Draft] = {}
    for limit, length, ends in limits:
        if limit <= beat or limit < best.score or (limit == best.score and length < best.match_len):
            continue  # cannot win: its score is at most its limit
        path = walked.get(len(ends))
        if path is None:
            path = walked[len(ends)] = grow_path(tokens, ends, limit, min_token_prob)
        draft = path.cut(limit)
        if draft.score > best.score or (draft.score == best.score and draft.token_ids and length > best.match_len):
            draft.match_len = length
            best = draft
    return best


class NativeDraft:
    """`best_draft(tokens, suffix_matches(tokens, ends, context, first_len, len(context) - 1, min_count), ...)` in C++
    (kernels/cpu_suffix.cpp; `kernels`: torch_shift.kernels.CpuKernels), over int64 arrays given by address. Its
    output arrays are allocated once and every argument is a plain int or float: the engine asks for a draft right
    after a forward has streamed the weights through the caches, where each ctypes array allocated, `.ctypes`
    read or array argument converted costs 10-20 us (measured cold; 0.5-1 us warm)."""

    def __init__(self, kernels, max_tokens: int = 16):
        self.kernels = kernels
        self._grow(max_tokens)

    def _grow(self, size: int) -> None:
        self.size = size
        self.out_tokens = (ctypes.c_int64 * size)()
        self.out_scores = (ctypes.c_double * size)()
        self.match_len = ctypes.c_int64()
        self._addresses = (ctypes.addressof(self.out_tokens), ctypes.addressof(self.out_scores),
                           ctypes.addressof(self.match_len))

    def __call__(self, tokens_address: int, num_tokens: int, scan_len: int, context_address: int, context_len: int,
                 first_len: int, min_count: int, max_depth: int, max_spec_tokens: int, max_spec_factor: float,
                 min_token_prob: float, beat: float = 0.0) -> Draft:
        """The candidates: every position below `scan_len` that holds the context's last token."""
        if max_spec_tokens > self.size:
            self._grow(max_spec_tokens)
        num = self.kernels.suffix_draft(tokens_address, num_tokens, None, 0, scan_len, context_address, context_len,
                                        first_len, min_count, max_depth, max_spec_tokens, max_spec_factor,
                                        min_token_prob, beat, *self._addresses)
        return self._draft(num)

    def from_tree(self, tree: GlobalTree, context_address: int, context_len: int, max_depth: int,
                  max_spec_tokens: int, max_spec_factor: float, min_token_prob: float,
                  beat: float = 0.0) -> Draft | None:
        """The global tree's draft (its C++ index's candidates: matches from two tokens, found once or more), None
        where none is found; only paths scoring more than `beat` are grown."""
        if max_spec_tokens > self.size:
            self._grow(max_spec_tokens)
        if tree.unindexed:
            tree.indexed()
        num = self.kernels.suffix_draft_global(*tree.native_array, context_address, context_len, max_depth,
                                               max_spec_tokens, max_spec_factor, min_token_prob, beat,
                                               *self._addresses)
        return self._draft(num) if num else None

    def _draft(self, num: int) -> Draft:
        """The draft of `num` tokens the kernel wrote."""
        assert num >= 0, num
        if num == 0:
            return Draft()
        scores = self.out_scores[:num]
        return Draft(self.out_tokens[:num], scores[-1], self.match_len.value, scores)


def address(tokens: np.ndarray) -> int:
    """The address of a C-contiguous int64 array's first element."""
    assert tokens.dtype == np.int64 and tokens.flags.c_contiguous, (tokens.dtype, tokens.flags)
    return tokens.ctypes.data


# A filter of 2^20 flags (1 MB) over the hashes of the pairs in the C++ index: a pair whose flag is unset ends in no
# output, so its lookup makes no call into C++ (a ctypes call of 2.2-2.6 us, where the Python dict's miss took 0.3:
# bench_spec's proposer cost at 256 requests went from 0.85 to 1.1 ms without it; docs/performance.md)
_PAIR_MASK = (1 << 20) - 1
_PAIR_MULTIPLIER = 1_000_003  # token ids below 2^31: first * it + second stays below 2^63 (numpy's int64)


class GlobalTree:
    """The outputs of the last `max_cached_requests` finished requests, separated by PAD, with an index of the
    end positions of every pair of adjacent tokens: in C++ where `kernels` (torch_shift.kernels.CpuKernels) are given
    (`native_index`, which the C++ decoder also reads while it drafts a check's later stages), else in `pairs`."""

    def __init__(self, max_depth: int, max_cached_requests: int, kernels=None):
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.length = 1  # tokens[0] is PAD: every sequence has a PAD before it
        self.pairs: dict[tuple[int, int], array] = {}  # int64 positions, without kernels
        self.kernels = kernels
        self.native_index: int | None = None  # kernels/cpu_suffix.cpp's PairIndex
        self.pair_filter: np.ndarray | None = None  # with the C++ index (_PAIR_MASK)
        if kernels is not None:
            self.native_index = kernels.pair_index_new()
            weakref.finalize(self, kernels.pair_index_delete, self.native_index)
            self.pair_filter = np.zeros(_PAIR_MASK + 1, dtype=bool)
        self._hold(np.full(1024, PAD, dtype=np.int64))
        self.sequences: deque[tuple[int, int]] = deque()  # (start, end) in order of arrival
        # sequences not indexed yet: indexed at the next lookup, so that a batch that never looks (nothing pays
        # for a check) does not index its outputs (80 us a request of 100 tokens, 64 at a time)
        self.unindexed: list[tuple[int, int]] = []
        self.num_dead = 0
        # rank 0's tree, where the ranks of other replicas keep copies of it: the outputs added since the last
        # take_additions, in order (None: no copies kept)
        self.additions: list[np.ndarray] | None = None

    @property
    def num_cached(self) -> int:
        return len(self.sequences)

    def add(self, token_ids: list[int] | np.ndarray) -> None:
        if self.max_cached_requests == 0 or len(token_ids) < 2:
            return
        if self.additions is not None:
            self.additions.append(np.array(token_ids, dtype=np.int64))
        while len(self.sequences) >= self.max_cached_requests:
            start, end = self.sequences.popleft()
            self.tokens[start:end] = PAD  # index entries into it no longer match: filtered at lookup
            self.num_dead += end - start
        if self.num_dead > 4096 and self.num_dead > self.length // 2:
            self._compact()
        start = self.length
        end = start + len(token_ids)
        if end + self.max_depth + 2 > len(self.tokens):
            grown = np.full(2 * (end + self.max_depth + 2), PAD, dtype=np.int64)
            grown[:self.length] = self.tokens[:self.length]
            self._hold(grown)
        self.tokens[start:end] = token_ids
        self.unindexed.append((start, end))
        self.sequences.append((start, end))
        self.length = end + 1  # a PAD after it

    def take_additions(self) -> list[np.ndarray]:
        """The outputs added since the last call, in order: what a copy of the tree adds to hold the same
        (StepPlan.global_tree_outputs)."""
        assert self.additions is not None, "a tree whose additions are not kept"
        additions, self.additions = self.additions, []
        return additions

    def _hold(self, tokens: np.ndarray) -> None:
        """`tokens` becomes the tree's array: its address (the C++ matcher's argument) and, with the C++ index,
        the index, address and size as ts_suffix_draft_global takes them (`native_array`)."""
        self.tokens = tokens
        self.address = address(tokens)
        self.native_array = (self.native_index, self.address, len(tokens))

    def _index(self) -> None:
        if self.native_index is not None:
            for start, end in self.unindexed:
                if self.tokens[start] != PAD:  # else evicted before it was indexed
                    self.kernels.pair_index_add(self.native_index, self.address, start, end)
                    tokens = self.tokens[start:end]
                    self.pair_filter[(tokens[:-1] * _PAIR_MULTIPLIER + tokens[1:]) & _PAIR_MASK] = True
            self.unindexed.clear()
            return
        pairs = self.pairs
        for start, end in self.unindexed:
            values = self.tokens[start:end].tolist()
            if values[0] == PAD:  # evicted before it was indexed
                continue
            for i in range(1, len(values)):
                key = (values[i - 1], values[i])
                positions = pairs.get(key)
                if positions is None:
                    pairs[key] = array("q", (start + i,))
                else:
                    positions.append(start + i)
        self.unindexed.clear()

    def _compact(self) -> None:
        live = [self.tokens[s:e].copy() for s, e in self.sequences]
        self.tokens[:] = PAD
        self.pairs.clear()
        if self.native_index is not None:
            self.kernels.pair_index_clear(self.native_index)
            self.pair_filter[:] = False
        self.sequences.clear()
        self.length, self.num_dead = 1, 0
        for seq in live:
            start, end = self.length, self.length + len(seq)
            self.tokens[start:end] = seq
            self.sequences.append((start, end))
            self.length = end + 1
        self.unindexed = list(self.sequences)

    def indexed(self) -> GlobalTree:
        """The tree with every output it holds indexed (outputs are indexed at the first lookup after they came)."""
        if self.unindexed:
            self._index()
        return self

    def may_hold(self, context: np.ndarray) -> bool:
        """False where no indexed output holds the context's last two tokens (the C++ index's filter); True where
        one may."""
        return bool(self.pair_filter[(int(context[-2]) * _PAIR_MULTIPLIER + int(context[-1])) & _PAIR_MASK])

    def candidates(self, context: np.ndarray) -> array | None:
        """The end positions of the context's last two tokens (some may be evicted: PAD now); None if none (the
        Python index's)."""
        assert self.native_index is None, "a tree indexed in C++ is searched there: NativeDraft.from_tree"
        if len(context) < 3:
            return None
        return self.indexed().pairs.get((int(context[-2]), int(context[-1])))

    def matches(self, context: np.ndarray) -> list[np.ndarray]:
        positions = self.candidates(context)
        if not positions:
            return []
        ends = np.array(positions, dtype=np.int64)
        ends = ends[(self.tokens[ends] == context[-1]) & (self.tokens[ends - 1] == context[-2])]  # evicted: PAD
        return suffix_matches(self.tokens, ends, context, 2, len(context) - 1)


class SuffixProposer:
    name = "suffix"

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1):
        self.max_depth = max_depth
        # a match of L >= 1 tokens leaves at most depth - L to propose: any larger factor allows the same
        self.max_spec_factor = min(max_spec_factor, max_depth)
        self.min_token_prob = min_token_prob
        self.tokens = RequestTokens(headroom=max_depth + 2)
        self._ceilings: dict[tuple[int, int], int] = {}
        self.native: NativeDraft | None = None
        kernels = None
        if NATIVE:
            from torch_shift.kernels import cpu_kernels

            kernels = cpu_kernels()
            self.native = NativeDraft(kernels) if kernels is not None else None
        self.global_tree = GlobalTree(max_depth, max_cached_requests, kernels)

    def propose(self, requests: list, max_tokens: list[int]) -> list[list[int]]:
        return [self.propose_one(request, k) for request, k in zip(requests, max_tokens)]

    def propose_one(self, request, max_tokens: int) -> list[int]:
        return self.draft(request, max_tokens).token_ids

    def draft(self, request, max_tokens: int) -> Draft:
        """The request's draft of at most `max_tokens` tokens, with its score."""
        buffer = self.tokens.read(request)
        return self.speculate(buffer.array[:buffer.num_tokens], buffer.array, max_tokens)

    def speculate(self, context_tokens: np.ndarray, padded: np.ndarray, max_tokens: int) -> Draft:
        """The draft for a request whose tokens are `context_tokens`, which is `padded[:n]` (`padded`: int64, PAD
        after them)."""
        context = context_tokens[-self.max_depth:]
        max_len = len(context) - 1  # as ArcticInference: the whole pattern is never the match
        if max_len < 1 or max_tokens <= 0:
            return Draft()
        # the context's own suffix is one occurrence of every length, with nothing after it: a length found only
        # there grows no path, nor does any longer one (min_count 2)
        if self.native is not None:
            padded_address = address(padded)
            context_address = padded_address + 8 * (len(context_tokens) - len(context))  # context ends the tokens
            local = self.native(padded_address, len(padded), len(context_tokens), context_address, len(context),
                                1, 2, self.max_depth, max_tokens, self.max_spec_factor, self.min_token_prob)
        else:
            ends = np.flatnonzero(context_tokens == context[-1])
            matches = suffix_matches(padded, ends, context, 1, max_len, min_count=2)
            local = best_draft(padded, matches, 1, self.max_depth, max_tokens, self.max_spec_factor,
                               self.min_token_prob)
        # the global tree's draft replaces the request's own only if it scores more: not searched where none could
        # (the local path took the most tokens any match allows, each with probability 1: repeated text)
        if self.global_tree.num_cached == 0 or local.score >= self._ceiling(max_len, max_tokens):
            return local
        tree = self.global_tree
        if self.native is not None:
            if not tree.indexed().may_hold(context):
                return local
            remote = self.native.from_tree(tree, context_address, len(context), self.max_depth, max_tokens,
                                           self.max_spec_factor, self.min_token_prob, beat=local.score)
            if remote is None:
                return local
        else:
            remote = best_draft(tree.tokens, tree.matches(context), 2, self.max_depth, max_tokens,
                                self.max_spec_factor, self.min_token_prob, beat=local.score)
        return remote if remote.score > local.score else local

    def _ceiling(self, max_len: int, max_tokens: int) -> int:
        """The most a global tree's path can score for a context of max_len + 1 tokens (matches from 2 tokens)."""
        key = (max_len, max_tokens)
        if key not in self._ceilings:
            self._ceilings[key] = max((path_limit(n, self.max_depth, max_tokens, self.max_spec_factor)
                                       for n in range(2, max_len + 1)), default=0)
        return self._ceilings[key]

    def on_finish(self, request, cache: bool) -> None:
        self.tokens.drop(request.request_id)
        if cache:
            self.global_tree.add(request.output_token_ids)
