"""How many proposed tokens a step checks: those expected to pay for their share of the step's time.

A checked token costs time whether it is accepted or not; it pays when its chance of being accepted exceeds
what the step's time buys per token without it. With a decode step of R requests, S proposed tokens and P
requests checking proposals taking t(R, S, P) = a + c R + b S + d P, and an expected E tokens out of it (one per
request plus the proposals' chances of acceptance), the goodput E / t is highest where each request checks the
n tokens that maximize sum_{j <= n} p_j - (b n + d) E / t, or none where that is not positive (SmartSpec, arXiv
2406.14066, chooses proposal lengths by the same goodput; the ratio's maximum by Dinkelbach's iteration). d is
a check's own cost (its prompt-like attention tile, logits and draws at every position, the proposer's call):
measured at batch 1 on the default model, a step with one proposed token took 15% longer than one without,
while each further token added 2-5%. At batch 1 on a machine whose decode reads the weights, b and d are small
against a and most proposals pay; at 64 requests on a machine where each token costs compute, only the likely
ones do.

Both sides are measured while serving: the step time by least squares over the last decode-only steps of batch
sizes like the step's (the cost depends on the model, the layout, the machine and the batch size), the chance of
acceptance per request from its own checks (a request that repeats itself accepts most proposals, a free one few),
starting from the method's rate over all requests. A proposal's j-th token is accepted with probability alpha^j
(each accepted after the ones before it).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

_PULL = 2.0  # tokens
_HUBER_ROUNDS = 4
REFIT_EVERY = 16  # steps between fits of a range, until its window is full
REFIT_EVERY_FULL = 64  # then, at the least
# of the step's time, at most, spent fitting once a window is full: a fit right after a step (cold caches) took
# 0.6-0.7 ms, every 64 steps 9 us (2%) of the default model's 0.46 ms step
FIT_SHARE = 0.005
MIN_CHECKED_STEPS = 4  # steps with checks a range's window needs before its price of a check counts as current


StepCost = tuple[float, float, float, float]  # (a, c, b, d) of t(R, S, P) = a + c R + b S + d P, in seconds


class StepCostFit:
    """t(R, S, P) = a + c R + b S + d P (R requests, S proposed tokens, P checks), fitted by least squares over the
    last `window` decode-only steps of each range of batch sizes [2^i, 2^(i+1)), with a weak pull of b toward c
    (a proposed token costs about what a request's token costs: without it, steps that never vary S would leave
    b undetermined). Fitting each range on its own prices a batch size from steps like it: a fit over batch 1
    alone cannot tell a from c, and extrapolated to 64 requests it prices their step several times too dear
    (measured: every proposal then looked worth checking)."""

    def __init__(self, window: int = 128, min_steps: int = 4):
        self.window = window
        self.min_steps = min_steps
        self.ranges: dict[int, _Range] = {}  # R's bit length -> its range's last steps
        self.fitted: dict[int, StepCost] = {}
        self.clock = time.perf_counter  # what times the fits, which space them (FIT_SHARE)

    def observe(self, num_requests: int, num_proposed: int, num_checks: int, seconds: float) -> None:
        key = num_requests.bit_length()
        steps_range = self.ranges.get(key)
        if steps_range is None:
            steps_range = self.ranges[key] = _Range(deque(maxlen=self.window), self.min_steps)
        steps = steps_range.steps
        if len(steps) == self.window and steps[0][2]:
            steps_range.num_checked -= 1
        steps.append((num_requests, num_proposed, num_checks, seconds))
        if num_checks:
            steps_range.num_checked += 1
        steps_range.since_fit += 1
        if steps_range.since_fit >= steps_range.due:
            start = self.clock()
            mean_seconds = self._fit(key)
            # the next fit: every min_steps steps until one fits, then every REFIT_EVERY while the window fills
            # (also after a try that found every step alike), then every REFIT_EVERY_FULL steps or more, as
            # FIT_SHARE allows
            steps_range.since_fit = 0
            steps_range.due = REFIT_EVERY
            if key not in self.fitted and len(steps) < self.min_steps + REFIT_EVERY:
                steps_range.due = self.min_steps
            elif len(steps) == self.window:
                fit_seconds = self.clock() - start
                steps_range.due = max(REFIT_EVERY_FULL, math.ceil(fit_seconds / (FIT_SHARE * mean_seconds)))

    def _fit(self, key: int) -> float:
        """Fits the range's window (its fit kept where the new one is not plausible); returns its steps' mean
        seconds."""
        steps = self.ranges[key].steps
        x = np.empty((len(steps) + 1, 4))
        x[:-1, 0] = 1.0
        x[:-1, 1:] = [step[:3] for step in steps]
        y = np.array([step[3] for step in steps] + [0.0])
        if (x[:-1, 1:] == x[0, 1:]).all():
            return float(y[:-1].mean())  # every step alike: nothing to fit yet
        # with one batch size only, a and c are not told apart (least squares takes the smallest pair), which
        # is all the budget needs: it prices steps of the batch sizes of this range
        # the pull toward b = c: a row w (c - b) = 0, which steps that vary S by many tokens outweigh
        x[-1] = (0.0, _PULL, -_PULL, 0.0)
        coefficients = _huber_fit(x, y)
        if coefficients[3] < 0.0:  # a check cannot save time: refit with d = 0 (where every check had the same
            coefficients = _huber_fit(x, y, keep=[0, 1, 2])  # length, S and P are one column in two)
        if coefficients[2] < 0.0:
            coefficients = _huber_fit(x, y, keep=[0, 1, 3] if coefficients[3] > 0.0 else [0, 1])
        a, c, b, d = coefficients
        smallest, largest = x[:-1, 1].min(), x[:-1, 1].max()
        if b >= 0 and d >= 0 and a + c * smallest > 0 and a + c * largest > 0:
            self.fitted[key] = (float(a), float(c), float(b), float(d))  # else keep the last fit
        return float(y[:-1].mean())

    def lacks_checks(self, num_requests: int, min_steps: int = 32) -> bool:
        """Whether the range of `num_requests` has seen at least `min_steps` steps, fewer than MIN_CHECKED_STEPS of
        them with checks: its price of a check then rests on a few steps, or on none left in the window (a fit
        keeps its last b and d while no step varies them), and only new checks can correct it."""
        steps_range = self.ranges.get(num_requests.bit_length())
        return (steps_range is not None and len(steps_range.steps) >= min_steps
                and steps_range.num_checked < MIN_CHECKED_STEPS)

    def at(self, num_requests: int) -> StepCost | None:
        """The fit for steps of `num_requests` requests: its range's, else a neighbouring range's; None where
        neither has been fitted yet."""
        key = num_requests.bit_length()
        for k in (key, key - 1, key + 1):
            if k in self.fitted:
                return self.fitted[k]
        return None


@dataclass(slots=True)
class _Range:
    """A range of batch sizes' last decode-only steps, as (R, S, P, seconds)."""

    steps: deque[tuple[int, int, int, float]]
    due: int  # steps since the last fit at which the next is made
    since_fit: int = 0
    num_checked: int = 0  # steps with checks in the window


def _huber_fit(x: np.ndarray, y: np.ndarray, keep: list[int] | None = None) -> np.ndarray:
    """Least squares of y on the columns `keep` of x (the others' coefficients 0), with Huber weights by iteratively
    reweighted least squares: a step that the machine slowed (this CPU's steps vary by 10-25% between spells,
    with spikes above) weighs as a step off by 1.345 robust deviations. The last row of x is the pull's, never
    reweighted. Each round solves the weighted normal equations (4 x 4) for their least-norm solution, which is
    the weighted least squares' own where columns coincide (one batch size: a and c): 0.33-0.4 ms a fit through
    lstsq of the whole matrix, measured after a forward, against tens of microseconds."""
    columns = x if keep is None else x[:, keep]
    weights = np.ones(len(y))
    solution = np.zeros(columns.shape[1])
    for _ in range(_HUBER_ROUNDS):
        weighted = columns.T * weights
        solution = np.linalg.lstsq(weighted @ columns, weighted @ y, rcond=1e-10)[0]
        residuals = np.abs(y[:-1] - columns[:-1] @ solution)
        scale = 1.4826 * np.partition(residuals, len(residuals) // 2)[len(residuals) // 2]  # np.median: 9x slower
        if scale <= 0.0:
            break
        weights[:-1] = np.minimum(1.0, 1.345 * scale / np.maximum(residuals, 1e-30))
    if keep is None:
        return solution
    coefficients = np.zeros(x.shape[1])
    coefficients[keep] = solution
    return coefficients


class SyncPenalty:
    """What a plain decode step costs when the host waits for it and when it runs ahead of the host (asynchronous
    scheduling, or inside a multi-step run), per range of batch sizes [2^i, 2^(i+1)): the median interval between the
    engine core's calls after such a step run synchronously (less the speculator's own time in it, priced per ask),
    and after one launched behind the step in flight (or a run's, per step). A check waits for its tokens, as does
    the step whose tokens a proposal follows: it costs a synchronous step's interval and its proposals' fitted time
    (with_sync_penalty), while the fit (StepCostFit) sees synchronous steps' forwards and sampling only. Measured on
    free text in one process: pipelined steps 1.6 ms, synchronous ones 2.3-2.6 (docs/performance.md)."""

    def __init__(self, window: int = 32, min_steps: int = 4):
        self.min_steps = min_steps
        self.window = window
        self.intervals: dict[tuple[int, bool], deque[float]] = {}  # (R's bit length, pipelined?) -> last intervals

    def observe(self, num_requests: int, pipelined: bool, seconds: float) -> None:
        key = (num_requests.bit_length(), pipelined)
        last = self.intervals.get(key)
        if last is None:
            last = self.intervals[key] = deque(maxlen=self.window)
        last.append(seconds)

    def at(self, num_requests: int) -> tuple[float, float] | None:
        """The (synchronous, pipelined) median intervals for steps of `num_requests` requests; None until both kinds
        of step were seen in its range."""
        key = num_requests.bit_length()
        synchronous, pipelined = self.intervals.get((key, False)), self.intervals.get((key, True))
        if synchronous is None or pipelined is None or min(len(synchronous), len(pipelined)) < self.min_steps:
            return None
        return statistics.median_high(synchronous), statistics.median_high(pipelined)


def with_sync_penalty(cost: StepCost, num_requests: int, intervals: tuple[float, float] | None) -> StepCost:
    """`cost` priced against steps that run ahead of the host, from SyncPenalty's (synchronous, pipelined) intervals:
    a plain step costs the pipelined interval, a check (which waits for its tokens) the synchronous one plus its
    proposed tokens' and its check's fitted time. Both intervals carry the host's time between steps, which the fit
    leaves out: a plain step priced at its fitted forward less the difference (until 2026-12-01) left the host's time
    out of both and priced a check dearer against a plain step than it is (free text's steps of 1.6 ms pipelined and
    2.5 synchronous: 2x instead of 1.56x). The pipelined interval at least half the plain step's fitted time, the
    synchronous one at least the pipelined, each rounded to a twentieth of the fitted time (the prices derived from a
    cost are kept while it stays: Speculator._prices)."""
    a, c, b, d = cost
    plain = a + c * num_requests
    if intervals is None or plain <= 0.0:
        return cost
    synchronous, pipelined = (round(20.0 * x / plain) / 20.0 * plain for x in intervals)
    pipelined = max(pipelined, 0.5 * plain)
    synchronous = max(synchronous, pipelined)
    return (a + pipelined - plain, c, b, d + synchronous - pipelined)


def seconds(cost: StepCost, num_requests: int, num_proposed: int, num_checks: int) -> float:
    a, c, b, d = cost
    return a + c * num_requests + b * num_proposed + d * num_checks


class AcceptanceRates:
    """Each request's chance that a proposed token is accepted once the ones before it were: its accepted tokens
    over its trials (an accepted token, or the rejection that ended a check), starting from the method's rate over
    the recent checks of requests that sample as it does (a prior worth `prior_trials` trials). Greedy and sampled
    requests have a prior each: a greedy request accepts a token when it is the argmax, a sampled one with the
    token's probability; with one prior, free text sampled after repetitive greedy work (an agent's loop, then a chat)
    started every request at the greedy rate (0.9) and checked proposals that did not pay (docs/performance.md)."""

    def __init__(self, prior_trials: float = 4.0, decay: float = 0.995):
        self.prior_trials = prior_trials
        self.decay = decay  # per check: the method's rate follows the workload
        self.prior = {True: [1.0, 2.0], False: [1.0, 2.0]}  # greedy? -> [accepted, trials], starting at 1/2
        self.per_request: dict[str, list[int]] = {}  # request id -> [accepted, trials]

    def observe(self, request_id: str, num_proposed: int, num_accepted: int, greedy: bool) -> None:
        trials = num_accepted + (num_accepted < num_proposed)
        prior = self.prior[greedy]
        prior[0] = prior[0] * self.decay + num_accepted
        prior[1] = prior[1] * self.decay + trials
        counts = self.per_request.setdefault(request_id, [0, 0])
        counts[0] += num_accepted
        counts[1] += trials

    def rate(self, request_id: str, greedy: bool) -> float:
        accepted, trials = self.per_request.get(request_id, (0, 0))
        prior_accepted, prior_trials = self.prior[greedy]
        return (accepted + self.prior_trials * prior_accepted / prior_trials) / (trials + self.prior_trials)

    def forget(self, request_id: str) -> None:
        self.per_request.pop(request_id, None)


def best_net(rate: float, length: int, cost: StepCost, goodput: float) -> float:
    """The expected net gain, in tokens, of checking the best number of a proposal's `length` tokens (best_length)
    at acceptance rate `rate`: sum_{j <= n} rate^j - (b n + d) goodput, 0 where nothing pays."""
    return _best_check(rate, length, cost, goodput)[1]


def best_length(rate: float, length: int, cost: StepCost, goodput: float) -> int:
    """How many of a proposal's `length` tokens to check, for a request whose j-th token is accepted with
    probability rate^j, in a step whose goodput is `goodput` (tokens per second): the n maximizing
    sum_{j <= n} rate^j - (b n + d) goodput, or 0 where that is not positive. The j-th token's term
    rate^j - b goodput falls with j, so n is the last j where it is positive."""
    return _best_check(rate, length, cost, goodput)[0]


def _best_check(rate: float, length: int, cost: StepCost, goodput: float) -> tuple[int, float]:
    """best_length's n and best_net's gain, found together."""
    b, d = cost[2], cost[3]
    bar = b * goodput
    gain, n, best_n, best = 0.0, 0, 0, 0.0
    p = 1.0
    while n < length:
        p *= rate
        if p <= bar:
            break
        n += 1
        gain += p
        net = gain - (b * n + d) * goodput
        if net > best:
            best_n, best = n, net
    return best_n, best


def lowest_paying_rate(length: int, num_requests: int, cost: StepCost, ask_seconds: float = 0.0) -> float:
    """The lowest acceptance rate at which asking a request for a proposal of `length` tokens pays, in a step of
    `num_requests` decodes and no other proposals (the goodput its check must beat is then the plain step's, the
    lowest tokens_that_pay starts from): its check's best net gain must exceed the tokens that `ask_seconds`
    (the proposer's time per request asked, over the share of asks that find a proposal) would have made; 2
    where no rate can. The best net gain rises with the rate, so the rate is found by bisection."""
    goodput = num_requests / seconds(cost, num_requests, 0, 0)
    threshold = ask_seconds * goodput
    if best_net(1.0, length, cost, goodput) <= threshold:
        return 2.0
    low, high = 0.0, 1.0
    for _ in range(24):
        middle = (low + high) / 2
        low, high = (low, middle) if best_net(middle, length, cost, goodput) > threshold else (middle, high)
    return high


def tokens_that_pay(rates: list[float], lengths: list[int], num_requests: int, cost: StepCost) -> list[int]:
    """How many of each proposal's tokens to check (`rates`: each proposing request's acceptance rate, `lengths`:
    its proposal's length) in a step of `num_requests` decoding requests so that the step's goodput E / t is the
    highest: Dinkelbach's iteration, each request's best length (best_length) at the goodput of the last choice,
    from the plain step's, until the choice repeats."""
    keep = None
    expected, proposed, checks = float(num_requests), 0, 0
    for _ in range(16):
        goodput = expected / seconds(cost, num_requests, proposed, checks)
        new_keep = [best_length(rate, length, cost, goodput) for rate, length in zip(rates, lengths)]
        if new_keep == keep:
            break
        keep = new_keep
        expected = num_requests + sum(float(n) if rate >= 1.0 else rate * (1.0 - rate ** n) / (1.0 - rate)
                                      for rate, n in zip(rates, keep))
        proposed, checks = sum(keep), sum(n > 0 for n in keep)
    return keep
