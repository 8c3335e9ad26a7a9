"""OpenAI response pieces: completion and chat logprobs, text offsets, streamed deltas, SSE lines."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from torch_shift.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from torch_shift.tokenizer import IncrementalDetokenizer, Tokenizer

_MIN_LOGPROB = -9999.0  # as vLLM: JSON has no -Infinity


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def prompt_text(out: RequestOutput, tokenizer: Tokenizer | None) -> str:
    if out.prompt is not None:
        return out.prompt
    return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    return tokenizer.token_to_str(token_id) if tokenizer is not None else str(token_id)


def _logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def _top(entry: PositionLogprobs, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of a position and their logprobs (the chosen token too, only if among them); k = -1:
    every token's (vLLM's)."""
    k = len(entry) if k < 0 else k
    ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k)
    return [(t, _logprob(logprob)) for _, t, logprob in ranked]


def token_bytes(tokenizer: Tokenizer | None, token_id: int) -> list[int]:
    return list(tokenizer.token_bytes(token_id) if tokenizer is not None else str(token_id).encode())


def prompt_offsets(tokenizer: Tokenizer | None, text: str, token_ids: list[int]) -> list[int]:
    """Where each prompt token starts in the echoed prompt text. A special token the tokenizer adds (a bos)
    takes no characters of the text, so it starts at 0 like the token after it."""
    if tokenizer is None:
        return TextOffsets(None, [], 0, True).extend(token_ids)
    encoding = tokenizer.backend.encode(text, add_special_tokens=True)
    ids, starts = list(encoding.ids), [start for start, _ in encoding.offsets]
    if ids != token_ids and tokenizer.bos_token_id is not None and [tokenizer.bos_token_id] + ids == token_ids:
        ids, starts = token_ids, [0] + starts  # a bos Tokenizer.encode prepends itself
    if ids == token_ids:
        return starts
    return TextOffsets(tokenizer, [], 0, True).extend(token_ids)  # ids that are not this text's encoding


class TextOffsets:
    """Where each generated token starts in a choice's text (`start` characters come before the completion),
    token by token as the engine's detokenizer makes the text: a token that completes no character yet, or
    a skipped special token, starts where the next one does."""

    def __init__(self, tokenizer: Tokenizer | None, context_ids: list[int], start: int, skip_special_tokens: bool):
        self.start = start
        self._detokenizer = IncrementalDetokenizer(tokenizer, context_ids, skip_special_tokens) if tokenizer else None
        self._length = 0  # without a tokenizer a token's text is its id

    def extend(self, token_ids: list[int]) -> list[int]:
        offsets = []
        for token_id in token_ids:
            if self._detokenizer is not None:
                offsets.append(self.start + len(self._detokenizer.output_text))
                self._detokenizer.step(token_id)
            else:
                offsets.append(self.start + self._length)
                self._length += len(str(token_id))
        return offsets


def completion_logprobs(token_ids: list[int], entries: list[PositionLogprobs | None], offsets: list[int],
                        tokenizer: Tokenizer | None, k: int) -> dict:
    tokens, token_logprobs, tops = [], [], []
    for token_id, entry in zip(token_ids, entries):
        tokens.append(token_text(tokenizer, token_id))
        token_logprobs.append(None if entry is None else _logprob(entry[token_id].logprob))  # first prompt token
        if entry is None:
            tops.append(None)
            continue
        top = {token_text(tokenizer, t): logprob for t, logprob in _top(entry, k)}
        top.setdefault(tokens[-1], token_logprobs[-1])  # the chosen token too, outside the top k (k + 1 entries)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[PositionLogprobs], tokenizer: Tokenizer | None, k: int) -> dict:
    content = []
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id)
        top = [{"token": token_text(tokenizer, t), "logprob": lp, "bytes": token_bytes(tokenizer, t)}
               for t, lp in _top(entry, k)]
        content.append({"token": text, "logprob": _logprob(entry[token_id].logprob),
                        "bytes": token_bytes(tokenizer, token_id), "top_logprobs": top})
    return {"content": content}


@dataclass
class EchoedPrompt:
    """What echo puts before a choice's completion: the prompt's text and, with logprobs, its tokens."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    entries: list[PositionLogprobs | None] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, out: RequestOutput, tokenizer: Tokenizer | None, with_logprobs: bool) -> EchoedPrompt:
        text = prompt_text(out, tokenizer)
        if not with_logprobs:
            return cls(text)
        ids = out.prompt_token_ids
        entries = list(out.prompt_logprobs or [None] * len(ids))
        return cls(text, ids, entries, prompt_offsets(tokenizer, text, ids))


def vllm_prompt_logprobs(out: RequestOutput, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a completion choice: per prompt position (None at the first) its token and the k
    most likely ones (-1: all computed), keyed by token id, each {"logprob", "rank", "decoded_token"}."""
    result: list[dict | None] = []
    for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs or []):
        if entry is None:
            result.append(None)
            continue
        result.append({str(t): {"logprob": _logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                       for t, lp in entry.items()
                       if t == token_id or k == -1 or (lp.rank is not None and lp.rank <= k)})
    return result


def completion_choice(index: int, out: RequestOutput, c: CompletionOutput, *, echo: bool, echo_only: bool,
                      logprobs: int | None, skip_special_tokens: bool, tokenizer: Tokenizer | None,
                      prompt_logprobs: int | None = None) -> dict:
    """`prompt_logprobs`: how many of each prompt position's top logprobs to return (vLLM's field; None: none)."""
    text = "" if echo_only else c.text
    token_ids = [] if echo_only else c.token_ids
    entries = [] if echo_only else list(c.logprobs or [])
    prefix = EchoedPrompt.of(out, tokenizer, logprobs is not None) if echo else EchoedPrompt()
    choice_logprobs = None
    if logprobs is not None:
        offsets = TextOffsets(tokenizer, out.prompt_token_ids, len(prefix.text), skip_special_tokens).extend(token_ids)
        choice_logprobs = completion_logprobs(prefix.token_ids + token_ids, prefix.entries + entries,
                                              prefix.offsets + offsets, tokenizer, logprobs)
    choice = {"index": index, "text": prefix.text + text, "logprobs": choice_logprobs,
              "finish_reason": "length" if echo_only else c.finish_reason,
              "stop_reason": None if echo_only else c.stop_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(out, prompt_logprobs)
    return choice


@dataclass
class Delta:
    choice: CompletionOutput
    text: str
    token_range: tuple[int, int]
    first: bool  # the choice's first delta


@dataclass
class DeltaTracker:
    """What each choice of one engine request has sent so far (an unfinished output's text leaves out what a stop
    string may still cut: SamplingParams.output_text_buffer_length)."""

    sent_chars: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)  # choices whose last delta was sent

    def deltas(self, out: RequestOutput) -> list[Delta]:
        """The new part of each choice; a finished choice once (an n > 1 request's outputs carry the
        choices that finished while the others go on)."""
        result = []
        for c in out.outputs:
            if c.index in self.finished:
                continue
            end = len(c.text)
            first = c.index not in self.sent_tokens
            start = self.sent_chars.get(c.index, 0)
            t0, t1 = self.sent_tokens.get(c.index, 0), len(c.token_ids)
            if end > start or t1 > t0 or c.finish_reason is not None:
                if end > start:
                    self.sent_chars[c.index] = end
                self.sent_tokens[c.index] = t1
                result.append(Delta(c, c.text[start:max(start, end)], (t0, t1), first))
                if c.finish_reason is not None:
                    self.finished.add(c.index)
        return result
