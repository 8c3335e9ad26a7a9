"""Batched sampling: logit bias, penalties, grammar masks, temperature, top-k/top-p/min-p, per-request seeds, logprobs.

Every operation runs on the whole batch; the only host transfer is the final one of the
sampled ids (and of the logprobs asked for). A seeded request draws from its own
generator, so its tokens do not depend on what else is in the batch.

Each row draws by the inverse CDF from one uniform, which its generator gives before the logits exist. On the CPU
the draw from the (biased, penalized, masked) logits is one C++ kernel (models.fused.sample_rows: temperature,
top-k, top-p, min-p and the inverse CDF in one pass), which the C++ decoder's launched steps also run as they end, so
that a sampled request's steps run ahead of the host as a greedy one's do (asynchronous scheduling; `draws`);
elsewhere, PyTorch's operators.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from torch_shift.engine.request import Request
from torch_shift.engine.structured_output import grammar_mask, start_waiting_grammars
from torch_shift.kernels import cpu_kernels
from torch_shift.memory import to_device
from torch_shift.models.fused import argmax, argmax_list, sample_rows

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: (sampled token logprob, its rank, top-k ids, top-k logprobs) when logprobs were asked
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


def topk_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[list, list, list, list]:
    """For each row: logprob of `chosen`, its rank (1 = best), and the top-k ids and logprobs."""
    chosen_lp = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > chosen_lp).sum(dim=1) + 1
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=1)
    else:
        top_lp = top_ids = logprobs.new_empty((logprobs.shape[0], 0))
    return chosen_lp[:, 0].tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist()


class Sampler:
    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # for requests without a seed, per device

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [len(requests), vocab] for the position after each request's last token."""
        if all(r.draws_argmax for r in requests):
            if logits.shape[1] != self.vocab_size:  # a padded vocabulary (a slice is a call, even when it is whole)
                logits = logits[:, : self.vocab_size]
            return SamplerOutput(argmax_list(logits), [None] * len(requests))
        logits = logits[:, : self.vocab_size].float()
        params = [r.sampling_params for r in requests]
        want_logprobs = [p.logprobs for p in params]
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if constrained:
            allowed = grammar_mask([requests[i].grammar for i in constrained], logits.shape[1])
            for row, i in enumerate(constrained):
                if requests[i].grammar.is_error():  # e.g. a lexer past its limits: the request ends with "error"
                    _grammar_failed(requests[i])
                    allowed[row] = True  # its mask holds no token; the token drawn is not output (Scheduler)
            allowed = allowed.to(logits.device)
            logits = logits.clone()
            logits[constrained] = logits[constrained].masked_fill(~allowed, _NEG_INF)
        # vLLM's raw logprobs: the grammar's mask applied (vLLM masks the logits before its sampler), the bias and
        # penalties not
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want_logprobs) else None
        logits = self._apply_logit_bias(logits, params)
        logits = self._apply_penalties(logits, requests)
        greedy = [p.greedy for p in params]
        if all(greedy):
            sampled = argmax(logits)
        else:
            sampled = self._sample(logits, requests, greedy)

        token_ids = sampled.tolist()
        for i in constrained:
            request = requests[i]
            if request.error is None and (not request.grammar.consume_token(token_ids[i]) or request.grammar.is_error()):
                _grammar_failed(request)
        start_waiting_grammars(requests, token_ids)
        row_logprobs: list = [None] * len(requests)
        if raw_logprobs is not None:
            rows = [i for i, k in enumerate(want_logprobs) if k is not None]
            k_max = max(want_logprobs[i] for i in rows)
            idx = torch.tensor(rows, device=logits.device)
            chosen, ranks, top_ids, top_lps = topk_logprobs(raw_logprobs[idx], sampled[idx], k_max)
            for j, i in enumerate(rows):
                k = want_logprobs[i]
                row_logprobs[i] = (chosen[j], ranks[j], top_ids[j][:k], top_lps[j][:k])
        return SamplerOutput(token_ids, row_logprobs)

    def sample_on_device(self, logits: torch.Tensor, requests: list[Request],
                         draws: np.ndarray | None = None) -> torch.Tensor:
        """The tokens of requests that sample on the device (`Request.samples_on_device`: no penalty, minimum
        length, grammar or logprobs), left there: nothing waits for the device (asynchronous scheduling).
        `draws`: what `draws` returned for them before the step, whose uniforms they draw with."""
        assert all(r.samples_on_device for r in requests)
        if all(r.draws_argmax for r in requests):
            return argmax(logits[:, : self.vocab_size])
        params = [r.sampling_params for r in requests]
        logits = self._apply_logit_bias(logits[:, : self.vocab_size].float(), params)
        greedy = [p.greedy for p in params]
        return argmax(logits) if all(greedy) else self._sample(logits, requests, greedy, draws)

    def draws(self, requests: list[Request]) -> np.ndarray | None:
        """What the rows of `requests` (which sample on the device) draw with on the CPU, fixed before their logits
        exist: float32 [5, rows] for models.fused.sample_rows, each row's uniform taken from its generator now. The
        C++ decoder's thread draws a launched step's tokens with them as the step ends, and where the step was not
        launched, `sample_on_device` draws with them. None where every request draws its argmax, one has a logit
        bias (added to its logits on the host) or no kernel runs here."""
        if (all(r.draws_argmax for r in requests) or any(r.sampling_params.logit_bias for r in requests)
                or cpu_kernels() is None):
            return None
        return self._cpu_draws(requests, [r.greedy for r in requests])

    def run_draws(self, requests: list[Request], num_steps: int) -> tuple[np.ndarray, Callable[[int], None]]:
        """What the rows of a multi-step run's `requests` (which sample on the device without a logit bias, one of
        them at least not by argmax, on the CPU's kernel) draw with in each of its steps, float32 [num_steps, 5,
        rows]: what `draws` gives, for each step in order, taken now as single steps would take them before each;
        and a function of the steps the run ran that leaves the generators where that many single steps would."""
        generators = [self._generator(torch.device("cpu"))] + [r.generator for r in requests if r.generator is not None]
        states = [generator.get_state() for generator in generators]
        greedy = [r.greedy for r in requests]
        draws = np.stack([self._cpu_draws(requests, greedy) for _ in range(num_steps)])

        def rewind(steps_run: int) -> None:
            if steps_run < num_steps:
                for generator, state in zip(generators, states):
                    generator.set_state(state)
                for _ in range(steps_run):
                    self._uniforms(requests, torch.device("cpu"))

        return draws, rewind

    def _cpu_draws(self, requests: list[Request], greedy: list[bool]) -> np.ndarray:
        params = [r.sampling_params for r in requests]
        draws = np.empty((5, len(requests)), dtype=np.float32)
        draws[0] = [0.0 if g else p.temperature for g, p in zip(greedy, params)]
        draws[1] = [max(p.top_k, 0) for p in params]
        draws[2] = [p.top_p for p in params]
        draws[3] = [p.min_p for p in params]
        draws[4] = self._uniforms(requests, torch.device("cpu"))[:, 0].numpy()
        return draws

    def _apply_logit_bias(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, p in enumerate(params):
            if p.logit_bias:
                rows += [i] * len(p.logit_bias)
                cols += p.logit_bias.keys()
                values += p.logit_bias.values()
        if not rows:
            return logits
        device = logits.device
        index = (_to(device, rows, torch.long), _to(device, cols, torch.long))
        return logits.index_put(index, _to(device, values, logits.dtype), accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = []
        for i, r in enumerate(requests):
            p = r.sampling_params
            suppress = r.num_output_tokens < p.min_tokens and r.min_tokens_banned
            if suppress or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                rows.append(i)
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:
            r = requests[i]
            p = r.sampling_params
            row = logits[i]
            if p.repetition_penalty != 1.0:
                # Hugging Face / vLLM convention: over prompt and output tokens, shrink positive
                # logits and push negative ones further down.
                seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long, device=logits.device)
                seen = seen[seen < vocab]
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
                # OpenAI convention, over output tokens only.
                counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device),
                                        minlength=vocab)[:vocab]
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            if r.num_output_tokens < p.min_tokens:
                banned = [t for t in r.min_tokens_banned if t < vocab]
                row[banned] = _NEG_INF
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request], greedy: list[bool],
                draws: np.ndarray | None = None) -> torch.Tensor:
        """`draws`: the rows' parameters and uniforms (`draws`), else taken now."""
        device = logits.device
        if device.type == "cpu" and (draws is not None or cpu_kernels() is not None):
            if draws is None:
                draws = self._cpu_draws(requests, greedy)
            sampled = sample_rows(logits, draws)
            if sampled is not None:
                return sampled
            uniform = torch.from_numpy(draws[4].copy())[:, None]
        else:
            uniform = self._uniforms(requests, device)
        params = [r.sampling_params for r in requests]
        temperature = _to(device, [1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32)
        logits_t = logits / temperature[:, None]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if any(mp > 0.0 for mp in min_p):  # before top-k and top-p, as vLLM: top_p's mass is of what min_p keeps
            probs = torch.softmax(logits_t, dim=-1)
            mp = _to(device, min_p, torch.float32)[:, None]
            logits_t = logits_t.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, _NEG_INF)
        if any(k > 0 for k in top_k) or any(tp < 1.0 for tp in top_p):
            logits_t = _top_k_top_p(logits_t, top_k, top_p)
        probs = torch.softmax(logits_t, dim=-1)
        sampled = inverse_cdf(probs, uniform)
        if any(greedy):
            sampled = torch.where(_to(device, greedy, torch.bool), argmax(logits), sampled)
        return sampled

    def _uniforms(self, requests: list[Request], device: torch.device) -> torch.Tensor:
        """One uniform per row [rows, 1] on `device`: a seeded request's from its own generator, the others' from the
        sampler's. (Inverse CDF: torch's exponential_, for an exponential race, costs 20 ns per element on this CPU:
        0.17 ms per row at a vocabulary of 8192, more than the rest of sampling; docs/performance.md)"""
        uniform = torch.empty(len(requests), 1, dtype=torch.float32, device=device)
        unseeded = [i for i, r in enumerate(requests) if r.generator is None]
        if unseeded:
            generator = self._generator(device)
            if len(unseeded) == len(requests):
                uniform.uniform_(generator=generator)
            else:
                idx = _to(device, unseeded, torch.long)
                uniform[idx] = torch.empty(len(unseeded), 1, device=device).uniform_(generator=generator)
        seeded = [i for i, r in enumerate(requests) if r.generator is not None]
        if seeded:  # CPU generators: the same draws on any device
            draws = torch.cat([draw_uniforms(requests[i].generator, 1) for i in seeded])
            uniform[_to(device, seeded, torch.long)] = _to(device, draws[:, None], torch.float32)
        return uniform


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [rows, vocab] (unnormalized), the first token whose cumulative probability exceeds
    `uniform` [rows, 1] (in [0, 1]) times the row's total; never a token of probability 0."""
    cdf = probs.cumsum(dim=-1)  # float32, accumulated in float64 by torch on the CPU
    total = cdf[:, -1:].contiguous()
    sampled = torch.searchsorted(cdf, uniform * total, right=True)
    # where rounding puts u * total at the total: the last token with probability
    return torch.minimum(sampled, torch.searchsorted(cdf, total))[:, 0]


def draw_uniforms(generator: torch.Generator, num_rows: int) -> torch.Tensor:
    """What sampling `num_rows` rows of a seeded request takes from its generator, in the same order: one
    uniform per row (so several rows drawn at once leave the generator where drawing them one by one does)."""
    return torch.rand(num_rows, generator=generator)


def _to(device: torch.device, values, dtype: torch.dtype) -> torch.Tensor:
    """Host values (a list, or a CPU tensor) as a tensor on `device`; to a GPU through pinned memory
    (memory.to_device), without waiting for the work queued before (a copy from pageable memory waits for it)."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    (moved,) = to_device([host.numpy()], host.numpy().dtype, device)
    return moved.view(host.shape)


def _grammar_failed(request: Request) -> None:
    """The request ends with "error" once its step's tokens arrive; the token drawn in this step is not output."""
    why = (request.grammar.get_error() or "").replace("<non-verbose/>", "").strip()  # llguidance's marker
    request.error = f"the output could not be kept to its grammar: {why or 'token refused'}"


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    device = logits.device
    k = _to(device, [t if t > 0 else vocab for t in top_k], torch.long).clamp(max=vocab)
    positions = torch.arange(vocab, device=device)[None, :]
    remove = positions >= k[:, None]
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(sorted_logits.masked_fill(remove, _NEG_INF), dim=-1)
        cum_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        remove |= cum_before >= _to(device, top_p, torch.float32)[:, None]
        remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
