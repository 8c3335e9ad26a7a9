"""A request's tokens as a numpy array kept in step with `Request.all_token_ids` by appending what is new (the
proposers read the context every step: converting the whole list each time would cost O(context))."""

from __future__ import annotations

import numpy as np

PAD = -1  # after the last token: never equal to a token id


class TokenBuffer:
    def __init__(self, token_ids: list[int], headroom: int):
        """`headroom`: PAD slots always kept after the last token (reads that run past the end see PAD)."""
        self.headroom = headroom
        self.array = np.full(max(64, 2 * (len(token_ids) + headroom)), PAD, dtype=np.int64)
        self.array[:len(token_ids)] = token_ids
        self.num_tokens = len(token_ids)

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """Catch up with `token_ids` (the same list, grown; rebuilt if it shrank); returns the tokens."""
        n, total = self.num_tokens, len(token_ids)
        if total < n:  # a stop string cut tokens off
            self.array[total:n] = PAD
            n = total
        if total > n:
            if total + self.headroom > len(self.array):
                grown = np.full(2 * (total + self.headroom), PAD, dtype=np.int64)
                grown[:n] = self.array[:n]
                self.array = grown
            self.array[n:total] = token_ids[n:]
        self.num_tokens = total
        return self.array[:total]


class RequestTokens:
    """Every running request's TokenBuffer, by request id, caught up with its tokens when read."""

    def __init__(self, headroom: int):
        self.headroom = headroom
        self.buffers: dict[str, TokenBuffer] = {}

    def read(self, request) -> TokenBuffer:
        buffer = self.buffers.get(request.request_id)
        if buffer is None:
            buffer = self.buffers[request.request_id] = TokenBuffer(request.all_token_ids, self.headroom)
        else:
            buffer.sync(request.all_token_ids)
        return buffer

    def drop(self, request_id: str) -> None:
        self.buffers.pop(request_id, None)
