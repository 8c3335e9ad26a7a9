"""Speculative decoding on rank 0: after each step a proposer guesses the next tokens of every request that got a
token; the scheduler schedules them with the request's last token (KV slots for all), the step computes logits at
every position, and the output processor keeps the proposals that match what the request draws
(torch_shift.engine.output_processor), the scheduler giving back the blocks of the rejected ones.

Methods (vLLM's `speculative_config`, see config.py): "ngram" (prompt lookup) and "suffix" (SuffixDecoding, as
ArcticInference) propose from tokens already seen and cost no forward; "draft_model" runs a smaller checkpoint on
rank 0 with its own KV cache (draft.py), with suffix decoding beside it where `enable_suffix_decoding` asks (as
ArcticInference: the suffix draft where it is expected to keep as many tokens as the draft model's proposal).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Protocol

from torch_shift.engine.request import Redrafting, Request, RequestStatus
from torch_shift.engine.spec_decode.budget import (
    AcceptanceRates,
    StepCost,
    StepCostFit,
    SyncPenalty,
    best_net,
    lowest_paying_rate,
    tokens_that_pay,
    with_sync_penalty,
)
from torch_shift.engine.spec_decode.budget import seconds as step_seconds
from torch_shift.engine.spec_decode.config import SpeculativeConfig
from torch_shift.engine.spec_decode.ngram import NgramProposer
from torch_shift.engine.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:
    from torch_shift.engine.scheduler import ScheduledRequest

__all__ = ["Proposer", "SpeculativeConfig", "Speculator", "build_proposer", "num_accepted"]


class Proposer(Protocol):
    name: str

    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        """For each request, up to its `max_tokens` tokens that may follow its tokens (all at once: a draft
        model batches them)."""

    def on_finish(self, request: Request, cache: bool) -> None:
        """The request left (finished, with `cache`: normally, or aborted): forget its state."""

    # optional: `checked(request_id, num_proposed, num_accepted)`, told each check of a proposal it made


def build_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of a method that needs no model (a draft model is loaded by the engine: draft.py)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    assert config.method == "suffix", config.method
    return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)


PROBE_EVERY = 16
# the rate a request needs before its batch size's range has a fit (no step's cost known yet): only likely
# proposals are checked meanwhile (checking every proposal while the fit learned cost 64 requests a quarter of their
# first run's throughput on the default model); the range's steps fit a + c R, and b = c until checks vary S
UNFITTED_BAR = 0.5
PROBE_SHARE = 0.01  # of a step's time, at most, spent proposing probes (their interval grows past PROBE_EVERY)
ASK_AVERAGING = 0.05  # weight of the latest propose call in the proposer's moving averages
MAX_BACKOFF = 8  # tokens a request waits, at most, after proposals that came back empty or were all cut
# while a batch size's range has had too few checks to price one (budget.StepCostFit.lacks_checks), its likeliest
# request (a rate of at least UNFITTED_BAR) checks its whole proposal once every EXPLORE_EVERY steps, paid or not:
# without it a few slow first checks priced every later one out and, no check following, the price stayed (measured:
# speculation off for a whole edit run, 1 check in 776 steps, in one of about six runs)
EXPLORE_EVERY = 16
DISABLED_STEPS = 1 << 30  # the quiet steps of a batch at disable_by_batch_size: as long as its requests stay
# where probes are made in quiet steps (a proposer without a model), a request below the bar is looked at again (by a
# step that waits for its tokens) every RELOOK_PROBES probe intervals: its probes keep its rate meanwhile, and one whose
# rate passes the bar is looked at by the next step (free text lost 8-11% to a waiting step at every probe and the
# step after it: docs/performance.md)
RELOOK_PROBES = 4


# A batch-1 check's second stage runs up to this many of the draft's tokens, or as many as the first (Speculator.
# _second_stage). On the edit work of bench_spec.py the second stage ran in 60 of 78 staged checks and kept 4.7
# tokens a run; 3 to 6 read alike (0.97-0.99x the TPOT of one-stage checks, alternated; docs/performance.md)
SECOND_STAGE_TOKENS = 6
# A batch-1 check whose stages after the first the C++ decoder drafts (Redrafting) holds slots for this many tokens
# and runs at most REDRAFT_STAGES stages (rank 0's interrupt ends it after a stage, as a multi-step run:
# torch_shift.parallel.runs). 16 stages against 8, alternated on bench_spec's work: TPOT ratios to no speculation
# 1.03-1.06x higher under Shift and in one process (agent and edit medians; docs/performance.md), the host's work and
# the plan between checks paid half as often
REDRAFT_TOKENS = 64
REDRAFT_STAGES = 16


def num_accepted(proposed, drawn) -> int:
    """The proposed tokens a check accepted: those the request drew in their places, up to the first it did not."""
    accepted = 0
    while accepted < min(len(proposed), len(drawn)) and drawn[accepted] == proposed[accepted]:
        accepted += 1
    return accepted


def within_room(keep: list[int], rates: list[float], room: int) -> list[int]:
    """`keep` (tokens checked of each proposal) cut to `room` tokens in all, the least likely to be accepted first:
    a proposal's j-th token is accepted with probability rate^j."""
    keep = list(keep)
    for _ in range(sum(keep) - room):
        i = min((i for i, n in enumerate(keep) if n), key=lambda i: rates[i] ** keep[i])
        keep[i] -= 1
    return keep


class Speculator:
    """When and how much each request proposes: after a step, for the running requests that got a token, as much
    of each proposal as pays for its share of the next step's time (budget.py)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None,
                 max_step_tokens: int = 0):
        """`max_step_tokens`: the most tokens of a step that runs on the C++ decoder (ModelRunner.native_step_tokens;
        0: none)."""
        self.config = config
        self.max_model_len = max_model_len
        # a step of more tokens runs the model's forward instead, about 3x as long for 64 requests and a check of a
        # few tokens (a 64-request step 10.6 ms, with a check of 4 tokens 32 ms, on an AMX Xeon): where a step's
        # plain decodes fit, its proposals are cut to fit beside them, which a linear price of the step cannot say
        self.max_step_tokens = max_step_tokens
        # a batch-1 check of up to this many tokens may run in two stages (0: none; the engine sets it where the C++
        # decoder runs such a step: ModelRunner.staged_check_tokens, kernels/cpu_decoder.cpp's run_in_stages): the
        # proposals that pay, then more of the draft, run only where all of the first are accepted, with no return to
        # the host between
        self.staged_check_tokens = 0
        # with suffix decoding, a batch-1 request whose drafts pay but whose proposer finds none after its token gets a
        # redrafting check from that token alone (_second_stage), where the engine sets this: at one rank without
        # multi-step runs, where the plain step it replaces waits for its token beside the speculator (on the agent
        # work, the TPOT without it over that with it 1.00-1.07x, median 1.02x; under Shift, whose quiet steps run 8
        # to a plan, 0.97-1.01x: docs/performance.md)
        self.redraft_from_token_alone = False
        self.proposer = proposer if proposer is not None else build_proposer(config)
        self._tell_checked = getattr(self.proposer, "checked", None)
        # a proposer with a draft model beside free drafts (SuffixBesideDraftProposer): its forwards priced apart
        self._draft_beside = self.proposer if hasattr(self.proposer, "draft_model_pays") else None
        self.step_cost = StepCostFit()
        self.sync_penalty = SyncPenalty()  # told by the engine core where steps may run ahead of the host
        self.acceptance = AcceptanceRates()
        self.num_cut_tokens = 0  # proposed tokens left unchecked because they would not pay
        # redrafting checks' stages by their rows (proposals and the token before them): [stages, seconds as priced,
        # accepted proposals] (LLM.stats()["spec_decode"]["stages_by_rows"]: what a check's rows cost on this machine)
        self.stages_by_rows: dict[int, list] = {}
        # the proposer's seconds per request asked, and the share of asks that found a proposal (moving averages):
        # asking costs that time whether or not anything is checked (searching the suffix trees of many cached
        # outputs took 60-80 us a request; added to the step's time, as before, the fit spread it over a and c)
        self.ask_seconds = 0.0
        self.found_share = 1.0
        self.clock = time.perf_counter  # what times the asks (a simulated engine's stands still: planner/simulate.py)
        # and the share of a step waiting for its tokens that each look's ask cost: a request is looked at from its last
        # token, so the step before the look waits for it unless it checked proposals (a check waits for its tokens
        # anyway) or ended a multi-step run; the steps before looks that follow a plain step cost the wait's price
        # (SyncPenalty) on top of the proposer's time. Priced with a check only, free text under Shift whose rates sat
        # near the bar ran about half its steps singly, each waiting, where the plain engine ran runs of 8
        # (docs/performance.md)
        self.look_wait_share = 0.0
        self._bar_key: tuple | None = None  # (batch size, step cost) of `_bar`
        self._bar_ask = 0.0  # and the price of an ask it was found with
        self._bar = 0.0
        self._last_bar = UNFITTED_BAR  # the bar of the last propose (`_prices`', or UNFITTED_BAR before a fit)
        self._last_probe_every = PROBE_EVERY  # and its probes' interval
        self._probe_every = PROBE_EVERY
        # the requests below the bar that probe in quiet steps (skip_step, pass_step): a draft model's forward cannot
        # run there, beside the step that runs ahead of the host
        self._probes_in_quiet = config.method != "draft_model"
        self._below_bar: set[str] = set()
        # steps seen (propose and skip_step calls): probes and the ends of waits fall on multiples of their interval
        # in these steps, so that the requests that wait, wait together and the steps between need no speculator (by
        # each request's own length, 64 requests' probes fell on 48-68 of 96 steps: docs/performance.md)
        self._steps = 0
        self._explored_at = -EXPLORE_EVERY  # the step of the last check made to price checks
        # request id -> (the token a probe proposed; whether the request is greedy; the position of the token it is
        # scored against, whenever the request is seen holding it: the step after the probe's may run ahead)
        self._shadows: dict[str, tuple[int, bool, int]] = {}
        # request id -> its last wait: after a proposal of which nothing was checked (none found, or none paid) a
        # request waits up to 1, 2, 4 ... MAX_BACKOFF tokens (to a multiple of the wait in steps) before the next,
        # under the budget: on free text most n-gram lookups find nothing, and a lookup every step cost 2% of a
        # batch-1 step
        self._backoff: dict[str, int] = {}
        # request id -> the length below which it is not looked at: its backoff, or its next probe while its rate is
        # below the bar (the bar and its rate are read again then). A step whose requests all wait costs no pricing:
        # the speculator's calls were 6% of a free-text batch-1 step of the default model, which proposed nothing
        self._quiet: dict[str, int] = {}
        # steps to come in which every request the last propose saw waits, so that a step of the same requests,
        # decoding, needs neither observe nor propose (EngineCore._speculate; with one rank such steps run ahead of
        # the host): on free text their calls on every step were what the speculator cost (docs/performance.md)
        self.quiet_steps = 0

    def _score_shadows(self, requests) -> None:
        """Probes' proposed tokens against the tokens their requests drew in their places: accepted when they are the
        same. For greedy requests that is what a check would say; for sampled ones it has a check's chance, p of the
        proposed token under the request's processed distribution, without costing one."""
        shadows = self._shadows
        for request in requests:
            shadow = shadows.get(request.request_id)
            if shadow is not None and len(request.all_token_ids) > shadow[2]:
                del shadows[request.request_id]
                drawn = request.all_token_ids[shadow[2]]
                self.acceptance.observe(request.request_id, 1, int(drawn == shadow[0]), shadow[1])
                # a request whose rate now pays is looked at by the next step (which then waits for its tokens)
                if self.acceptance.rate(request.request_id, shadow[1]) >= self._last_bar:
                    self._quiet.pop(request.request_id, None)
                    self.quiet_steps = 0

    def observe(self, entries: list[list[ScheduledRequest]], sampled: dict[str, int | list[int]],
                seconds: float) -> list[tuple[int, int]]:
        """A step ran in `seconds` (its forward and sampling): each check's outcome, and the step's cost when it
        only decoded (the proposer's time is priced apart, per request asked: `propose`). Returns the checks as
        (proposed, accepted) tokens. A proposal is accepted up to the first token the request drew otherwise (all
        tokens but the last one drawn are accepted proposals, unless a stop came first)."""
        num_requests = num_proposed = 0
        decode_only = True
        checks = []
        shadows = self._shadows
        for group in entries:
            num_requests += len(group)
            for e in group:
                proposed = e.spec_token_ids
                if proposed:
                    request = e.request
                    stages = request.spec_stages
                    if stages is not None:  # the C++ decoder drafted its stages after the first: each a check
                        request.spec_stages = None
                        self._price_stages(stages, seconds)
                        decode_only = False  # priced by its stages
                        outcomes = [stage[:2] for stage in stages if stage[0]]  # not those that decoded a token alone
                    elif e.spec_fillers:
                        # a redrafting check that the decoder declined: its forward checked every slot, those past its
                        # first stage's proposals (none, from a token alone) fillers, which are no proposals
                        decode_only = False
                        num_real = len(proposed) - e.spec_fillers
                        accepted = num_accepted(proposed[:num_real], sampled.get(request.request_id, ()))
                        outcomes = [(num_real, accepted)] if num_real else []
                    else:
                        if e.num_tokens != 1 + len(proposed):
                            decode_only = False  # a prompt chunk: its cost is not a decode's
                        accepted = num_accepted(proposed, sampled.get(request.request_id, ()))
                        stage = request.spec_stage
                        run_as = len(proposed)  # the proposals of a one-stage check of the rows that ran
                        if 0 < stage < len(proposed):  # in two stages (_second_stage)
                            if accepted > stage:
                                decode_only = False  # two passes over the weights: not the cost of one step
                            else:  # the second did not run: the first's rows checked `stage` proposals and one more
                                proposed, run_as = proposed[:stage + 1], stage
                        num_proposed += run_as
                        outcomes = [(len(proposed), accepted)]
                    for num, accepted in outcomes:
                        self.acceptance.observe(request.request_id, num, accepted, request.greedy)
                        checks.append((num, accepted))
                        if self._tell_checked is not None:
                            self._tell_checked(request.request_id, num, accepted)
                elif e.num_tokens != 1:
                    decode_only = False
        if shadows:
            self._score_shadows(e.request for group in entries for e in group)
        if decode_only and num_requests:
            self.step_cost.observe(num_requests, num_proposed, len(checks), seconds)
        return checks

    def _price_stages(self, stages: list[tuple[int, int, float]], seconds: float) -> None:
        """A batch-1 redrafting check's stages, each observed as a step of its own proposals: its seconds in the
        decoder and an equal share of the check's host work (its `seconds` beyond the stages'). Without them no
        batch-1 step was priced in one process, where plain steps run ahead of the host and checks ran as several
        stages: every draft was checked whole, and the stages of 8-13 rows cost 1.8-2.7x a plain step's one
        (docs/performance.md)."""
        share = max(seconds - sum(stage[2] for stage in stages), 0.0) / len(stages)
        for proposed, accepted, stage_seconds in stages:
            self.step_cost.observe(1, proposed, int(proposed > 0), stage_seconds + share)
            tally = self.stages_by_rows.setdefault(proposed + 1, [0, 0.0, 0])
            tally[0] += 1
            tally[1] += stage_seconds + share
            tally[2] += accepted

    @property
    def method(self) -> str:
        return self.config.method

    def propose(self, updated: list[Request], num_running: int, num_steps: int = 1) -> None:
        """Proposals for the requests that received tokens this step (the others keep theirs; `num_steps`: the steps
        since the last call, a multi-step run's); none in a step of `disable_by_batch_size` running requests or more.
        Under the goodput budget, a request whose check could not pay is not asked for a proposal (the proposer's time
        saved), except one token every PROBE_EVERY steps (or more: `_prices`), never checked but scored against the
        token it draws next, which keeps its acceptance rate current at no step's cost (a checked probe cost a fifth of
        a batch-1 step on the default model). Until its next probe, or the end of a backoff, such a request is not
        looked at."""
        quiet = self._quiet
        alive, due = [], []
        checked = False
        for request in updated:
            if request.status._finished:  # as the scheduler reads it: the property is a call per request
                self.on_finish(request)
                continue
            alive.append(request)
            if request.spec_token_ids:
                request.spec_token_ids = []
                request.spec_stage = 0
                request.spec_redraft = None
                checked = True
            if quiet and len(request.all_token_ids) < quiet.get(request.request_id, 0):
                continue
            if self._below_bar:
                self._below_bar.discard(request.request_id)
            due.append(request)
        self._steps += num_steps
        self.quiet_steps = 0
        if self._below_bar:  # those not looked at probe on their steps all the same
            self._probe_quiet(alive, num_steps)
        steps = self._steps
        config = self.config
        limit = config.disable_by_batch_size
        if not due:
            self.quiet_steps = self._waiting_steps(alive, num_running)
            return
        if limit is not None and num_running >= limit:
            if len(alive) == num_running:  # until one finishes or comes in (EngineCore._speculate)
                self.quiet_steps = DISABLED_STEPS
            return
        k = config.max_proposal_tokens
        cost = self.step_cost.at(num_running) if config.goodput_budget else None
        bar, probe_every, explore = self._step_prices(num_running, cost, steps)
        self._last_bar, self._last_probe_every = bar, probe_every
        until_probe = probe_every - steps % probe_every  # steps to the next probe
        room_left = self._step_room(num_running)
        if bar > 1.0 and not explore or room_left == 0:  # nobody proposes, nor probes: 2% of a step of 64 requests
            for request in due:
                quiet[request.request_id] = len(request.all_token_ids) + until_probe
            self.quiet_steps = self._waiting_steps(alive, num_running)
            return
        proposing, rooms, rates, probing = [], [], [], []
        explorer, explorer_room, explorer_rate = None, 0, UNFITTED_BAR
        for request in due:
            num_tokens = len(request.all_token_ids)
            rate = self.acceptance.rate(request.request_id, request.greedy) if config.goodput_budget else 1.0
            if rate < bar and until_probe != probe_every and not (explore and rate >= UNFITTED_BAR):
                # neither checked, nor explored (no explorer below UNFITTED_BAR), nor probed until the next probe
                # (made in a quiet step, where it may be, and then looked at again after RELOOK_PROBES of them)
                quiet[request.request_id] = num_tokens + until_probe
                if self._probes_in_quiet and bar <= 1.0:
                    quiet[request.request_id] += (RELOOK_PROBES - 1) * probe_every
                    self._below_bar.add(request.request_id)
                continue
            # at most one token past max_tokens and the context: the step adds the accepted ones and one more
            room = min(k, request.max_tokens - len(request.output_token_ids) - 1, self.max_model_len - num_tokens - 1)
            if room_left is not None:
                room = min(room, room_left)
            if room <= 0:
                continue
            if rate < bar:
                if explore and rate >= explorer_rate:
                    explorer, explorer_room, explorer_rate = request, room, rate
                # a probe (one token, never checked: scored against the token drawn in its place) where a check could
                # pay (bar <= 1); the request waits for its next probe meanwhile
                elif bar <= 1.0 and until_probe == probe_every:
                    probing.append(request)
                    quiet[request.request_id] = num_tokens + probe_every
                    if self._probes_in_quiet:
                        quiet[request.request_id] += (RELOOK_PROBES - 1) * probe_every
                        self._below_bar.add(request.request_id)
                continue
            proposing.append(request)
            rooms.append(room)
            rates.append(rate)
        explored = [explorer] if explorer is not None and not proposing else []
        if explored:
            self._explored_at = steps
        if not proposing and not probing and not explored:
            self.quiet_steps = self._waiting_steps(alive, num_running)
            return
        if self._draft_beside is not None:
            self._price_draft_model(num_running, cost)
        asked = proposing + explored + probing
        proposals = self._ask(asked, rooms + [explorer_room] * len(explored) + [1] * len(probing))
        waited = num_steps == 1 and not checked  # the probes of quiet steps (_probe_quiet) wait for nothing
        self.look_wait_share += ASK_AVERAGING * ((1.0 / len(asked) if waited else 0.0) - self.look_wait_share)
        self._keep_probes(probing, proposals[len(proposing) + len(explored):])
        if explored:
            explorer.spec_token_ids = proposals[len(proposing)]
        proposals = drafts = proposals[:len(proposing)]
        keep = [len(p) for p in proposals]
        if cost is not None:
            lengths, keep = keep, tokens_that_pay(rates, keep, num_running, cost)
            self.num_cut_tokens += sum(lengths) - sum(keep)
            proposals = [p[:n] for p, n in zip(proposals, keep)]
        if room_left is not None and sum(keep) > room_left:
            lengths, keep = keep, within_room(keep, rates, room_left)
            self.num_cut_tokens += sum(lengths) - sum(keep)
            proposals = [p[:n] for p, n in zip(proposals, keep)]
        if config.goodput_budget:  # also before any fit: a step of requests that never propose varies nothing
            for request, n in zip(proposing, keep):
                if n:
                    self._backoff.pop(request.request_id, None)
                else:
                    wait = self._backoff.get(request.request_id, 0)
                    wait = self._backoff[request.request_id] = min(2 * wait, MAX_BACKOFF) if wait else 1
                    quiet[request.request_id] = request.num_tokens + wait - steps % wait
        for request, proposal in zip(proposing, proposals):
            request.spec_token_ids = proposal
        if self.staged_check_tokens and num_running == 1 and len(proposing) == 1:
            request = proposing[0]
            self._second_stage(request, drafts[0], keep[0], room_left, rates[0], cost)
            if request.spec_redraft is not None and not keep[0]:  # a check from its token alone: no backoff
                self._backoff.pop(request.request_id, None)
                quiet.pop(request.request_id, None)

    def _second_stage(self, request: Request, draft: list[int], keep: int, room_left: int | None, rate: float,
                      cost: StepCost | None) -> None:
        """A batch-1 check of `keep` proposals that pay, followed in the same step by more: run only where the first
        stage's rows accept all of theirs, the proposals they check and the next (run_in_stages), with no return to
        the host between. Only for a request that draws its argmax, which the C++ decoder finds as the sampler does.
        With suffix decoding the decoder drafts every later stage itself from the request's tokens and those drawn so
        far, after a rejection too, and from the global tree of earlier outputs as the proposer does (rank 0's, or in
        another replica its first rank's copy: ModelRunner.suffix_global_tree) (Redrafting: after a rejection at most
        the proposals that pay for a whole draft at the request's `rate` (`cost`: the step cost fit's; None, no fit or
        no budget: `keep`), and as many again and one, at least SECOND_STAGE_TOKENS, after a stage that accepted all,
        each stage at most num_speculative_tokens; the check holds slots for up to REDRAFT_TOKENS tokens). With
        another proposer the second stage is more of the same draft (as many again and one, at least
        SECOND_STAGE_TOKENS). A second stage of one row would only draw the token after the draft's next: not made.
        With `keep` 0 (no draft, or none that pays), a redrafting check whose first stage is the token alone, only
        where `redraft_from_token_alone` and drafts pay at the request's rate; else nothing."""
        if not request.draws_argmax:
            return
        proposer = self.proposer  # suffix decoding drafting in C++: the decoder drafts with the same rule
        if isinstance(proposer, SuffixProposer) and proposer.native is not None:
            slots = min(REDRAFT_TOKENS, self.staged_check_tokens) - 1  # the proposals the check holds slots for
            slots = min(slots, request.max_tokens - len(request.output_token_ids) - 1,
                        self.max_model_len - request.num_tokens - 1)
            if room_left is not None:
                slots = min(slots, room_left)
            k = self.config.max_proposal_tokens  # each stage a check of at most num_speculative_tokens
            fresh = keep if cost is None else tokens_that_pay([rate], [k], 1, cost)[0]
            # without a draft here, a check whose first stage decodes the token alone, where drafts pay at the
            # request's rate and its later stages may run: its stages cost less than plain steps, which wait for
            # their tokens beside the speculator, and each drafts again, where plain steps back off
            if not keep and (not self.redraft_from_token_alone or not fresh or request.stops_at_any_token):
                return
            if slots - keep >= 2:
                # past the first stage only the slots count: the decoder writes each stage's ids
                request.spec_token_ids = draft[:keep] + [draft[keep - 1] if keep else request.all_token_ids[-1]] * (
                    slots - keep)
                request.spec_stage = keep
                # a stage that finds no draft decodes its token alone and the next drafts again (with both trees
                # searched there, 0.89-0.94x the TPOT of checks that ended at such a stage; docs/performance.md)
                request.spec_redraft = Redrafting(max(fresh, 1), min(max(fresh + 1, SECOND_STAGE_TOKENS), k),
                                                  REDRAFT_STAGES, proposer.max_depth, proposer.max_spec_factor,
                                                  proposer.min_token_prob, proposer.global_tree.num_cached > 0)
            return
        if not keep:
            return
        more = min(len(draft) - keep, max(keep + 1, SECOND_STAGE_TOKENS), self.staged_check_tokens - 1 - keep)
        if room_left is not None:
            more = min(more, room_left - keep)
        if more >= 2:
            request.spec_token_ids = draft[:keep + more]
            request.spec_stage = keep

    def _step_prices(self, num_running: int, cost: StepCost | None, steps: int) -> tuple[float, int, bool]:
        """A propose's bar, probe interval and whether it explores, in its `steps`-th step of `num_running` decodes
        (`cost`: the fit's, None without the budget or before a fit)."""
        if cost is None:
            return (UNFITTED_BAR if self.config.goodput_budget else 0.0), PROBE_EVERY, False
        priced = with_sync_penalty(cost, num_running, self.sync_penalty.at(num_running))
        # a check's cost d carries the wait priced there: the synchronous interval less the pipelined one
        bar, probe_every = self._prices(num_running, priced, priced[3] - cost[3])
        explore = steps - self._explored_at >= EXPLORE_EVERY and self.step_cost.lacks_checks(num_running)
        return bar, probe_every, explore

    def _step_room(self, num_running: int) -> int | None:
        """The proposed tokens a step of `num_running` decoding requests can check and still run on the C++ decoder,
        where its plain decodes do; None where no such bound applies."""
        return self.max_step_tokens - num_running if 0 < num_running <= self.max_step_tokens else None

    def relook_ahead(self, requests: list[Request], num_running: int) -> bool:
        """At the end of a wait, before the tokens of the step in flight (one for each of `requests`: the running
        requests the last propose saw, each decoding) reach the host: where the propose after that step would ask
        nothing (no check can pay, nothing to explore), it is made now, as `propose` would make it, and the quiet
        steps go on, that step's own counted (skip_step takes it), so that the next step runs ahead of the host too.
        False, changing nothing, where the propose may ask the proposer or probes and their scores are kept: the
        step waits for its tokens. The wait's end, every 16 steps of 64 requests that no check could pay for, cost
        their throughput 1% (docs/performance.md)."""
        config, quiet = self.config, self._quiet
        limit = config.disable_by_batch_size
        if self._below_bar or self._shadows or (limit is not None and num_running >= limit):
            return False
        cost = self.step_cost.at(num_running) if config.goodput_budget else None
        room_left = self._step_room(num_running)
        if cost is None and room_left != 0:
            return False
        lengths = [len(request.all_token_ids) + 1 for request in requests]
        due = [i for i, request in enumerate(requests) if lengths[i] >= quiet.get(request.request_id, 0)]
        if not due:
            return False
        steps = self._steps + 1  # the propose's, which skip_step counts
        bar, probe_every, explore = self._step_prices(num_running, cost, steps)
        if (bar <= 1.0 or explore) and room_left != 0:
            return False
        self._last_bar, self._last_probe_every = bar, probe_every
        until_probe = probe_every - steps % probe_every
        for i in due:
            quiet[requests[i].request_id] = lengths[i] + until_probe
        self.quiet_steps = 1 + self._waiting_steps(requests, num_running, ahead=1)
        return True

    def _ask(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        """The proposer's proposals, its time per request asked and the share of asks that found one followed."""
        start = self.clock()
        proposals = self.proposer.propose(requests, max_tokens)
        propose_seconds = self.clock() - start
        if self._draft_beside is not None:  # the draft model's forwards are priced apart: _price_draft_model
            propose_seconds = max(propose_seconds - self._draft_beside.last_draft_seconds, 0.0)
        asked = len(proposals)
        found = sum(1 for p in proposals if p)
        self.ask_seconds += ASK_AVERAGING * (propose_seconds / asked - self.ask_seconds)
        self.found_share += ASK_AVERAGING * (found / asked - self.found_share)
        return proposals

    def _keep_probes(self, requests: list[Request], probes: list[list[int]]) -> None:
        """Probes' tokens, scored against the tokens drawn in their places (_score_shadows)."""
        for request, probe in zip(requests, probes):
            if probe:
                self._shadows[request.request_id] = (probe[0], request.greedy, len(request.all_token_ids))

    def _probe_quiet(self, updated: list[Request], steps: int = 1) -> None:
        """Where a probe's step was among the last `steps` steps, the probes of the requests below the bar among
        `updated` that are not looked at (a quiet step's: the next step computes already; each probe is scored against
        the token drawn in its place)."""
        every = self._last_probe_every
        if self._steps // every == (self._steps - steps) // every or self._last_bar > 1.0:
            return
        below, shadows = self._below_bar, self._shadows
        probing = [r for r in updated if r.request_id in below and r.request_id not in shadows
                   and r.max_tokens - len(r.output_token_ids) > 1 and self.max_model_len - len(r.all_token_ids) > 1]
        if probing:
            self._keep_probes(probing, self._ask(probing, [1] * len(probing)))

    def _waiting_steps(self, requests: list[Request], num_running: int, ahead: int = 0) -> int:
        """The propose calls to come that would find every one of `requests` waiting (each adds one token a step;
        `ahead`: tokens each has beyond those on the host); none where they are not all of the `num_running` running
        requests (one not seen may hold proposals)."""
        if len(requests) != num_running:
            return 0
        quiet = self._quiet
        return max(0, min((quiet.get(r.request_id, 0) - len(r.all_token_ids) - ahead - 1 for r in requests), default=0))

    def skip_step(self, updated: list[Request], steps: int = 1) -> None:
        """`steps` steps (a multi-step run's, at most the quiet steps left) of the requests the last propose saw, each
        decoding a token a step (`updated`), ran while they all wait: nothing to check or propose; their probes
        scored."""
        assert steps >= 1, steps
        self.quiet_steps -= steps
        self._steps += steps
        if self._shadows:
            self._score_shadows(updated)
        if self._below_bar:
            self._probe_quiet(updated, steps)

    def pass_step(self, updated: list[Request]) -> None:
        """A step ran ahead of the host (asynchronous scheduling) and is not a quiet one (a request finished or
        came in), but the next step computes already: nothing is proposed from its tokens, which the next step's
        follow. Its finished requests are forgotten, its probes scored; the next step's tokens are proposed from."""
        if self._shadows:
            self._score_shadows(updated)
        for request in updated:
            if request.status._finished:
                self.on_finish(request)
        self.quiet_steps = 0
        self._steps += 1
        if self._below_bar:
            self._probe_quiet([r for r in updated if not r.status._finished])

    def _prices(self, num_running: int, cost: StepCost, wait_seconds: float = 0.0) -> tuple[float, int]:
        """The lowest rate at which a request can pay for its ask and its check (above 1: none can), and the tokens
        between a request's probes; kept while the fit and the batch size stay and the ask's price moves by less
        than a fifth. `wait_seconds`: what a step that waits for its tokens costs beyond one that does not (an ask
        pays its share of such steps: look_wait_share)."""
        ask = (self.ask_seconds + self.look_wait_share * wait_seconds) / max(self.found_share, 0.05)
        if self._bar_key != (num_running, cost) or not 0.8 * self._bar_ask <= ask <= 1.25 * self._bar_ask:
            self._bar_key, self._bar_ask = (num_running, cost), ask
            # priced at the longest proposal; beside a draft model, a suffix draft's (the draft's k forwards are
            # priced apart: _price_draft_model). At its k, 4, the agent loop ran 7% slower than suffix decoding
            # alone with the draft never asked: fewer requests asked
            self._bar = lowest_paying_rate(self.config.max_proposal_tokens, num_running, cost, ask)
            # a probe costs an ask: with a slow proposer (the suffix trees of many cached outputs: ~60 us a
            # request) probes of 64 requests every 16 tokens took 4% of their step
            step = step_seconds(cost, num_running, 0, 0)
            self._probe_every = PROBE_EVERY
            if step > 0:
                self._probe_every = max(PROBE_EVERY, math.ceil(num_running * self.ask_seconds / (PROBE_SHARE * step)))
        return self._bar, self._probe_every

    def _price_draft_model(self, num_running: int, cost: StepCost | None) -> None:
        """Tells the draft model beside suffix decoding whether it is worth asking in a step of `num_running`
        decodes: its k tokens' best net gain at the rate its checks keep them (best_net) must exceed the tokens its
        forwards' time per request would have made; and the step's time, which its exploring calls are priced
        against. Priced apart from the request's own rate, which the suffix drafts' checks lift on repetitive text:
        on that text's steps with nothing to repeat, a weak draft's forwards cost more than they keep
        (docs/performance.md)."""
        proposer = self._draft_beside
        rate = proposer.draft_rate()
        step = step_seconds(cost, num_running, 0, 0) if cost is not None else 0.0
        proposer.step_seconds = max(step, 0.0)
        if rate is None or step <= 0:
            proposer.draft_model_pays = True
            return
        goodput = num_running / step
        proposer.draft_model_pays = (best_net(rate, self.config.num_speculative_tokens, cost, goodput)
                                     > proposer.draft_ask_seconds * goodput)

    def on_finish(self, request: Request) -> None:
        self.quiet_steps = 0  # the requests the last propose saw are no longer the running ones
        self._shadows.pop(request.request_id, None)
        self._backoff.pop(request.request_id, None)
        self._quiet.pop(request.request_id, None)
        self._below_bar.discard(request.request_id)
        self.proposer.on_finish(request, cache=request.status is not RequestStatus.FINISHED_ABORTED)
        self.acceptance.forget(request.request_id)
