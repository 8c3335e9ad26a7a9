"""The sampler's draw: the distribution it draws from (temperature, top-k, top-p, min-p), tokens of probability 0
never drawn, and a seeded request's draws independent of how its rows are batched."""

from collections import Counter

import pytest
import torch

from torch_shift.engine.request import Request
from torch_shift.engine.sampler import Sampler, draw_uniforms, inverse_cdf
from torch_shift.engine.sampling_params import SamplingParams


def expected_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row follows, computed in float64 from the definitions (one row)."""
    scores = logits.double() / params.temperature
    order = scores.argsort(descending=True)
    probs = torch.softmax(scores, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_k > 0:
        keep[order[params.top_k:]] = False
    if params.top_p < 1.0:
        kept = torch.where(keep, probs, 0.0)
        kept = kept / kept.sum()
        before = torch.cumsum(kept[order], dim=0) - kept[order]  # mass of strictly better tokens
        keep[order[before >= params.top_p]] = False
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    if params.min_p > 0.0:
        probs = torch.where(probs < params.min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1),
])
def test_draws_follow_the_distribution(params):
    """20,000 rows drawn in one call: counts against the float64 distribution (chi-square at p = 0.001 over the
    tokens with probability), and no token of probability 0 ever drawn."""
    torch.manual_seed(0)
    logits = torch.randn(12) * 2
    logits[3] = float("-inf")  # a token the model rules out
    expected = expected_distribution(logits, params)
    num = 20_000
    requests = [Request(f"r{i}", [1], params, max_tokens=4) for i in range(num)]
    drawn = Sampler(12, seed=3)(logits.repeat(num, 1), requests).token_ids
    counts = Counter(drawn)
    support = [t for t in range(12) if expected[t] > 0]
    assert set(counts) <= set(support), (counts, expected)
    chi2 = sum((counts[t] - num * expected[t].item()) ** 2 / (num * expected[t].item()) for t in support)
    bounds = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
              10: 29.59, 11: 31.26}  # chi-square at p = 0.001 by degrees of freedom
    assert chi2 < bounds[len(support) - 1], (counts, chi2)


def test_inverse_cdf_never_takes_a_token_without_probability():
    """At the ends of the uniform's range, including 1 itself, where rounding could step past the last token with
    probability."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 1e-30, 0.0],
                          [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    for u in (0.0, 1e-9, 0.5, 1.0 - 2 ** -24, 1.0):
        sampled = inverse_cdf(probs, torch.full((3, 1), u)).tolist()
        assert probs[range(3), sampled].gt(0).all(), (u, sampled)
    assert inverse_cdf(probs, torch.full((3, 1), 0.25)).tolist() == [1, 4, 0]
    assert inverse_cdf(probs, torch.full((3, 1), 0.75)).tolist() == [3, 4, 0]


def test_seeded_rows_drawn_together_or_one_by_one_agree():
    """A seeded request's rows drawn in one call (a speculative check) give the tokens, and leave the generator
    where, drawing them one call at a time does; draw_uniforms advances it by as much."""
    torch.manual_seed(1)
    logits = torch.randn(5, 50)
    params = SamplingParams(temperature=0.8, seed=11)

    def request():
        return Request("r", [1, 2, 3], params, max_tokens=10)

    sampler = Sampler(50, seed=0)
    together = request()
    tokens = sampler(logits, [together] * 5).token_ids
    alone = request()
    assert tokens == [sampler(logits[i:i + 1], [alone]).token_ids[0] for i in range(5)]
    skipped = request()
    draw_uniforms(skipped.generator, 5)
    assert torch.equal(together.generator.get_state(), alone.generator.get_state())
    assert torch.equal(skipped.generator.get_state(), alone.generator.get_state())
