"""The sampler's draw: the distribution it draws from (temperature, top-k, top-p, min-p), tokens of probability 0
never drawn, and a seeded request's draws independent of how its rows are batched; the CPU kernel's draw against its
definition, and PyTorch's where the kernel does not run."""

from collections import Counter

import numpy as np
import pytest
import torch

from torch_shift.engine.request import Request
from torch_shift.engine.sampler import Sampler, draw_uniforms, inverse_cdf
from torch_shift.engine.sampling_params import SamplingParams
from torch_shift.models.fused import sample_rows


def expected_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row follows, computed in float64 from the definitions (one row)."""
    scores = logits.double() / params.temperature
    order = scores.argsort(descending=True)
    probs = torch.softmax(scores, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.min_p > 0.0:  # first, as vLLM: top_p's mass is of what min_p keeps
        keep &= probs >= params.min_p * probs.max()
    if params.top_k > 0:
        keep[order[params.top_k:]] = False
    if params.top_p < 1.0:
        kept = torch.where(keep, probs, 0.0)
        kept = kept / kept.sum()
        before = torch.cumsum(kept[order], dim=0) - kept[order]  # mass of strictly better tokens
        keep[order[before >= params.top_p]] = False
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=2.0, top_p=0.7, min_p=0.2),  # top_p over what min_p kept: 2 tokens, not 4
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


def _reference_weights(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """sample_row's weights by its definition, in float64: x = logits / temperature (float32), exp(x - max), the
    weights below min_p of the largest dropped, the top_k largest, the top_p mass of what is left (ties by index)."""
    x = logits.astype(np.float32) / np.float32(temperature)
    order = np.lexsort((np.arange(len(x)), -x.astype(np.float64)))  # largest first, ties by index
    w = np.exp(x.astype(np.float64) - x.max())
    keep = w >= min_p
    if 0 < top_k < len(x):
        keep[order[top_k:]] = False
    w = np.where(keep, w, 0.0)
    if top_p < 1.0:
        before = np.cumsum(w[order]) - w[order]
        cut = order[(before >= top_p * w.sum()) & (np.arange(len(x)) > 0)]
        w[cut] = 0.0
    return w


@pytest.mark.parametrize("vocab, temperature, top_k, top_p, min_p", [
    (100, 1.0, 0, 1.0, 0.0), (3000, 0.7, 40, 1.0, 0.0), (3000, 1.2, 0, 0.9, 0.0), (50_000, 2.0, 0, 0.95, 0.0),
    (50_000, 0.8, 1000, 0.5, 0.05), (257, 0.5, 0, 1.0, 0.1), (3000, 1.0, 0, 0.5, 0.2)])
def test_the_cpu_kernels_draw_is_the_inverse_cdf_of_its_definition(vocab, temperature, top_k, top_p, min_p):
    """models.fused.sample_rows (the C++ draw that the host's sampler and the C++ decoder's launched steps run)
    against its definition in float64: at uniforms across [0, 1), the token drawn is the one whose cumulative weight
    first exceeds the uniform times the total, to the kernel's rounding (its exp is good to about 2 ulp), and never
    one of weight 0. Large vocabularies with top-p walk its floors (only the weights above a floor are sorted)."""
    generator = np.random.default_rng(vocab)
    logits = (generator.standard_normal(vocab) * 3).astype(np.float32)
    logits[generator.integers(0, vocab, 5)] = -np.inf
    weights = _reference_weights(logits, temperature, top_k, top_p, min_p)
    cumulative = np.cumsum(weights)
    total = cumulative[-1]
    uniforms = np.concatenate([np.linspace(0.0, 1.0 - 2 ** -24, 199), generator.random(200)]).astype(np.float32)
    draws = np.empty((5, len(uniforms)), dtype=np.float32)
    draws[:4] = np.array([temperature, top_k, top_p, min_p], dtype=np.float32)[:, None]
    draws[4] = uniforms
    rows = torch.from_numpy(logits).repeat(len(uniforms), 1)
    tokens = sample_rows(rows, draws)
    assert tokens is not None, "the CPU kernels are built in CI"
    tokens = tokens.numpy()
    assert (weights[tokens] > 0).all()
    target = uniforms.astype(np.float64) * total
    tolerance = 1e-5 * total
    assert (cumulative[tokens] - weights[tokens] <= target + tolerance).all()
    assert (cumulative[tokens] >= target - tolerance).all()
    assert len(set(tokens.tolist())) > 1
    bf16 = sample_rows(rows.bfloat16(), draws).numpy()  # a bfloat16 row draws as its float32 values
    assert (bf16 == sample_rows(rows.bfloat16().float(), draws).numpy()).all()


def test_the_cpu_kernels_draw_at_the_edges():
    """Temperature 0 draws the argmax (the first of equal maxima); a row with a NaN draws its argmax (the first NaN),
    as does a row of -inf only; a row with one finite value draws it at any uniform."""
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0],
                           [0.5, float("nan"), 1.0, 0.0],
                           [float("-inf")] * 4,
                           [float("-inf"), float("-inf"), 3.0, float("-inf")]])
    for u in (0.0, 0.5, 1.0 - 2 ** -24):
        draws = np.array([[0.0, 1.0, 1.0, 1.0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [u] * 4], dtype=np.float32)
        assert sample_rows(logits, draws).tolist() == [1, 1, 0, 2]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.6, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
                                    SamplingParams(temperature=2.0, top_p=0.7, min_p=0.2)])
def test_pytorchs_draw_follows_the_distribution_too(params, monkeypatch):
    """Where the CPU kernel does not run (a GPU, no compiler), PyTorch's operators draw, with the same uniforms."""
    import torch_shift.engine.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "sample_rows", lambda logits, draws: None)
    test_draws_follow_the_distribution(params)
