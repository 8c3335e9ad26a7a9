"""The draft-model method: a smaller checkpoint with the target's vocabulary proposes k tokens per request and
step by greedy decoding. It runs on rank 0, next to the scheduler (the process that drives every layout), whole
(it is small: a sharded draft would add a collective to each of its k forwards), with a paged KV cache and a
block pool of its own: its blocks follow the request's tokens, not the target's blocks, so it is the same under
every layout and family, and never takes a block from the target.

Each proposal round (after a step) batches every proposing request into the draft's forwards: first the tokens
the draft has not seen (a new request's prompt in chunks of at most `max_num_batched_tokens`, else the tokens
the last step accepted and the one it added), whose last logits give the first proposal, then k - 1 forwards of
one token per request. Proposals the target accepted were fed to the draft already: their KV is kept.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from torch_shift.attention import attention_backend as make_attention_backend
from torch_shift.attention.backend import AttentionBatch
from torch_shift.config import ModelConfig
from torch_shift.engine.decode_pool import DecodePool
from torch_shift.engine.spec_decode import ASK_AVERAGING
from torch_shift.engine.spec_decode.suffix import SuffixProposer
from torch_shift.kv.block_manager import BlockManager
from torch_shift.kv.cache import KVCache, available_memory_bytes, kv_bytes_per_block
from torch_shift.models.decoder import DecoderLM
from torch_shift.models.fused import argmax_list
from torch_shift.models.hub import resolve_model_dir
from torch_shift.models.linear import prepare_linears
from torch_shift.models.loader import load_model
from torch_shift.models.native_decoder import NativeDecoder

_DRAFT_KV_BUDGET_BYTES = 1 << 30  # the draft's pool at most, and at most an eighth of the memory available


@dataclass(frozen=True)
class DraftCheckpoint:
    """The draft's checkpoint, found and checked against the target's before either loads."""

    model_dir: Path
    config: ModelConfig

    @classmethod
    def resolve(cls, model: str, target: ModelConfig, target_tokenizer_dir: Path | None) -> DraftCheckpoint:
        try:
            model_dir = resolve_model_dir(model)
            config = ModelConfig.from_dir(model_dir)
        except (ValueError, OSError) as e:  # as the target's errors read, but naming the draft
            raise ValueError(f"speculative_config: the draft model {model!r}: {e}") from None
        if config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model {model!r} has a vocabulary of {config.vocab_size} "
                             f"tokens, the target {target.vocab_size}: a draft must share the target's tokenizer")
        ours, theirs = _vocabulary(target_tokenizer_dir), _vocabulary(model_dir)
        if ours is not None and theirs is not None and ours != theirs:
            raise ValueError(f"speculative_config: the draft model {model!r} has another tokenizer than the target "
                             "(tokenizer.json differs in its vocabulary or added tokens): a draft must share it")
        return cls(model_dir, config)


def _vocabulary(directory: Path | None) -> tuple | None:
    path = directory / "tokenizer.json" if directory is not None else None
    if path is None or not path.is_file():
        return None
    tokenizer = json.loads(path.read_text())
    return tokenizer.get("model", {}).get("vocab"), tokenizer.get("added_tokens")


def load_draft_proposer(draft: DraftCheckpoint, dtype: torch.dtype, device: torch.device, block_size: int,
                        max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                        attention_backend: str = "auto", prepack_weights: bool = True,
                        decode_pool: bool = True, native_decode: bool = True) -> DraftModelProposer:
    """The draft loaded on rank 0's device in the target's dtype, with a pool for every sequence slot filled to
    the context, or what a bounded budget holds (then requests past it propose nothing until blocks come free)."""
    model = load_model(draft.model_dir, dtype, device, draft.config.for_context(max_model_len))
    if prepack_weights:
        prepare_linears(model)
    per_block = DraftModelProposer.kv_bytes_per_block(model, block_size)
    enough = max_num_seqs * math.ceil(max_model_len / block_size)
    budget = min(_DRAFT_KV_BUDGET_BYTES, available_memory_bytes(device) // 8)
    num_blocks = max(min(enough, budget // per_block), math.ceil(max_model_len / block_size))
    return DraftModelProposer(model, num_blocks, block_size, max_num_batched_tokens, attention_backend, decode_pool,
                              native_decode)


@dataclass
class _DraftState:
    num_cached: int = 0  # the request's first tokens whose KV the draft holds
    fed_proposals: list[int] = field(default_factory=list)  # proposals fed after them (KV written, maybe wrong)


@dataclass
class _Run:
    """Tokens of one request in one forward of the draft."""

    index: int  # the request's index in the round
    request_id: str
    start: int  # position of the first token
    token_ids: list[int]
    wants_logits: bool


class DraftModelProposer:
    name = "draft_model"

    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int, max_num_batched_tokens: int,
                 attention_backend: str = "auto", decode_pool: bool = True, native_decode: bool = True):
        config = model.config
        self.model = model
        device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
        self.kv_cache = KVCache(config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                                config.head_dim, dtype, device)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.attention = make_attention_backend(attention_backend, device, dtype)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_positions = config.max_position_embeddings
        self.sliding_window = config.sliding_window
        self.device = device
        self.states: dict[str, _DraftState] = {}
        self.num_forwards = 0  # forwards run, over the proposer's life
        # the last call's forwards of one token a request (all but the first, which also feeds the unseen tokens):
        # their seconds and rows, what a request's proposal costs once the draft has seen its tokens
        self.last_decode_forwards = (0.0, 0)
        # its forwards of a few tokens, as the target's
        self.decode_pool = DecodePool(model, device, decode_pool, self.kv_bytes_per_block(model, 1))
        # and in one C++ call where the draft allows it (torch_shift.models.native_decoder)
        self.native = NativeDecoder.build(model) if native_decode and self.attention.name == "cpu" else None

    @staticmethod
    def kv_bytes_per_block(model: DecoderLM, block_size: int) -> int:
        config, weight = model.config, model.embed_tokens.weight
        return kv_bytes_per_block(config.num_hidden_layers, block_size, config.num_key_value_heads, config.head_dim,
                                  weight.dtype)

    def propose(self, requests: list, max_tokens: list[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in requests]
        rooms = [0] * len(requests)
        self.last_decode_forwards = (0.0, 0)
        pending: list[_Run] = []  # the tokens each request's draft has not seen, from its last cached one
        for i, (request, room) in enumerate(zip(requests, max_tokens)):
            tokens = request.all_token_ids
            n = len(tokens)
            state = self.states.setdefault(request.request_id, _DraftState())
            cached = min(state.num_cached, n)
            for token in state.fed_proposals:  # the proposals the step accepted were fed as they are
                if cached >= n or tokens[cached] != token:
                    break
                cached += 1
            cached = min(cached, n - 1)  # the last token goes in again: its logits give the first proposal
            state.num_cached, state.fed_proposals = cached, []
            room = min(room, self.max_positions - n)
            # the draft's slots: the unseen tokens and every proposal but the last, which is never fed
            if room <= 0 or not self.blocks.allocate(request.request_id, n + room - 1):
                continue  # no proposal this step: the draft's pool is full (or the draft's context ends)
            rooms[i] = room
            pending.append(_Run(i, request.request_id, cached, list(tokens[cached:]), True))
        if not pending:
            return proposals

        for runs in self._prefill_forwards(pending):
            for run, token in zip([r for r in runs if r.wants_logits], self._forward(runs)):
                proposals[run.index].append(token)
        start, rows = time.perf_counter(), 0
        for step in range(1, max(rooms)):
            runs = [_Run(i, requests[i].request_id, requests[i].num_tokens + step - 1, [proposals[i][-1]], True)
                    for i in range(len(requests)) if rooms[i] > step]
            rows += len(runs)
            for run, token in zip(runs, self._forward(runs)):
                proposals[run.index].append(token)
        self.last_decode_forwards = (time.perf_counter() - start, rows)
        for i, request in enumerate(requests):
            if rooms[i]:
                state = self.states[request.request_id]
                state.num_cached = request.num_tokens
                state.fed_proposals = proposals[i][:-1]
        return proposals

    def on_finish(self, request, cache: bool) -> None:
        self.states.pop(request.request_id, None)
        self.blocks.free(request.request_id)

    def _prefill_forwards(self, pending: list[_Run]) -> list[list[_Run]]:
        """The unseen tokens cut into forwards of at most max_num_batched_tokens; a run that is cut wants no
        logits but in its last piece."""
        forwards: list[list[_Run]] = [[]]
        room = self.max_num_batched_tokens
        for run in pending:
            start, token_ids = run.start, run.token_ids
            while token_ids:
                if room == 0:
                    forwards.append([])
                    room = self.max_num_batched_tokens
                piece = token_ids[:room]
                token_ids = token_ids[len(piece):]
                forwards[-1].append(_Run(run.index, run.request_id, start, piece, not token_ids))
                start += len(piece)
                room -= len(piece)
        return forwards

    @torch.inference_mode()
    def _forward(self, runs: list[_Run]) -> list[int]:
        """One forward of the draft over `runs`; the greedy next token of each run that wants logits, in order."""
        # the attention backends take the runs of one token first
        order = sorted(range(len(runs)), key=lambda r: len(runs[r].token_ids) > 1)
        runs = [runs[r] for r in order]
        query_len = np.array([len(r.token_ids) for r in runs], dtype=np.int64)
        starts = np.array([r.start for r in runs], dtype=np.int64)
        query_start = np.cumsum(query_len) - query_len
        tables = [self.blocks.block_table(r.request_id) for r in runs]
        block_table = np.zeros((len(runs), max(map(len, tables))), dtype=np.int32)
        for row, table in enumerate(tables):
            block_table[row, :len(table)] = table
        run_of_token = np.repeat(np.arange(len(runs)), query_len)
        positions = starts[run_of_token] + np.arange(int(query_len.sum())) - query_start[run_of_token]
        block_size = self.blocks.block_size
        slots = block_table[run_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
        wants = np.array([r.wants_logits for r in runs])
        logits_indices = (query_start + query_len - 1)[wants]

        def tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(self.device)

        positions_t = tensor(positions)
        batch = AttentionBatch(
            num_decodes=int((query_len == 1).sum()), query_start=query_start.astype(np.int32),
            query_len=query_len.astype(np.int32), num_computed=starts.astype(np.int32), block_table=block_table,
            block_table_rows=np.arange(len(runs), dtype=np.int32), tokens_per_block=block_size,
            slot_mapping=tensor(slots), positions=positions_t, sliding_window=self.sliding_window)
        input_ids = tensor(np.fromiter((t for r in runs for t in r.token_ids), dtype=np.int64))
        attention = self.attention.build(batch, self.kv_cache)
        self.decode_pool.step(len(input_ids), int(starts.sum()))
        self.num_forwards += 1
        logits = None
        if self.native is not None and self.native.runs(len(input_ids), attention):
            logits = self.native(input_ids, positions_t, tensor(logits_indices), attention)
        if logits is None:
            hidden = self.model(input_ids, positions_t, attention, tensor(logits_indices))
            logits = self.model.compute_logits(hidden) if len(logits_indices) else None
        if not len(logits_indices):
            return []
        next_tokens = argmax_list(logits)
        # back to the callers' order of runs
        wanted_order = [order[r] for r in range(len(runs)) if runs[r].wants_logits]
        return [token for _, token in sorted(zip(wanted_order, next_tokens))]


# The draft model's acceptance beside suffix decoding: checks of its proposals, decayed by this per check (a window
# of about a hundred), and how many before they replace ArcticInference's assumption that it keeps all its k tokens
DRAFT_CHECK_DECAY = 0.99
DRAFT_CHECKS_BEFORE_ESTIMATE = 8
# of the propose calls' steps' time, about, spent asking the draft model for one request while the goodput budget finds
# its forwards dearer than what they keep, so that its checks keep saying what it keeps (a draft agrees with the target
# more on some text): such a call first feeds the draft what it has not seen, often a new request's whole prompt (6-20
# ms on the agent loop's turns against steps of 2-3 ms: one call in 32 took 5-12% of the time, docs/performance.md), so
# they are paid from a credit of this share of each call's step, and one runs once the credit covers what the last
# draft-model call took
DRAFT_EXPLORE_SHARE = 0.02


class SuffixBesideDraftProposer:
    """Suffix decoding beside a draft model (`enable_suffix_decoding`; paper 002): per request and step, the suffix
    trees' draft where its score, the expected number of its tokens a check keeps, reaches what the draft model's
    proposal is expected to keep; the draft model's greedy tokens for the others, batched. ArcticInference's model
    runner expects the draft's k tokens all kept; here that holds until the draft's own checks say otherwise: with p
    the share of its checked tokens kept before a rejection (accepted / (accepted + checks that rejected one), the
    geometric model's estimate), its k tokens keep p + p^2 + ... + p^k. A weak draft (a 2-layer cut of the default
    model, p about 0.2) then leaves the short suffix drafts to suffix decoding, where Arctic's rule sent them to the
    draft and ran slower than suffix decoding alone (docs/performance.md). Repetitive text (an agent's loops, an
    edit) takes the long suffix drafts, which cost no forward. The draft model's KV follows every request's tokens
    either way, at the request's next draft-model proposal: it then feeds the tokens the draft has not seen.

    Under the goodput budget the draft model is priced apart from the suffix trees: the Speculator sets
    `draft_model_pays` before each call from the draft's rate and the seconds its forwards take per request
    (`draft_ask_seconds`); where they do not pay, a request whose suffix draft does not reach the bar proposes that
    draft or nothing, as under suffix decoding alone (a weak draft asked on every step with nothing to repeat cost
    more than it kept: docs/performance.md), but for one request now and then (about DRAFT_EXPLORE_SHARE of the calls'
    steps' time, `step_seconds` a call) that keeps the draft's rate current."""

    name = "draft_model+suffix"

    def __init__(self, suffix: SuffixProposer, draft: DraftModelProposer, num_speculative_tokens: int,
                 clock: Callable[[], float] = time.perf_counter):
        self.suffix = suffix
        self.draft = draft
        self.num_speculative_tokens = num_speculative_tokens
        self.num_suffix_drafts = 0  # proposals that were the suffix trees'
        self.num_model_drafts = 0  # and the draft model's
        self.draft_kept = 0.0  # decayed: tokens of the draft model's proposals that checks kept
        self.draft_rejections = 0.0  # and checks of them that rejected a token
        self.num_draft_checks = 0  # checks of them seen
        # set by the Speculator's goodput budget before each call: whether the draft model's forwards pay, and the
        # seconds of a step without proposals at the call's batch size
        self.draft_model_pays = True
        self.step_seconds = 0.0
        # the draft model's seconds per request asked, once it has seen the request's tokens: k of its forwards of one
        # token a request, each at its time over its rows (moving average over the calls where it pays). What the
        # draft has not seen (after suffix drafts, a new request's prompt), fed at its next ask, is left out
        self.draft_ask_seconds = 0.0
        self.last_draft_seconds = 0.0  # the draft model's seconds in the last call (0: it did not run)
        self._draft_call_seconds = 0.0  # and in the last call it ran in
        self.clock = clock
        # seconds of draft-model calls that may run though they do not pay: DRAFT_EXPLORE_SHARE of the steps of the
        # calls since, less what such calls took
        self._explore_credit = 0.0
        self.num_explorations = 0  # calls that asked the draft model though it did not pay
        self._by_draft: set[str] = set()  # requests whose proposal now is the draft model's

    def draft_rate(self) -> float | None:
        """p: the share of the draft model's checked tokens kept before a rejection (the geometric model's
        estimate, accepted / (accepted + checks that rejected one)); None while its checks are too few to say."""
        if self.num_draft_checks < DRAFT_CHECKS_BEFORE_ESTIMATE:
            return None
        return self.draft_kept / max(self.draft_kept + self.draft_rejections, 1e-9)

    def expected_draft_tokens(self, num_tokens: int) -> float:
        """What a proposal of `num_tokens` of the draft model's tokens is expected to keep."""
        p = self.draft_rate()
        if p is None:
            return float(num_tokens)  # ArcticInference's assumption: all of them
        return sum(p ** i for i in range(1, num_tokens + 1))

    def propose(self, requests: list, max_tokens: list[int]) -> list[list[int]]:
        by_draft = self._by_draft
        k = self.num_speculative_tokens
        expected_at_k = self.expected_draft_tokens(k)
        suffix_drafts, short = [], []  # short: the requests whose suffix draft falls short of the draft model's
        for i, (request, room) in enumerate(zip(requests, max_tokens)):
            by_draft.discard(request.request_id)
            suffix = self.suffix.draft(request, room)
            suffix_drafts.append(suffix.token_ids)
            bar = expected_at_k if room >= k else self.expected_draft_tokens(room)
            if not suffix.token_ids or suffix.score < bar:
                short.append(i)
        pays = self.draft_model_pays
        if pays:
            self._explore_credit = min(self._explore_credit, 0.0)  # a debt stays
            where = short
        else:
            # at most two explorations' worth saved while none could run
            self._explore_credit = min(self._explore_credit + DRAFT_EXPLORE_SHARE * self.step_seconds,
                                       2 * self._draft_call_seconds)
            # exploring: one request, in turn, asked for more than a probe's token (probes are never checked)
            where = [i for i in short if max_tokens[i] > 1]
            if where and self._explore_credit >= self._draft_call_seconds:
                where = [where[self.num_explorations % len(where)]]
                self.num_explorations += 1
            else:
                where = []
        proposals = suffix_drafts
        self.last_draft_seconds = 0.0
        if where:
            forwards = self.draft.num_forwards
            start = self.clock()
            drafts = self.draft.propose([requests[i] for i in where], [min(max_tokens[i], k) for i in where])
            end = self.clock()
            if self.draft.num_forwards > forwards:  # else its pool was full: nothing ran
                self.last_draft_seconds = self._draft_call_seconds = end - start
                if not pays:
                    self._explore_credit -= end - start
                else:  # priced at the batch sizes it pays at, not an exploration's one request
                    seconds, rows = self.draft.last_decode_forwards
                    # k one-token forwards at their time a row; with k = 1 the call (its one forward feeds the tokens
                    # the step added)
                    per_ask = k * seconds / rows if rows else (end - start) / len(where)
                    self.draft_ask_seconds += (ASK_AVERAGING * (per_ask - self.draft_ask_seconds)
                                               if self.draft_ask_seconds else per_ask)
            for i, proposal in zip(where, drafts):
                if proposal:  # else (no room in its pool) the suffix draft, if any
                    proposals[i] = proposal
                    self.num_model_drafts += 1
                    by_draft.add(requests[i].request_id)
        self.num_suffix_drafts += sum(1 for i, proposal in enumerate(proposals)
                                      if proposal and requests[i].request_id not in by_draft)
        return proposals

    def checked(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """A check of the request's proposal (as scheduled: the budget may have cut it) kept `num_accepted` of
        `num_proposed` tokens."""
        if request_id not in self._by_draft or num_proposed <= 0:
            return
        self.draft_kept = DRAFT_CHECK_DECAY * self.draft_kept + num_accepted
        self.draft_rejections = DRAFT_CHECK_DECAY * self.draft_rejections + (num_accepted < num_proposed)
        self.num_draft_checks += 1

    def on_finish(self, request, cache: bool) -> None:
        self._by_draft.discard(request.request_id)
        self.suffix.on_finish(request, cache)
        self.draft.on_finish(request, cache)
