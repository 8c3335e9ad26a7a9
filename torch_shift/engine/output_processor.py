"""Output processing: a step's logits into sampled tokens and logprobs (the sampler's glue), and the requests
that advanced into `RequestOutput`s (incremental detokenization, stop strings, finish reasons).

A stop string is found in the detokenized text, after the scheduler has advanced the request: `detokenize`
returns the requests a stop string ended, the engine finishes them in the scheduler (the output side never
reaches into it), and `make_outputs` then reports them finished.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from torch_shift.engine.input_processor import ParentRequest
from torch_shift.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput, RequestStateStats
from torch_shift.engine.request import Request, RequestStatus
from torch_shift.engine.sampler import Sampler, draw_uniforms, topk_logprobs
from torch_shift.engine.sampling_params import RequestOutputKind
from torch_shift.engine.scheduler import ScheduledRequest
from torch_shift.models.fused import argmax_lists, logits_rows
from torch_shift.models.native_decoder import LaunchedStep
from torch_shift.tokenizer import IncrementalDetokenizer, Tokenizer


class _Tracked:
    """A user request's outputs being built: a detokenizer and the text so far per sample."""

    def __init__(self, parent: ParentRequest, tokenizer: Tokenizer | None):
        self.parent = parent
        skip = parent.params.skip_special_tokens
        self.detokenizers = [IncrementalDetokenizer(tokenizer, parent.prompt_token_ids, skip) if tokenizer else None
                             for _ in parent.children]
        self.texts = [""] * len(parent.children)
        self.num_detokenized = [0] * len(parent.children)  # output tokens of each sample turned into text
        self.stops = StopStrings(parent.params.stop_strings) if parent.params.stop_strings else None
        self.final_only = parent.params.output_kind == RequestOutputKind.FINAL_ONLY  # (vLLM's output_kind)
        self.sent_finished: set[int] = set()  # samples whose finished output went out (several, streamed)


class StopStrings:
    """A request's stop strings, found in each step's new text on the engine's thread. A body may hold 100,000 of
    them: each length's strings are looked up in a dictionary, one slice per place the new text lets one end, or
    searched for one by one where that length has fewer strings than places (many distinct long lengths). Which one
    is found is vLLM's (0.32, `check_stop_strings`): the one that the new text completes earliest, as appending one
    character at a time would find it, ties broken by the request's list order."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.by_length: dict[int, dict[str, int]] = {}  # length -> stop string -> its first place in the list
        for place, stop in enumerate(stops):
            self.by_length.setdefault(len(stop), {}).setdefault(stop, place)

    def find(self, text: str, num_new: int) -> tuple[str, int] | None:
        """The stop string that ends first within the last `num_new` characters of `text`, and where it starts."""
        found = None  # (where it ends, its place in the list, where it starts)
        for length, places in self.by_length.items():
            first_start = max(0, len(text) - num_new - length + 1)
            if len(places) * (length + num_new) < num_new * length:  # fewer characters to search than to hash
                for stop, place in places.items():
                    start = text.find(stop, first_start)
                    if start != -1 and (found is None or (start + length, place) < found[:2]):
                        found = (start + length, place, start)
                continue
            for start in range(first_start, len(text) - length + 1):
                if found is not None and start + length > found[0]:
                    break  # every later place of this length ends later
                place = places.get(text[start:start + length])
                if place is not None:
                    if found is None or (start + length, place) < found[:2]:
                        found = (start + length, place, start)
                    break  # of one length (distinct strings), the first found ends first
        return None if found is None else (self.stops[found[1]], found[2])


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, sampler: Sampler, max_model_len: int | None = None):
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.max_model_len = max_model_len  # where a request stops: speculative checks end there
        self.requests: dict[str, _Tracked] = {}  # user request id -> its outputs being built
        self.sample_of: dict[str, tuple[_Tracked, int]] = {}  # scheduler request id -> (its parent, sample index)

    def add(self, parent: ParentRequest) -> None:
        tracked = _Tracked(parent, self.tokenizer)
        self.requests[parent.request_id] = tracked
        for i, child in enumerate(parent.children):
            self.sample_of[child.request_id] = (tracked, i)

    def remove(self, request_id: str) -> ParentRequest | None:
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return None
        for child in tracked.parent.children:
            self.sample_of.pop(child.request_id, None)
        return tracked.parent

    # -- sampling -----------------------------------------------------------------------------------------
    def sample(self, entries_by_group: list[list[ScheduledRequest]],
               logits_by_group: list) -> dict[str, int | list[int]]:
        """The tokens each sampling request draws from its logits rows (groups in plan order, entries in the
        order of their logits rows): one (an int), or for a request with proposed tokens the list of the
        accepted ones and one more; logprobs and prompt logprobs are recorded on the requests. A drawn token is
        an int, not a list of one, because 256 lists alive at once per step made Python's collector run at
        every step (bench_engine, issue 21)."""
        rows: list[torch.Tensor] = []
        sample_requests: list[Request] = []
        checks: list[tuple[Request, list[int], torch.Tensor]] = []  # speculative: proposals and their logits
        for entries, logits in zip(entries_by_group, logits_by_group):
            if logits is None:
                continue
            if not any(e.prompt_logprobs or e.spec_token_ids for e in entries):  # one row per sampled request
                rows.append(logits)
                sample_requests.extend(e.request for e in entries if e.sample)
                continue
            row = 0
            sample_rows = []  # one index_select for the group's other sampling requests, not a slice each
            for e in entries:
                n = e.num_tokens if e.prompt_logprobs or e.spec_token_ids else int(e.sample)
                if e.prompt_logprobs:
                    self._record_prompt_logprobs(e.request, e.num_computed_tokens, logits[row:row + n])
                if e.spec_token_ids:
                    checks.append((e.request, e.spec_token_ids, logits_rows(logits, row, row + n)))
                elif e.sample:
                    sample_rows.append(row + n - 1)
                    sample_requests.append(e.request)
                row += n
            if sample_rows:
                rows.append(logits[torch.tensor(sample_rows, device=logits.device)])
        if checks:
            return self._sample_and_check(rows, sample_requests, checks)
        if not sample_requests:
            return {}
        token_ids = self._draw(rows, sample_requests)
        return {r.request_id: t for r, t in zip(sample_requests, token_ids)}

    def draws(self, entries_by_group: list[list[ScheduledRequest]]) -> np.ndarray | None:
        """What the requests that sample in a step about to run draw with (Sampler.draws), in sample_on_device's
        order, before the step: a step launched on the C++ decoder's thread draws its tokens with them."""
        requests = [e.request for entries in entries_by_group for e in entries if e.sample]
        return self.sampler.draws(requests) if requests else None

    def run_draws(self, entries: list[ScheduledRequest], num_steps: int
                  ) -> tuple[np.ndarray, Callable[[int], None]] | None:
        """What a multi-step run's group draws with in each step (Sampler.run_draws) and the function that rewinds
        the generators to the steps it ran; None where every request draws its argmax."""
        requests = [e.request for e in entries]
        if all(r.draws_argmax for r in requests):
            return None
        return self.sampler.run_draws(requests, num_steps)

    def sample_on_device(self, entries_by_group: list[list[ScheduledRequest]], logits_by_group: list,
                         launched: LaunchedStep | None = None, draws: np.ndarray | None = None
                         ) -> tuple[list[Request], torch.Tensor | None]:
        """The requests that sample this step (groups in plan order) and their tokens, left on the device
        (asynchronous scheduling: every request samples on the device; no prompt logprobs, no proposals).
        `launched`: the step still runs on the C++ decoder's thread; where it draws the tokens as it ends (every
        request draws its argmax, or the step was launched with `draws`, those of `self.draws`), its tokens are the
        rows that thread writes, else the step is waited for."""
        rows, requests = [], []
        for entries, logits in zip(entries_by_group, logits_by_group):
            if logits is not None:
                rows.append(logits)
                requests.extend(e.request for e in entries if e.sample)
        if not requests:
            return [], None
        if launched is not None:
            if rows[0].shape[1] == self.sampler.vocab_size and (
                    launched.draws is not None or all(r.draws_argmax for r in requests)):
                assert launched.draws is draws, "a launched step draws with the step's draws"
                return requests, torch.from_numpy(launched.row_argmax)
            launched.synchronize()
        logits = rows[0] if len(rows) == 1 else torch.cat(rows)
        return requests, self.sampler.sample_on_device(logits, requests, draws)

    def _draw(self, rows: list[torch.Tensor], requests: list[Request]) -> list[int]:
        """One token per row, drawn for its request (logprobs recorded)."""
        result = self.sampler(rows[0] if len(rows) == 1 else torch.cat(rows), requests)
        for request, token_id, lp in zip(requests, result.token_ids, result.logprobs):
            if lp is not None:
                chosen_lp, rank, top_ids, top_lps = lp
                request.logprobs.append(self._position_logprobs(token_id, chosen_lp, rank, top_ids, top_lps,
                                                                request.output_token_ids[-4:]))
                request.cumulative_logprob += chosen_lp
        return result.token_ids

    def _sample_and_check(self, rows: list[torch.Tensor], sample_requests: list[Request],
                          checks: list[tuple[Request, list[int], torch.Tensor]]) -> dict[str, int | list[int]]:
        """Speculative decoding's verification. At each proposed position the request draws its token exactly as
        it would without speculation (its penalties, grammar and seed see the tokens before it), and the proposal
        is accepted when the draw equals it; the first draw that differs is kept and ends the check. With a
        proposer whose proposal is one token (not a distribution), this is the accept/resample rule of
        speculative sampling (accept with probability p(x), else draw from p without x, renormalized): the output
        distribution is the model's, and a seeded request draws the same tokens with speculation as without."""
        out: dict[str, int | list[int]] = {}
        if self._check_greedily(checks, out):
            if sample_requests:
                out.update(zip((r.request_id for r in sample_requests), self._draw(rows, sample_requests)))
            return out
        independent, dependent = [], []
        for check in checks:
            (independent if _position_independent(check[0]) else dependent).append(check)
        if independent:
            out = self._check_in_one_draw(rows, sample_requests, independent)
            rows, sample_requests, checks = [], [], dependent
        alive = list(range(len(checks)))
        position = 0
        while alive:
            requests = sample_requests + [checks[i][0] for i in alive]
            drawn = self._draw(rows + [checks[i][2][position:position + 1] for i in alive], requests)
            for request, token in zip(sample_requests, drawn):
                out[request.request_id] = token
            sample_requests, rows = [], []
            still = []
            for i, token in zip(alive, drawn[len(drawn) - len(alive):]):
                request, proposed, _ = checks[i]
                # the request sees its tokens so far while the next positions are drawn; taken off again below
                request.append_output_token(token)
                out.setdefault(request.request_id, []).append(token)
                if (position < len(proposed) and token == proposed[position]
                        and request.check_stop(self._max_model_len) is None):
                    still.append(i)
            alive = still
            position += 1
        for request, _, _ in checks:
            _take_back(request, len(out[request.request_id]))
        return out

    def _check_greedily(self, checks, out: dict[str, int | list[int]]) -> bool:
        """Requests that decode greedily with nothing that depends on the tokens before a position (no
        penalties, grammar, minimum length or logprobs) are checked with one argmax over all their positions."""
        for request, _, _ in checks:
            p = request.sampling_params
            if not p.greedy or p.logit_bias or not _position_independent(request):
                return False
        best = argmax_lists([logits for _, _, logits in checks], self.sampler.vocab_size)
        start = 0
        for request, proposed, logits in checks:
            out[request.request_id] = self._accepted(request, proposed, best[start:start + len(logits)])
            start += len(logits)
        return True

    def _check_in_one_draw(self, rows: list[torch.Tensor], sample_requests: list[Request],
                           checks: list[tuple[Request, list[int], torch.Tensor]]) -> dict[str, int | list[int]]:
        """Requests whose distribution at a position does not depend on the tokens drawn before it (no penalties,
        grammar, minimum length or logprobs) draw at every position in one sampler call; a draw past the first
        that differs from its proposal is discarded. A seeded request's generator is then set back to where
        drawing position by position leaves it (one draw per kept token), so its tokens stay those it draws
        without speculation."""
        saved = {request.request_id: request.generator.get_state()
                 for request, _, _ in checks if request.generator is not None}
        requests = sample_requests + [request for request, _, logits in checks for _ in range(len(logits))]
        drawn = self._draw(rows + [logits for _, _, logits in checks], requests)
        out: dict[str, int | list[int]] = dict(zip((r.request_id for r in sample_requests), drawn))
        start = len(sample_requests)
        for request, proposed, logits in checks:
            tokens = out[request.request_id] = self._accepted(request, proposed, drawn[start:start + len(logits)])
            start += len(logits)
            if request.generator is not None and len(tokens) < len(logits):
                request.generator.set_state(saved[request.request_id])
                draw_uniforms(request.generator, len(tokens))
        return out

    def _accepted(self, request: Request, proposed, drawn: list[int]) -> list[int]:
        """The tokens a check keeps of the draws at its positions: up to the first that differs from its
        proposal, or that ends the request."""
        tokens = []
        for position, token in enumerate(drawn):
            request.append_output_token(token)
            tokens.append(token)
            if (position >= len(proposed) or token != proposed[position]
                    or request.check_stop(self._max_model_len) is not None):
                break
        _take_back(request, len(tokens))
        return tokens

    @property
    def _max_model_len(self) -> int:
        return self.max_model_len if self.max_model_len is not None else 1 << 62

    def _record_prompt_logprobs(self, request: Request, first_position: int, logits: torch.Tensor) -> None:
        """Row j of `logits` predicts the token at position first_position + j + 1."""
        recorded = request.prompt_logprobs
        start = len(recorded) - 1 - first_position  # first row not yet recorded (after a preemption)
        stop = min(logits.shape[0], request.num_prompt_tokens - 1 - first_position)
        if stop <= start:
            return
        targets = torch.tensor(request.prompt_token_ids[first_position + start + 1:first_position + stop + 1],
                               device=logits.device)
        logprobs = torch.log_softmax(logits[start:stop].float(), dim=-1)
        k = request.sampling_params.prompt_logprobs
        chosen, ranks, top_ids, top_lps = topk_logprobs(logprobs, targets, k)
        for j in range(len(chosen)):
            position = first_position + start + 1 + j
            # the prompt tokens before it that have entries (the first has none), as vLLM's context
            context = request.prompt_token_ids[max(1, position - 4):position]
            recorded.append(self._position_logprobs(int(targets[j]), chosen[j], ranks[j], top_ids[j], top_lps[j],
                                                    context))

    def _position_logprobs(self, token_id: int, logprob: float, rank: int, top_ids: list[int],
                           top_lps: list[float], context: list[int]) -> PositionLogprobs:
        """`context`: the sequence's tokens before the position (up to 4), which complete a token's partial
        UTF-8 character."""
        entry = {token_id: Logprob(logprob, rank, self._decoded_token(token_id, context))}
        for r, (t, lp) in enumerate(zip(top_ids, top_lps), start=1):
            if t not in entry:
                entry[t] = Logprob(lp, r, self._decoded_token(t, context))
        return entry

    def _decoded_token(self, token_id: int, context: list[int]) -> str | None:
        """A logprob entry's text, as vLLM 0.32 gives it (`LogprobsProcessor._correct_decoded_token`): a token that
        ends a multi-byte character begun by the tokens before it is that character ("é", not "\ufffd"), the
        tokens that begin it are "" (their bytes show in the one that completes it), and a token whose character
        is still incomplete is ""."""
        tok = self.tokenizer
        if tok is None:
            return None
        text = tok.token_to_str(token_id)
        if not text.endswith("\ufffd"):
            return text
        for num_context in range(1, len(context) + 1):
            before = context[-num_context:]
            whole = tok.decode([*before, token_id], skip_special_tokens=False)
            if whole.endswith("\ufffd"):
                continue
            # the context's tokens that are themselves partial characters give their bytes to this one
            clean = len(before)
            while clean > 0 and tok.token_to_str(before[clean - 1]).endswith("\ufffd"):
                clean -= 1
            prefix = tok.decode(before[:clean], skip_special_tokens=False) if clean else ""
            if whole.startswith(prefix):
                return whole[len(prefix):]
            return whole[len(os.path.commonprefix([prefix, whole])):]
        return ""

    # -- outputs ------------------------------------------------------------------------------------------
    def detokenize(self, updated: list[Request]) -> list[Request]:
        """Append each advanced request's new text; returns the running requests a stop string ended (the
        engine finishes them in the scheduler before `make_outputs`)."""
        stopped = []
        if self.tokenizer is None:  # token ids only: no detokenizer anywhere
            return stopped
        for request in updated:
            tracked, index = self.sample_of[request.request_id]
            if tracked.detokenizers[index] is not None and self._detokenize(tracked, index, request):
                stopped.append(request)
        return stopped

    def make_outputs(self, updated: list[Request], final_only: bool = False) -> list[RequestOutput]:
        """The outputs of the user requests that advanced, as vLLM's engine gives them: a request of one sample, or
        of several with FINAL_ONLY, as one output (with `final_only`, or FINAL_ONLY, only once finished, all its
        samples together); a request of several samples otherwise as one output per sample that advanced, each
        holding that sample alone (a finished sample is not sent again, and the request's outputs are `finished`
        from its last sample's last). A finished request is forgotten."""
        outputs = []
        whole: dict[str, _Tracked] = {}
        several: dict[str, tuple[_Tracked, list[int]]] = {}
        for request in updated:
            tracked, index = self.sample_of[request.request_id]
            if final_only or tracked.final_only or len(tracked.parent.children) == 1:
                if request.status.finished or not (final_only or tracked.final_only):
                    whole[tracked.parent.request_id] = tracked
                continue
            indices = several.setdefault(tracked.parent.request_id, (tracked, []))[1]
            if index not in tracked.sent_finished and index not in indices:
                indices.append(index)
        for request_id, (tracked, indices) in several.items():
            children = tracked.parent.children
            # a sample that ended in this step without advancing still gets its last output, and the request its end
            indices += [i for i, c in enumerate(children)
                        if c.status.finished and i not in tracked.sent_finished and i not in indices]
            for k, index in enumerate(indices):
                if children[index].status.finished:
                    tracked.sent_finished.add(index)
                finished = k == len(indices) - 1 and len(tracked.sent_finished) == len(children)
                if finished:
                    self.remove(request_id)
                outputs.append(self._output(tracked, [index], finished))
        for tracked in whole.values():
            finished = all(c.status.finished for c in tracked.parent.children)
            if finished:
                self.remove(tracked.parent.request_id)
            if finished or not (final_only or tracked.final_only):
                outputs.append(self._output(tracked, range(len(tracked.parent.children)), finished))
        return outputs

    def _detokenize(self, tracked: _Tracked, index: int, request: Request) -> bool:
        """Append the new tokens' text (several after accepted proposals); True when a stop string (found in it)
        ends a running request. Tokens after the one that completed a stop string are dropped, as decoding
        without speculation would never have drawn them."""
        detok = tracked.detokenizers[index]
        params = request.sampling_params
        outputs = request.output_token_ids
        first, num_outputs = tracked.num_detokenized[index], len(outputs)
        tracked.num_detokenized[index] = num_outputs
        text = tracked.texts[index]
        stopped = False
        # also where a stop token, the length or an error ended the request after the stop string (a check's later
        # token; or this token, with include_stop_str_in_output): not once a stop string was found
        searches = tracked.stops is not None and not (isinstance(request.stop_reason, str)
                                                      and request.status is not RequestStatus.FINISHED_ERROR)
        for i in range(first, num_outputs):
            token_id = outputs[i]
            last = i == num_outputs - 1
            # as in vLLM, the eos or stop token id that ended the request adds no text (unless
            # include_stop_str_in_output)
            ended_by_token = (last and request.status is RequestStatus.FINISHED_STOPPED
                              and not params.include_stop_str_in_output
                              and (token_id in request.eos_token_ids or token_id == request.stop_reason))
            new_text = "" if ended_by_token else detok.step(token_id)
            if last and request.status.finished:
                new_text += detok.flush()  # bytes held back for an unfinished character
            if not new_text:
                continue
            text += new_text
            # as in vLLM, stop strings count only once more than min_tokens tokens were generated
            found = (tracked.stops.find(text, len(new_text))
                     if searches and i + 1 > params.min_tokens else None)
            if found is not None:
                stop, idx = found
                text = text[: idx + len(stop)] if params.include_stop_str_in_output else text[:idx]
                request.stop_reason = stop
                if not last:
                    _take_back(request, num_outputs - i - 1, logprobs=True)
                    tracked.num_detokenized[index] = i + 1
                if request.status.finished:  # the token that ended it otherwise also completed the stop
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    stopped = True
                break
        tracked.texts[index] = text
        if searches:
            request.holds_text = detok.holds_text
        return stopped

    def _output(self, tracked: _Tracked, indices, finished: bool) -> RequestOutput:
        """The request's output holding its samples `indices`."""
        parent = tracked.parent
        completions = []
        for i in indices:
            child = parent.children[i]
            finish = child.status.value if child.status.finished else None
            text, held = tracked.texts[i], child.sampling_params.output_text_buffer_length
            completions.append(CompletionOutput(
                index=i,
                text=text[:-held] if held and finish is None else text,  # a stop string's start may still be cut
                token_ids=list(child.output_token_ids),
                cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
                logprobs=child.logprobs,
                finish_reason=finish,
                stop_reason=child.stop_reason,
            ))
        first = parent.children[indices[0]]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.children[0].prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=RequestStateStats(
                num_generation_tokens=max(len(c.token_ids) for c in completions),
                num_preemptions=first.num_preemptions,
                arrival_time=first.arrival_time,
                queued_ts=first.queued_time,
                scheduled_ts=first.first_scheduled_time or 0.0,
                first_token_ts=first.first_token_time or 0.0,
                last_token_ts=first.last_token_time or 0.0,
                first_token_latency=(first.first_token_time - first.queued_time
                                     if first.first_token_time is not None else 0.0)),
        )


def _position_independent(request: Request) -> bool:
    """Whether the request's distribution at a position is the same whatever it drew before (within one check)."""
    p = request.sampling_params
    return (request.grammar is None and request.waiting_grammar is None and p.logprobs is None
            and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and request.num_output_tokens >= p.min_tokens)


def _take_back(request: Request, num_tokens: int, logprobs: bool = False) -> None:
    """Remove the request's last `num_tokens` output tokens (with `logprobs`, their logprobs too)."""
    if num_tokens <= 0:
        return
    del request.output_token_ids[-num_tokens:]
    del request.all_token_ids[-num_tokens:]
    if logprobs and request.logprobs is not None and len(request.logprobs) > len(request.output_token_ids):
        for position in request.logprobs[len(request.output_token_ids):]:
            request.cumulative_logprob -= next(iter(position.values())).logprob
        del request.logprobs[len(request.output_token_ids):]
