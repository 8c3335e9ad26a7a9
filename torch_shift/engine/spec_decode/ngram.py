"""N-gram proposals (prompt lookup decoding), as vLLM defines them: the longest suffix of the context of
`prompt_lookup_min` to `prompt_lookup_max` tokens that occurred earlier in the context (the earliest
occurrence among the longest), and up to k tokens that followed it there."""

from __future__ import annotations

import numpy as np

from torch_shift.engine.spec_decode.suffix import suffix_matches
from torch_shift.engine.spec_decode.tokens import RequestTokens


def ngram_proposal(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    total = len(tokens)
    if k <= 0 or total <= min_n:
        return []
    # occurrences of the last token that end before it (something follows them), narrowed one token further back
    # at a time: matches[L - 1] are the end positions of the context's last L tokens
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    matches = suffix_matches(tokens, ends, tokens, 1, min(max_n, total - 1))
    if len(matches) < min_n:
        return []
    start = int(matches[-1][0]) + 1  # the earliest occurrence of the longest
    return tokens[start:start + k].tolist()


class NgramProposer:
    name = "ngram"

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n
        self.tokens = RequestTokens(headroom=0)

    def propose(self, requests: list, max_tokens: list[int]) -> list[list[int]]:
        return [self.propose_one(request, k) for request, k in zip(requests, max_tokens)]

    def propose_one(self, request, max_tokens: int) -> list[int]:
        buffer = self.tokens.read(request)
        return ngram_proposal(buffer.array[:buffer.num_tokens], self.min_n, self.max_n, max_tokens)

    def on_finish(self, request, cache: bool) -> None:
        self.tokens.drop(request.request_id)
