"""The step plan rank 0 sends every rank, as deltas of a persistent batch (as vLLM v1's
NewRequestData / CachedRequestData).

Every replica's ranks keep a persistent batch (torch_shift.engine.input_batch): per row, a
request's known token ids and its block table in that replica's pool. A request entering a
replica (admitted, or resumed after a preemption) is sent once, whole; after that a step sends
only the tokens sampled since (one per decode) and the blocks allocated since. A row a request
left is reused only by a request sent whole, so removals never travel. The plan's size per decode
step does not grow with context length.

`PlanBuilder` lives on rank 0 beside the scheduler and mirrors what every replica's ranks know;
the workers apply the deltas (`InputBatch.apply`) and then run each bound group's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from torch_shift.engine.request import Redrafting
from torch_shift.engine.scheduler import SchedulerOutput
from torch_shift.kv.tier import SwapOp
from torch_shift.parallel.layouts import Deployment, micro_batch_count

_INT = np.int32


@dataclass
class NewRow:
    """A request entering a replica's batch: every token known so far and every block it holds."""

    row: int
    token_ids: np.ndarray
    block_ids: np.ndarray
    width: int  # KV width: its blocks hold width * block_size tokens


@dataclass
class ReplicaDelta:
    new_rows: list[NewRow] = field(default_factory=list)
    # rows already in the batch: tokens sampled since they were last sent, blocks allocated since
    token_rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    block_rows: list[int] = field(default_factory=list)
    block_starts: list[int] = field(default_factory=list)  # where in the row's block table they go
    block_ids: list[list[int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.new_rows or self.token_rows or self.block_rows)


@dataclass
class GroupStep:
    """One bound group's batch: requests in execution order, decodes (one token) first."""

    layout: str
    rows: tuple[np.ndarray, ...]  # per replica of the layout, in its order: each request's row there
    num_scheduled: np.ndarray  # tokens computed this step, per request
    num_computed: np.ndarray  # position of the first of them
    num_decodes: int  # the first num_decodes requests compute one token each
    logits_counts: np.ndarray  # logits rows per request: 0, 1 (its last position) or all its positions
    num_micro_batches: int = 1  # a pipeline layout runs the batch cut into this many (split_micro_batches)
    # speculative decoding: per request the number of proposed tokens among its scheduled ones (they follow its
    # known tokens), and those tokens, concatenated in request order; None when no request has any
    num_spec: np.ndarray | None = None
    spec_token_ids: np.ndarray | None = None
    # a batch-1 check run in two stages (Request.spec_stage): the tokens of its first; 0: one stage. With `redraft`
    # (Request.spec_redraft) the stages after the first are drafted by the C++ decoder, ended by stop_token_ids too
    first_stage: int = 0
    redraft: Redrafting | None = None
    # asynchronous scheduling: the decodes (their indices in the step, which are their token indices) whose input
    # token the last step sampled and has not reached the host, and where each is in that step's sampled tokens
    placeholders: np.ndarray | None = None
    placeholder_sources: np.ndarray | None = None
    # sums of num_scheduled, num_computed and logits_counts, read at every step (numpy's sum: several us, cold)
    num_tokens: int = -1
    num_kv_tokens: int = -1
    num_logits: int = -1
    # decode steps the group runs (multi-step scheduling): in each the ranks draw every request's token (its argmax,
    # or with run_draws) and feed it to the next; the logits rank returns them all (ModelRunner). The run ends early
    # after a step in which some request drew one of stop_token_ids (int64, sorted: its requests' end and stop tokens,
    # Request.check_stop's, and for a request alone those that may complete its stop strings,
    # Request.lone_stop_token_ids). run_draws: what its rows draw with in each step where some of them sample (float32
    # [num_steps, 5, rows]: Sampler.run_draws), else None: each row's argmax
    num_steps: int = 1
    stop_token_ids: np.ndarray | None = None
    run_draws: np.ndarray | None = None

    def __post_init__(self):
        if self.num_tokens < 0:
            self.num_tokens = int(self.num_scheduled.sum())
            self.num_kv_tokens = int(self.num_computed.sum())
            self.num_logits = int(self.logits_counts.sum())


@dataclass
class StepPlan:
    deltas: dict[int, ReplicaDelta]  # replica -> what changed in its persistent batch
    groups: list[GroupStep]
    # KV moved to and from the host tier (torch_shift.kv.tier) before the forward: outs, then ins
    swap_outs: list[SwapOp] = field(default_factory=list)
    swap_ins: list[SwapOp] = field(default_factory=list)
    # the outputs rank 0's suffix global tree took since the last plan run, in order, which the ranks of the other
    # replicas add to their copies before the step (ModelRunner.suffix_global_tree); None: none kept
    global_tree_outputs: list[np.ndarray] | None = None


@dataclass(slots=True)
class _Known:
    row: int
    num_tokens: int  # tokens the replica's ranks hold
    num_blocks: int  # blocks they hold


class PlanBuilder:
    """Rank 0's mirror of every replica's persistent batch; turns scheduler outputs into plans."""

    def __init__(self, deployment: Deployment, max_rows: int):
        self.deployment = deployment
        self.known: list[dict[str, _Known]] = [{} for _ in range(deployment.num_replicas)]
        self.free_rows: list[list[int]] = [list(range(max_rows - 1, -1, -1)) for _ in range(deployment.num_replicas)]
        self.replicas_of: dict[str, tuple[int, ...]] = {}  # request -> the replicas that hold it

    def build(self, output: SchedulerOutput, in_flight: dict[str, int] | None = None) -> StepPlan:
        """The plan of a scheduler output: its groups with entries, in order, each in its entries' order.
        `in_flight`: the requests whose last sampled token is still on the device (asynchronous scheduling), with
        its index among the tokens that step sampled."""
        deltas: dict[int, ReplicaDelta] = {}

        def delta(replica: int) -> ReplicaDelta:
            d = deltas.get(replica)
            if d is None:
                d = deltas[replica] = ReplicaDelta()
            return d

        for request_id in output.removed_request_ids:
            for replica in self.replicas_of.pop(request_id, ()):
                self.free_rows[replica].append(self.known[replica].pop(request_id).row)
        for request_id, num_blocks in output.shrunk_block_tables.items():  # the blocks past these are sent again
            for replica in self.replicas_of.get(request_id, ()):
                known = self.known[replica][request_id]
                known.num_blocks = min(known.num_blocks, num_blocks)

        groups = []
        # a run of one request also ends at a token that may complete one of its stop strings
        alone = sum(len(group.entries) for group in output.groups) == 1
        for group in output.groups:
            if not group.entries:
                continue
            entries = group.entries
            layout = self.deployment[group.layout]
            num_scheduled = [e.num_tokens for e in entries]
            num_computed = [e.num_computed_tokens for e in entries]
            # the tokens each request has when the step starts: those computed, those it computes, not the proposed
            num_known = list(map(int.__add__, num_computed, num_scheduled))
            if group.num_spec_tokens:
                num_spec = [len(e.spec_token_ids) for e in entries]
                num_known = list(map(int.__sub__, num_known, num_spec))
                logits_counts = [e.num_tokens if e.prompt_logprobs or e.spec_token_ids else int(e.sample)
                                 for e in entries]
            else:
                logits_counts = [e.num_tokens if e.prompt_logprobs else int(e.sample) for e in entries]
            placeholders = None
            if in_flight:
                placeholders = [i for i, e in enumerate(entries) if e.request.request_id in in_flight
                                and num_known[i] > len(e.request.all_token_ids)]
                assert all(num_scheduled[i] == 1 for i in placeholders), "only a decode's input is on the device"
            rows = []
            for k, replica in enumerate(layout.replicas):
                known_here, d = self.known[replica], delta(replica)
                replica_rows = []
                for entry, needed in zip(entries, num_known):
                    request = entry.request
                    rid = request.request_id
                    table = entry.block_tables[k]
                    known = known_here.get(rid)
                    if known is None:
                        assert needed <= len(request.all_token_ids), "a new row's tokens are all on the host"
                        row = self.free_rows[replica].pop()
                        known_here[rid] = _Known(row, len(request.all_token_ids), len(table))
                        self.replicas_of[rid] = self.replicas_of.get(rid, ()) + (replica,)
                        d.new_rows.append(NewRow(row, np.asarray(request.all_token_ids, dtype=_INT),
                                                 np.asarray(table, dtype=_INT), layout.kv_width))
                    else:
                        row = known.row
                        if known.num_tokens < needed:  # tokens sampled since: one per decode
                            arrived = request.all_token_ids[known.num_tokens:needed]  # not one still on the device
                            for token in arrived:
                                d.token_rows.append(row)
                                d.tokens.append(token)
                            known.num_tokens += len(arrived)
                        num_blocks = len(table)
                        assert known.num_blocks <= num_blocks, rid  # a shrunk table was reported
                        if known.num_blocks < num_blocks:
                            d.block_rows.append(row)
                            d.block_starts.append(known.num_blocks)
                            d.block_ids.append(table[known.num_blocks:])
                            known.num_blocks = num_blocks
                    replica_rows.append(row)
                rows.append(np.array(replica_rows, dtype=_INT))
            assert num_scheduled[:num_scheduled.count(1)] == [1] * num_scheduled.count(1), "decodes come first"
            spec = None, None
            if group.num_spec_tokens:
                spec = (np.array(num_spec, dtype=_INT),
                        np.array([t for e in entries for t in e.spec_token_ids], dtype=_INT))
            num_tokens = sum(num_scheduled)
            step = GroupStep(group.layout, tuple(rows), np.array(num_scheduled, dtype=_INT),
                             np.array(num_computed, dtype=_INT), num_scheduled.count(1),
                             np.array(logits_counts, dtype=_INT), micro_batch_count(layout.pp, num_tokens),
                             *spec, num_tokens=num_tokens, num_kv_tokens=sum(num_computed),
                             num_logits=sum(logits_counts), num_steps=output.num_steps)
            if output.num_steps > 1:
                step.stop_token_ids = entries[0].request.lone_stop_token_ids() if alone else _stop_token_ids(entries)
            # the scheduler may have cut the proposals to its token budget; a redrafting check's first stage may
            # decode the token alone, its other slots fillers (Speculator._second_stage)
            if len(entries) == 1 and (entries[0].spec_fillers or 0 < entries[0].request.spec_stage < len(
                    entries[0].spec_token_ids)):
                request = entries[0].request
                step.first_stage = 1 + request.spec_stage
                # a redrafting check: only in a plan of this request alone, whose result the engine reads as the check's
                # (core._take_redrafted); where its stop strings may complete at any token, one stage
                if request.spec_redraft is not None and alone:
                    step.redraft = (request.spec_redraft._replace(max_stages=1) if request.stops_at_any_token
                                    else request.spec_redraft)
                    step.stop_token_ids = request.lone_stop_token_ids()
            if placeholders:
                step.placeholders = np.array(placeholders, dtype=np.int64)
                step.placeholder_sources = np.array([in_flight[entries[i].request.request_id] for i in placeholders],
                                                    dtype=np.int64)
            groups.append(step)
        deltas = {replica: d for replica, d in deltas.items() if not d.is_empty}
        return StepPlan(deltas, groups, output.swap_outs, output.swap_ins)


def _stop_token_ids(entries) -> np.ndarray:
    """The end and stop tokens of the entries' requests (Request.check_stop's), int64 and sorted: those that end a
    multi-step run of several requests after the step that drew one. It runs on past a stop string (the host cuts the
    text there): ending it at each token that may complete one would cut the run of every request."""
    return np.array(sorted(set().union(*(e.request.eos_token_ids | e.request.stop_token_ids for e in entries))),
                    dtype=np.int64)


def split_micro_batches(group: GroupStep) -> list[GroupStep]:
    """The group's batch cut into `num_micro_batches` runs of near-equal token counts, in order. A
    prompt chunk may be cut: its later piece starts where the earlier one ended and reads the earlier
    piece's KV, which the same stage wrote before it (stages run micro-batches in order). Only a piece
    that reaches the chunk's end samples; prompt logprobs are cut with their positions. Every rank
    derives the same micro-batches from the plan."""
    n = group.num_micro_batches
    if n <= 1:
        return [group]
    assert group.placeholders is None, "asynchronous scheduling runs one rank"
    num_scheduled = group.num_scheduled.astype(np.int64)
    ends = np.cumsum(num_scheduled)
    starts = ends - num_scheduled
    total = int(ends[-1])
    all_positions = group.logits_counts == group.num_scheduled  # prompt logprobs (or one-token chunks)
    micro = []
    for m in range(n):
        lo, hi = total * m // n, total * (m + 1) // n
        if lo == hi:
            continue
        first = int(np.searchsorted(ends, lo, side="right"))  # first request ending after lo
        last = int(np.searchsorted(starts, hi, side="left"))  # requests starting before hi: [first, last)
        idx = np.arange(first, last)
        piece_lo = np.maximum(starts[idx], lo)
        piece_hi = np.minimum(ends[idx], hi)
        counts = np.where(all_positions[idx], piece_hi - piece_lo,
                          np.where(piece_hi == ends[idx], group.logits_counts[idx], 0))
        micro.append(GroupStep(
            group.layout, tuple(rows[idx] for rows in group.rows), (piece_hi - piece_lo).astype(_INT),
            (group.num_computed[idx] + (piece_lo - starts[idx])).astype(_INT),
            int(np.count_nonzero(idx < group.num_decodes)), counts.astype(_INT)))
    return micro
