"""How many proposed tokens a step checks: those expected to pay for their share of the step's time.

A checked token costs time whether it is accepted or not; it pays when its chance of being accepted exceeds
what the step's time buys per token without it. With a decode step of R requests and S proposed tokens taking
t(R, S) = a + c R + b S, and an expected E tokens out of it (one per request plus the proposals' chances of
acceptance), adding a token accepted with probability p raises the goodput E / t exactly when p > b E / t
(SmartSpec, arXiv 2406.14066, chooses proposal lengths by the same goodput). At batch 1 on a machine whose decode
reads the weights, b is small against a and nearly every proposal pays; at 64 requests on a machine where each
token costs compute, only the likely ones do.

Both sides are measured while serving: the step time by least squares over the last decode-only steps of batch
sizes like the step's (the cost depends on the model, the layout, the machine and the batch size), the chance of
acceptance per request from its own checks (a request that repeats itself accepts most proposals, a free one few),
starting from the method's rate over all requests. A proposal's j-th token is accepted with probability alpha^j
(each accepted after the ones before it).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

_PULL = 2.0  # tokens
_HUBER_ROUNDS = 4
REFIT_EVERY = 16


StepCost = tuple[float, float, float]  # (a, c, b) of t(R, S) = a + c R + b S, in seconds


class StepCostFit:
    """t(R, S) = a + c R + b S (R requests, S proposed tokens), fitted by least squares over the last `window`
    decode-only steps of each range of batch sizes [2^i, 2^(i+1)), with a weak pull of b toward c (a proposed
    token costs about what a request's token costs: without it, steps that never vary S would leave b
    undetermined). Fitting each range on its own prices a batch size from steps like it: a fit over batch 1
    alone cannot tell a from c, and extrapolated to 64 requests it prices their step several times too dear
    (measured: every proposal then looked worth checking)."""

    def __init__(self, window: int = 128, min_steps: int = 4):
        self.window = window
        self.min_steps = min_steps
        self.steps: dict[int, deque[tuple[int, int, float]]] = {}  # range (R's bit length) -> its last steps
        self.fitted: dict[int, StepCost] = {}
        self._since_fit: dict[int, int] = {}

    def observe(self, num_requests: int, num_proposed: int, seconds: float) -> None:
        key = num_requests.bit_length()
        steps = self.steps.setdefault(key, deque(maxlen=self.window))
        steps.append((num_requests, num_proposed, seconds))
        self._since_fit[key] = self._since_fit.get(key, 0) + 1
        # the first fit as soon as there are min_steps, then one every REFIT_EVERY steps (a fit costs ~0.25 ms:
        # at every few steps it was a tenth of a batch-1 step)
        if self._since_fit[key] >= (REFIT_EVERY if key in self.fitted else self.min_steps):
            self._fit(key)

    def _fit(self, key: int) -> None:
        self._since_fit[key] = 0
        data = np.array(self.steps[key], dtype=np.float64)
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        y = data[:, 2]
        if np.linalg.matrix_rank(x) < 2:
            return  # every step alike: nothing to fit yet
        # with one batch size only, a and c are not told apart (least squares takes the smallest pair), which
        # is all the budget needs: it prices steps of the batch sizes of this range
        # the pull toward b = c: a row w (c - b) = 0, which steps that vary S by many tokens outweigh
        x = np.vstack([x, [0.0, _PULL, -_PULL]])
        y = np.append(y, 0.0)
        # Huber weights by iteratively reweighted least squares: a step that the machine slowed (this CPU's steps
        # vary by 10-25% between spells, with spikes above) weighs as a step off by 1.345 robust deviations
        weights = np.ones(len(y))
        for _ in range(_HUBER_ROUNDS):
            root = np.sqrt(weights)[:, None]
            (a, c, b), *_ = np.linalg.lstsq(x * root, y * root[:, 0], rcond=None)
            residuals = np.abs(y[:-1] - x[:-1] @ np.array([a, c, b]))
            scale = 1.4826 * np.partition(residuals, len(residuals) // 2)[len(residuals) // 2]  # np.median: 9x slower
            if scale <= 0.0:
                break
            weights[:-1] = np.minimum(1.0, 1.345 * scale / np.maximum(residuals, 1e-30))
        batch_sizes = data[:, 0]
        if b >= 0 and a + c * batch_sizes.min() > 0 and a + c * batch_sizes.max() > 0:  # else keep the last fit
            self.fitted[key] = (float(a), float(c), float(b))

    def at(self, num_requests: int) -> StepCost | None:
        """The fit for steps of `num_requests` requests: its range's, else a neighbouring range's; None where
        neither has been fitted yet."""
        key = num_requests.bit_length()
        for k in (key, key - 1, key + 1):
            if k in self.fitted:
                return self.fitted[k]
        return None


def seconds(cost: StepCost, num_requests: int, num_proposed: int) -> float:
    a, c, b = cost
    return a + c * num_requests + b * num_proposed


class AcceptanceRates:
    """Each request's chance that a proposed token is accepted once the ones before it were: its accepted tokens
    over its trials (an accepted token, or the rejection that ended a check), starting from the method's rate over
    all requests' recent checks (a prior worth `prior_trials` trials)."""

    def __init__(self, prior_trials: float = 4.0, decay: float = 0.995):
        self.prior_trials = prior_trials
        self.decay = decay  # per check: the method's rate follows the workload
        self.accepted = 1.0  # the method's rate starts at 1/2
        self.trials = 2.0
        self.per_request: dict[str, list[int]] = {}  # request id -> [accepted, trials]

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        trials = num_accepted + (num_accepted < num_proposed)
        self.accepted = self.accepted * self.decay + num_accepted
        self.trials = self.trials * self.decay + trials
        counts = self.per_request.setdefault(request_id, [0, 0])
        counts[0] += num_accepted
        counts[1] += trials

    def rate(self, request_id: str) -> float:
        accepted, trials = self.per_request.get(request_id, (0, 0))
        prior = self.accepted / self.trials
        return (accepted + self.prior_trials * prior) / (trials + self.prior_trials)

    def forget(self, request_id: str) -> None:
        self.per_request.pop(request_id, None)


def _bar(cost: StepCost, num_requests: int, expected: float, num_proposed: int) -> float:
    """The chance of acceptance a token needs to raise the goodput of a step of `num_requests` decodes and
    `num_proposed` proposed tokens that yields `expected` tokens: b E / t."""
    return cost[2] * expected / seconds(cost, num_requests, num_proposed)


def first_token_bar(num_requests: int, cost: StepCost) -> float:
    """The chance of acceptance a proposal's first token needs to pay in a step of `num_requests` decodes and no
    other proposals (the lowest bar: tokens_that_pay's bar only rises from it)."""
    return _bar(cost, num_requests, num_requests, 0)


def tokens_that_pay(rates: list[float], lengths: list[int], num_requests: int, cost: StepCost) -> list[int]:
    """How many of each proposal's tokens to check (`rates`: each proposing request's acceptance rate, `lengths`:
    its proposal's length) in a step of `num_requests` decoding requests: the tokens accepted with probability
    p > b E / t, E and t those of the tokens kept, found by raising the bar until it holds (it only rises)."""
    keep = None
    expected, proposed = float(num_requests), 0
    for _ in range(8):
        bar = _bar(cost, num_requests, expected, proposed)
        if bar <= 0.0:
            return list(lengths)
        new_keep = [0 if rate <= bar else length if rate >= 1.0
                    else min(length, int(math.log(bar) / math.log(rate) - 1e-9))  # the largest j with rate^j > bar
                    for rate, length in zip(rates, lengths)]
        if new_keep == keep:
            break
        keep = new_keep
        expected = num_requests + sum(float(n) if rate >= 1.0 else rate * (1.0 - rate ** n) / (1.0 - rate)
                                      for rate, n in zip(rates, keep))
        proposed = sum(keep)
    return keep
