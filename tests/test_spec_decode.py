"""Speculative decoding (issue 22): the options, the proposers against brute force, the scheduler's block
accounting under rejections, preemptions and aborts, and the engine's outputs token-identical to decoding without
speculation (greedy, seeded sampling, penalties, stop strings, logprobs, n > 1, structured output), with a
chi-square check that unseeded sampling keeps the model's distribution."""

from __future__ import annotations

import json
import random
import time
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import random_prompts
from test_scheduler import PagedFakeModel, add, check_block_manager, make_request, make_scheduler, reference_outputs

from torch_shift import LLM, SamplingParams
from torch_shift.engine.args import EngineArgs
from torch_shift.engine.output_processor import OutputProcessor
from torch_shift.engine.request import Request, RequestStatus
from torch_shift.engine.sampler import Sampler
from torch_shift.engine.scheduler import ScheduledRequest
from torch_shift.engine.spec_decode import SpeculativeConfig, Speculator
from torch_shift.engine.spec_decode.budget import (
    AcceptanceRates,
    StepCostFit,
    SyncPenalty,
    best_net,
    lowest_paying_rate,
    seconds,
    tokens_that_pay,
    with_sync_penalty,
)
from torch_shift.engine.spec_decode.ngram import ngram_proposal
from torch_shift.engine.spec_decode.suffix import (
    PAD,
    Draft,
    GlobalTree,
    NativeDraft,
    SuffixProposer,
    address,
    best_draft,
)
from torch_shift.kernels import cpu_kernels
from torch_shift.models.fused import ROW_ARGMAX

# -- options ------------------------------------------------------------------------------------------------


def test_options_are_vllms_and_a_wrong_one_is_named():
    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)  # as vLLM: one bound gives the other
    suffix = SpeculativeConfig.from_user(json.dumps({"method": "suffix", "suffix_decoding_max_tree_depth": 16}))
    assert suffix.num_speculative_tokens == 16  # vLLM: the tree depth by default
    # vLLM's other spellings: the method from `model` (older docs), null as unset, `model` naming the proposer
    assert SpeculativeConfig.from_user({"model": "[ngram]", "num_speculative_tokens": 4}).method == "ngram"
    draft = SpeculativeConfig.from_user({"model": "/ckpt/draft", "num_speculative_tokens": 4})
    assert (draft.method, draft.model) == ("draft_model", "/ckpt/draft")
    assert SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": None,
                                        "prompt_lookup_max": None}).prompt_lookup_min == 5
    assert SpeculativeConfig.from_user({"method": "suffix", "num_speculative_tokens": None}).num_speculative_tokens \
        == 24
    assert SpeculativeConfig.from_user({"method": "ngram", "model": "ngram", "num_speculative_tokens": 2}).model is None
    for bad, message in [
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 0},
         "prompt_lookup_max=0 must be an integer >= 1"),  # the option given, not the one it fills in
        ({"method": ["ngram"], "num_speculative_tokens": 4}, "method is a name"),
        ({"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": True}, "disable_by_batch_size"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": True}, "suffix_decoding_max_spec_factor=True"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
        ({"num_speculative_tokens": 2}, "'method' is required"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 3},
         "'suffix_decoding_max_tree_depth' does not apply to method 'ngram'"),
        ({"method": "suffix", "typo": 1}, "unknown option 'typo'"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "suffix_decoding_min_token_prob=2"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
         "prompt_lookup_max=2 must be >= prompt_lookup_min=5"),
        ({"method": "suffix", "disable_by_batch_size": 0}, "disable_by_batch_size=0"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": float("inf")}, "must be a finite number"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "must be >= 2"),  # would never propose
        # the depth named, not the token count it fills in
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth=0 must be >= 2"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 2.5},
         "suffix_decoding_max_tree_depth=2.5 must be an integer"),
        ("{not json", "not JSON"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_user(bad)
    # a proposal is shorter than the context (k = 10**6 took 27 s a generate in the budget's search, and made as many
    # per-position metrics)
    for too_long, name in [({"method": "ngram", "num_speculative_tokens": 10**6}, "num_speculative_tokens"),
                           ({"method": "suffix", "suffix_decoding_max_tree_depth": 10**7}, "max_tree_depth")]:
        with pytest.raises(ValueError, match=f"{name}=.* must be below the context, max_model_len=1024"):
            LLM(speculative_config=too_long)
    # the depth is checked only where a method reads it: n-gram with a context of 20 tokens
    assert LLM(max_model_len=20, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                     "prompt_lookup_min": 1}).generate(
        "And God said", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
    # a finite factor past the depth allows what the depth allows (1e308 x L overflowed int())
    huge = LLM(speculative_config={"method": "suffix", "suffix_decoding_max_spec_factor": 1e308,
                                   "goodput_budget": False})
    for _ in range(2):
        assert huge.generate("And God said unto Moses, " * 6, SamplingParams(max_tokens=24, temperature=0.0),
                             use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="the draft model '/no/such/draft': no such directory"):
        LLM(speculative_config={"method": "draft_model", "model": "/no/such/draft", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="model=None must name the draft's checkpoint"):
        EngineArgs("some-model", speculative_config={"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(TypeError, match="a dict"):
        SpeculativeConfig.from_user(3)


def test_suffix_decoding_beside_a_draft_is_arctics_option():
    """ArcticInference's `enable_suffix_decoding` on the draft method: the suffix options then apply, and suffix
    drafts may run to the tree's depth; without it they are refused by name."""
    both = SpeculativeConfig.from_user({"method": "draft_model", "model": "/ckpt/draft", "num_speculative_tokens": 3,
                                        "enable_suffix_decoding": True, "suffix_decoding_max_tree_depth": 12})
    # a match of L tokens proposes at most min(L, depth - L): 6 at depth 12
    assert (both.label, both.max_proposal_tokens, both.max_suffix_tokens) == ("draft_model+suffix", 6, 6)
    assert both.as_dict()["enable_suffix_decoding"] is True
    draft = SpeculativeConfig.from_user({"method": "draft_model", "model": "/ckpt/draft", "num_speculative_tokens": 3})
    assert (draft.label, draft.max_proposal_tokens) == ("draft_model", 3)
    assert "suffix_decoding_max_tree_depth" not in draft.as_dict()
    for bad, message in [
        ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "suffix_decoding_min_token_prob": 0.2},
         "'suffix_decoding_min_token_prob' applies to method 'draft_model' only with 'enable_suffix_decoding'"),
        ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "enable_suffix_decoding": False,
          "suffix_decoding_max_tree_depth": 8}, "only with 'enable_suffix_decoding': true"),
        ({"method": "ngram", "num_speculative_tokens": 3, "enable_suffix_decoding": True},
         "'enable_suffix_decoding' does not apply to method 'ngram'"),
        ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "enable_suffix_decoding": 1},
         "enable_suffix_decoding=1 must be true or false"),
        ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "enable_suffix_decoding": "yes",
          "suffix_decoding_max_tree_depth": 8}, "enable_suffix_decoding='yes' must be true or false"),
        ({"method": "draft_model", "model": "d", "num_speculative_tokens": 13, "enable_suffix_decoding": True},
         "no suffix draft can reach num_speculative_tokens=13 tokens: at most 12"),
        ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "enable_suffix_decoding": True,
          "suffix_decoding_max_spec_factor": 0}, "at most 0 with"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_user(bad)


# -- proposers against brute force --------------------------------------------------------------------------


def brute_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's rule, literally: the longest n in [min_n, max_n] whose last-n tokens occur earlier (ending before the
    last token), at the earliest such occurrence; the k tokens after it."""
    total = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= total:
            continue
        suffix = tokens[total - n:]
        for start in range(total - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


# the matcher's ways: in Python, following occurrences with numpy one token at a time above `suffix.FEW` of them, all
# at once (a matrix, then Python lists) at or below it; and in C++ (kernels/cpu_suffix.cpp); every brute-force check
# runs with each Python way alone, with both, and in C++
@pytest.fixture(params=[0, 3, 10**9, "native"], ids=["numpy", "both", "lists", "native"])
def few(request, monkeypatch):
    from torch_shift.engine.spec_decode import suffix

    if request.param == "native":
        if cpu_kernels() is None:
            pytest.skip("torch_shift's CPU kernels cannot be built here")
        return request.param
    monkeypatch.setattr(suffix, "NATIVE", False)
    monkeypatch.setattr(suffix, "FEW", request.param)
    return request.param


def test_ngram_matches_vllms_rule(few):
    assert ngram_proposal(np.array([1, 2, 3, 4, 1, 2, 3]), 2, 2, 2) == [4, 1]
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 5)
        assert ngram_proposal(np.array(tokens), lo, hi, k) == brute_ngram(tokens, lo, hi, k), (tokens, lo, hi, k)


class TrieNode:
    def __init__(self):
        self.count = 0
        self.children: dict[int, TrieNode] = {}


def build_trie(sequences: list[list[int]], max_depth: int) -> TrieNode:
    """An explicit suffix trie: every suffix of every sequence, cut at max_depth tokens, counted at every node."""
    root = TrieNode()
    for seq in sequences:
        for start in range(len(seq)):
            node = root
            node.count += 1
            for token in seq[start:start + max_depth]:
                node = node.children.setdefault(token, TrieNode())
                node.count += 1
    return root


def brute_speculate(root: TrieNode, context: list[int], max_depth: int, max_spec: int, factor: float,
                    min_prob: float, first_len: int = 1) -> tuple[list[int], float]:
    """ArcticInference's rule over an explicit trie: for every match length, the most frequent path (ties to the
    smallest token) while its probability stays >= min_prob; the best score wins, ties to the longer match."""
    context = context[-max_depth:]
    best: tuple[list[int], float] = ([], 0.0)
    for length in range(first_len, len(context)):
        node = root
        for token in context[len(context) - length:]:
            node = node.children.get(token)
            if node is None:
                break
        if node is None:
            break
        limit = min(max_spec, int(length * factor + 1e-6), max_depth - length)
        tokens, prob, score = [], 1.0, 0.0
        while len(tokens) < limit and node.children:
            token, child = min(node.children.items(), key=lambda kv: (-kv[1].count, kv[0]))
            prob *= child.count / node.count
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            node = child
        if score >= best[1] and (tokens or not best[0]):
            best = (tokens, score)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_suffix_tree_matches_an_explicit_trie(seed, few):
    rng = random.Random(seed)
    depth = rng.choice([4, 8, 24])
    proposer = SuffixProposer(max_depth=depth, max_cached_requests=0, max_spec_factor=rng.choice([0.5, 1.0, 2.0]),
                              min_token_prob=rng.choice([0.0, 0.1, 0.4]))
    for _ in range(60):
        period = rng.randint(2, 6)
        tokens = [rng.randrange(5) for _ in range(period)] * rng.randint(1, 6) + [rng.randrange(5)
                                                                                for _ in range(rng.randint(0, 12))]
        padded = np.full(len(tokens) + depth + 4, PAD, dtype=np.int64)
        padded[:len(tokens)] = tokens
        k = rng.randint(1, 12)
        draft = proposer.speculate(padded[:len(tokens)], padded, k)
        expected, score = brute_speculate(build_trie([tokens], depth), tokens, depth, k,
                                          proposer.max_spec_factor, proposer.min_token_prob)
        assert draft.token_ids == expected and draft.score == pytest.approx(score), tokens


@pytest.mark.parametrize("lookup_every", [1, 7])
def test_global_tree_matches_an_explicit_trie_and_evicts_first_in_first_out(few, lookup_every):
    """Looked up after every output, and after several (outputs are indexed at the next lookup: some evicted, some
    compacted away before it)."""
    rng = random.Random(7)
    depth = 8
    tree = GlobalTree(depth, max_cached_requests=5, kernels=cpu_kernels() if few == "native" else None)
    outputs = []
    for i in range(40 * lookup_every):
        outputs.append([rng.randrange(4) for _ in range(rng.randint(2, 30))])
        tree.add(outputs[-1])
        cached = outputs[-5:]
        assert tree.num_cached == len(cached)
        if i % lookup_every:
            continue
        context = [rng.randrange(4) for _ in range(rng.randint(3, 12))]
        if few == "native":  # the tree's index in C++
            context_array = np.array(context)
            found = NativeDraft(cpu_kernels()).from_tree(tree, address(context_array), len(context), depth, 6, 1.0,
                                                         0.1)
            draft = found if found is not None else Draft()
        else:
            draft = best_draft(tree.tokens, tree.matches(np.array(context)), 2, depth, 6, 1.0, 0.1)
        expected, score = brute_speculate(build_trie(cached, depth), context, depth, 6, 1.0, 0.1, first_len=2)
        assert draft.token_ids == expected and draft.score == pytest.approx(score), (i, context)
        if few == "native" and expected:  # the pair filter lets every pair of a cached output through
            assert tree.may_hold(np.array(context)), (i, context)
    assert tree.num_dead <= tree.length  # evicted outputs were compacted away as they accumulated


def test_suffix_proposal_takes_the_global_trees_draft_only_where_it_scores_more(few):
    rng = random.Random(11)
    depth, k = 8, 6
    proposer = SuffixProposer(max_depth=depth, max_cached_requests=4, max_spec_factor=1.0, min_token_prob=0.1)
    outputs = []
    for i in range(60):
        if i % 3 == 0:
            outputs.append([rng.randrange(4) for _ in range(rng.randint(2, 30))])
            proposer.global_tree.add(outputs[-1])
        period = rng.randint(2, 5)
        tokens = [rng.randrange(4) for _ in range(period)] * rng.randint(1, 5) + [rng.randrange(4)
                                                                                for _ in range(rng.randint(1, 8))]
        padded = np.full(len(tokens) + depth + 4, PAD, dtype=np.int64)
        padded[:len(tokens)] = tokens
        draft = proposer.speculate(padded[:len(tokens)], padded, k)
        local = brute_speculate(build_trie([tokens], depth), tokens, depth, k, 1.0, 0.1)
        remote = brute_speculate(build_trie(outputs[-4:], depth), tokens, depth, k, 1.0, 0.1, first_len=2)
        expected, score = remote if remote[1] > local[1] + 1e-9 else local
        assert draft.token_ids == expected and draft.score == pytest.approx(score), (i, tokens)


def test_native_suffix_drafts_are_the_python_rules_exactly(monkeypatch):
    """The C++ matcher against the Python one on longer texts than the trie tests (both trees, repeats of varying
    periods with noise, every option): the same tokens, scores (bitwise), and match lengths."""
    from torch_shift.engine.spec_decode import suffix

    if cpu_kernels() is None:
        pytest.skip("torch_shift's CPU kernels cannot be built here")
    rng = random.Random(5)
    for trial in range(12):
        options = dict(max_depth=rng.choice([8, 24, 64]), max_cached_requests=rng.choice([3, 50]),
                       max_spec_factor=rng.choice([0.5, 1.0, 2.5]), min_token_prob=rng.choice([0.0, 0.1, 0.3]))
        native = SuffixProposer(**options)
        monkeypatch.setattr(suffix, "NATIVE", False)
        python = SuffixProposer(**options)
        monkeypatch.undo()
        assert native.native is not None and python.native is None
        vocab = rng.choice([3, 8, 50])
        for i in range(30):
            phrase = [rng.randrange(vocab) for _ in range(rng.randint(2, 12))]
            tokens = []
            while len(tokens) < rng.randint(5, 400):
                tokens += phrase if rng.random() < 0.7 else [rng.randrange(vocab)]
            if i % 4 == 0:
                native.global_tree.add(tokens)
                python.global_tree.add(tokens)
            padded = np.full(len(tokens) + options["max_depth"] + 2, PAD, dtype=np.int64)
            padded[:len(tokens)] = tokens
            k = rng.randint(1, 16)
            ours, theirs = (p.speculate(padded[:len(tokens)], padded, k) for p in (native, python))
            assert (ours.token_ids, ours.score, ours.match_len, ours.scores) == (
                theirs.token_ids, theirs.score, theirs.match_len, theirs.scores), (trial, i)


# -- the scheduler: blocks under rejections, preemptions and aborts -----------------------------------------


class NoisyOracle:
    """Proposes a request's true continuation (from the fake model's reference), corrupted at random positions:
    every check then accepts some proposals and rejects the rest."""

    def __init__(self, references: dict[str, list[int]], seed: int):
        self.references = references
        self.rng = random.Random(seed)
        self.name = "oracle"

    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        return [self._propose(request, k) for request, k in zip(requests, max_tokens)]

    def _propose(self, request: Request, max_tokens: int) -> list[int]:
        done = request.num_output_tokens
        truth = self.references[request.request_id][done:done + self.rng.randint(0, max_tokens)]
        return [t if self.rng.random() < 0.8 else t + 1 for t in truth]

    def on_finish(self, request: Request, cache: bool) -> None:
        pass


@pytest.mark.parametrize("seed", range(3))
def test_rejected_proposals_give_their_blocks_back_and_outputs_do_not_change(seed):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=40, budget=32, max_seqs=6)
    requests = [make_request(f"r{i}", rng.randint(1, 30), max_tokens=rng.randint(1, 40)) for i in range(24)]
    references = {r.request_id: reference_outputs(r.prompt_token_ids, r.max_tokens) for r in requests}
    speculator = Speculator(SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 5}),
                            sched.config.max_model_len, NoisyOracle(references, seed))
    model = PagedFakeModel(sched)
    add(sched, *requests)
    accepted = 0
    for _ in range(3000):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sampled = model(out)
        for e in out.scheduled:
            if e.spec_token_ids and e.sample:
                accepted += len(sampled[e.request_id]) - 1
        updated = sched.update_from_output(out, sampled)
        speculator.propose(updated, len(sched.running))
        for request in sched.running:  # no request holds a block past what its tokens and proposals need
            pool = sched.pools[request.replicas[0]]
            assert len(pool.req_blocks[request.request_id]) <= pool.blocks_needed(request.num_tokens + 5)
        check_block_manager(sched.block_manager)
        if rng.random() < 0.03 and sched.running:
            sched.finish_request(rng.choice(sched.running).request_id, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert accepted > 0 and sched.num_preemptions > 0  # both paths ran
    for r in requests:
        if r.status is not RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == references[r.request_id]
    pool = sched.block_manager
    assert pool.num_free_blocks == pool.num_blocks and not pool.req_blocks


# -- sampling keeps the model's distribution -----------------------------------------------------------------


def test_checking_proposals_keeps_the_distribution():
    """Unseeded draws at temperature 1 through the check, with a proposal the model rates at 0.3: the first token
    follows the model's distribution (chi-square, 3 degrees of freedom, p = 0.001 bound) and the proposal is
    accepted about 30% of the time."""
    probs = torch.tensor([0.3, 0.4, 0.2, 0.1])
    logits = torch.log(probs).repeat(2, 1)  # two positions: the proposal's and the one after it
    processor = OutputProcessor(None, Sampler(4, seed=1), max_model_len=100)
    params = SamplingParams(temperature=1.0, max_tokens=10)
    counts: Counter[int] = Counter()
    num = 4000
    for i in range(num):
        request = Request(f"r{i}", [1, 2], params, max_tokens=10)
        entry = ScheduledRequest(request, 2, 1, True, False, ([0],), [0])
        drawn = processor.sample([[entry]], [logits])[request.request_id]
        counts[drawn[0]] += 1
        assert drawn[0] != 0 or len(drawn) == 2  # accepted: one more token drawn after it
    chi2 = sum((counts[t] - num * p) ** 2 / (num * p) for t, p in enumerate(probs.tolist()))
    assert chi2 < 16.27, (counts, chi2)


def test_greedy_checks_read_the_argmax_rows_their_logits_carry():
    """The C++ decoder's logits carry each row's argmax (ROW_ARGMAX): a greedy check reads its own rows of them (here
    planted, unlike the logits' own argmax), and where the logits are wider than the vocabulary, whose argmax the rows
    are not, the vocabulary's columns."""
    processor = OutputProcessor(None, Sampler(6, seed=1), max_model_len=100)
    params = SamplingParams(temperature=0.0, max_tokens=10)

    def check(logits):
        first, second = (Request(f"r{i}", [1, 2], params, max_tokens=10) for i in range(2))
        entries = [ScheduledRequest(first, 3, 1, True, False, ([0],), (3, 4)),
                   ScheduledRequest(second, 2, 1, True, False, ([0],), (5,))]
        out = processor.sample([entries], [logits])
        return out[first.request_id], out[second.request_id]

    logits = torch.zeros(5, 6)
    logits[:, 0] = 1.0  # every row's own argmax: 0
    setattr(logits, ROW_ARGMAX, np.array([3, 4, 2, 1, 5]))
    assert check(logits) == ([3, 4, 2], [1])  # each request's rows: both proposals kept, then the bonus; a rejection
    wider = torch.cat([logits, torch.full((5, 2), 9.0)], dim=1)
    setattr(wider, ROW_ARGMAX, np.array([7, 7, 7, 7, 7]))
    assert check(wider) == ([0], [0])


# -- the engine: token-identical with and without speculation ------------------------------------------------

# every proposal checked (no goodput budget): these tests are about what checks do, not about which pay, which a
# test model's fast steps on a loaded machine may decide either way (the budget's tests price steps themselves)
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
              "goodput_budget": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_min_token_prob": 0.0,
               "goodput_budget": False},
}


def repetitive_prompts(num: int, seed: int = 0) -> list[list[int]]:
    return [p * 3 + p[:2] for p in random_prompts(num, [4, 7, 3, 9, 5, 6, 8, 2][:num], seed=seed)]


def _outputs(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [sorted((t, lp.logprob) for t, lp in pos.items())
                                               for pos in c.logprobs]) for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("method,compile", [("ngram", False), ("suffix", False), ("ngram", True)],
                         ids=["ngram", "suffix", "ngram-compiled"])
def test_outputs_are_the_same_with_speculation(llama, method, compile):
    """Compiled: checks of 1 + k tokens through the compiled forward's attention call (C++ on the CPU)."""
    _, model_dir = llama
    prompts = repetitive_prompts(6)
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.8, seed=11, ignore_eos=True),  # seeded: the same draws
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, logprobs=3),
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=5, stop_token_ids=[100, 200, 300]),
        SamplingParams(max_tokens=30, temperature=0.7, seed=3, n=2, top_k=20),
        SamplingParams(max_tokens=30, temperature=0.0, logprobs=1, frequency_penalty=0.2),
    ]
    reference = LLM(str(model_dir), compile=compile, block_size=4).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(model_dir), compile=compile, block_size=4, speculative_config=SPECS[method])
    # the model's own greedy continuations, proposed with noise: checks accept at every position
    references = {}
    for prompt, out in zip(prompts, reference):
        references[tuple(prompt)] = out.outputs[0].token_ids
    oracle = NoisyOracle({}, 0)
    oracle._propose = lambda request, k: [t if oracle.rng.random() < 0.85 else t + 1 for t in references[
        tuple(request.prompt_token_ids)][request.num_output_tokens:request.num_output_tokens + oracle.rng.randint(0, k)]]
    speculator = llm.engine.core.speculator
    for proposer in (speculator.proposer, oracle):
        speculator.proposer = proposer
        assert _outputs(llm.generate(prompts, params, use_tqdm=False)) == _outputs(reference)
    stats = llm.stats()["spec_decode"]
    assert stats["method"] == method and stats["num_accepted_tokens"] > 0
    assert stats["num_draft_tokens"] >= stats["num_accepted_tokens"] == sum(stats["accepted_per_position"])
    assert not llm.engine.block_manager.req_blocks  # every block given back
    # vLLM's offline metrics (its speculative decoding example reads them so)
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:spec_decode_num_drafts"].value == stats["num_drafts"]
    assert metrics["vllm:spec_decode_num_accepted_tokens"].value == stats["num_accepted_tokens"]
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert len(per_position) == llm.engine.config.speculative.num_speculative_tokens  # every position, from 0
    assert per_position == stats["accepted_per_position"] and metrics["vllm:num_requests_running"].value == 0


def test_steps_where_every_request_waits_call_no_speculator(llama):
    """Text with little to propose: a request below the bar waits for its next probe, and the engine's steps in
    between call neither observe nor propose (on free text those calls were what the speculator cost). A request
    whose prompt ends meanwhile is proposed for at its first token, and the outputs are those without
    speculation."""
    _, model_dir = llama
    prompts = random_prompts(2, [6, 40], seed=3)
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=5, ignore_eos=True)
    reference = LLM(str(model_dir), compile=False).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(model_dir), compile=False, max_num_batched_tokens=16,
              speculative_config={"method": "suffix", "num_speculative_tokens": 6})  # under the goodput budget
    core, speculator = llm.engine.core, llm.engine.core.speculator
    # prices fixed (measured ones move with the machine, and the bar and the probes' spacing with them): a check
    # pays from a rate of 0.9, probes every 16 tokens
    speculator.step_cost.at = lambda num_requests: (1e-3, 1e-4, 1e-4, 1e-4)
    speculator._prices = lambda num_running, cost, wait_seconds: (0.9, 16)
    steps, calls = [], []
    executor, propose = core.executor, speculator.propose
    core.executor = lambda plan, *tokens, **options: steps.append(plan) or executor(plan, *tokens, **options)
    speculator.propose = lambda updated, *args: calls.append(
        {r.request_id: r.num_output_tokens for r in updated}) or propose(updated, *args)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    assert len(calls) < len(steps) / 2, (len(calls), len(steps))
    late = outputs[1].request_id  # its 40-token prompt takes three steps of 16 tokens
    assert min(call[late] for call in calls if late in call) == 1


def test_quiet_steps_run_ahead_of_the_host(llama):
    """Asynchronous scheduling beside speculative decoding (torch_shift.engine.core): the steps after which the
    speculator proposes nothing (every request waits for a probe or a backoff's end) are launched before the step
    before them completes; a step that proposals follow, or that checks some, waits for its tokens; the intervals
    after both kinds of plain steps are timed for the budget. Requests that arrive or stop in a step that ran ahead,
    preemptions and an abort: the outputs without speculation, every block back."""
    _, model_dir = llama
    prompts = random_prompts(4, [6, 40, 11, 23], seed=3) + repetitive_prompts(2, seed=4)
    params = [SamplingParams(max_tokens=24 + 7 * i, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
              for i in range(6)]
    reference = LLM(str(model_dir), compile=False, block_size=4, async_scheduling=False).generate(
        prompts, params, use_tqdm=False)
    expected = {f"r{i}": out.outputs[0].token_ids for i, out in enumerate(reference)}
    stop = expected["r2"][len(expected["r2"]) // 2]  # r2 stops mid-output, in a step that may have run ahead
    params[2] = SamplingParams(max_tokens=params[2].max_tokens, temperature=0.9, seed=2, stop_token_ids=[stop],
                               ignore_eos=True)
    expected["r2"] = expected["r2"][:expected["r2"].index(stop) + 1]
    llm = LLM(str(model_dir), compile=False, block_size=4, num_kv_blocks=28, max_num_batched_tokens=16,
              async_scheduling=True, speculative_config={"method": "suffix", "num_speculative_tokens": 6})
    engine = llm.engine
    core, speculator = engine.core, engine.core.speculator
    # fixed prices, as above, with a lower bar (a check pays from a rate of 0.3): the repetitive prompts' proposals
    # are checked, the random ones' find nothing and back off
    speculator.step_cost.at = lambda num_requests: (1e-3, 1e-4, 1e-4, 1e-4)
    speculator._prices = lambda num_running, cost, wait_seconds: (0.3, 16)
    ran_ahead, checked, passed = [], [], []
    executor, pass_step = core.executor, speculator.pass_step

    def spy(plan, *tokens, **options):
        ran_ahead.append(bool(options.get("launch")) and core.in_flight is not None)
        checked.append(any(group.num_spec is not None for group in plan.groups))
        return executor(plan, *tokens, **options)

    core.executor = spy
    speculator.pass_step = lambda updated: passed.append(len(updated)) or pass_step(updated)
    outputs = {}
    arrivals = {0: (0, 1, 2), 6: (3,), 20: (4, 5)}  # the repetitive prompts come while the others decode
    step = 0
    while step == 0 or engine.has_unfinished_requests():
        for i in arrivals.get(step, ()):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params[i])
        if step == 30:
            engine.abort_request("r1")
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert outputs == {rid: tokens for rid, tokens in expected.items() if rid != "r1"}
    assert sum(ran_ahead) > 20 and not all(ran_ahead) and any(checked)
    assert not any(c and a for c, a in zip(checked, ran_ahead))  # no step that checks proposals ran ahead
    assert passed  # a request came in, or finished, in a step that ran ahead
    # the intervals after plain decode steps, of both kinds, told to the budget (its prices are fixed here)
    assert {pipelined for _, pipelined in speculator.sync_penalty.intervals} == {False, True}
    assert engine.stats()["num_preemptions"] > 0 and core.in_flight is None
    assert not engine.block_manager.req_blocks and not speculator.proposer.tokens.buffers  # every request forgotten


@pytest.mark.parametrize("layout", [dict(num_scheduler_steps=4, async_scheduling=False), dict(), dict(tp=2)],
                         ids=["one-rank", "one-rank-async", "tp2"])
def test_quiet_steps_run_in_multi_step_runs(llama, layers4, layout):
    """Multi-step scheduling beside speculative decoding: the speculator's quiet steps (every request waits for a
    probe or a backoff's end) and the step after which a proposal may follow run as one plan's run, the others singly
    with their checks; a run never holds proposals. One rank and two run 8 steps a plan by default with speculation
    too, one rank beside single steps launched ahead of the host (there every other run that could start is declined,
    so that a quiet step runs ahead and the next call completes it before the run). The intervals after plain
    decodes, in runs and alone, are timed for the budget; the outputs are those without speculation (greedy, seeded
    sampling, a stop token mid-output), every block back."""
    model_dir = layers4 if layout.get("tp") else llama[1]
    prompts = random_prompts(3, [6, 30, 11], seed=3) + repetitive_prompts(2, seed=4)
    params = [SamplingParams(max_tokens=30 + 6 * i, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
              for i in range(5)]
    engine = dict(compile=False, block_size=4, num_kv_blocks=64, max_num_batched_tokens=32, **layout)
    plain = LLM(str(model_dir), **{**engine, "num_scheduler_steps": 1})
    try:
        reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    finally:
        plain.shutdown()
    stop = reference[1][len(reference[1]) // 2]
    params[1].stop_token_ids = [stop]
    reference[1] = reference[1][:reference[1].index(stop) + 1]
    llm = LLM(str(model_dir), speculative_config={"method": "suffix", "num_speculative_tokens": 6}, **engine)
    try:
        core, speculator = llm.engine.core, llm.engine.core.speculator
        assert core.scheduler.config.num_scheduler_steps == layout.get("num_scheduler_steps", 8)
        # fixed prices (a check pays from a rate of 0.3, probes every 16 tokens); the last two requests propose
        # their true continuations with noise, the others nothing (they wait: backoffs)
        speculator.step_cost.at = lambda num_requests: (1e-3, 1e-4, 1e-4, 1e-4)
        speculator._prices = lambda num_running, cost, wait_seconds: (0.3, 16)
        oracle = NoisyOracle({}, 0)
        truth = {tuple(prompt): tokens for prompt, tokens in zip(prompts[3:], reference[3:])}
        oracle._propose = lambda request, k: [t if oracle.rng.random() < 0.85 else t + 1 for t in truth.get(
            tuple(request.prompt_token_ids), [])[request.num_output_tokens:request.num_output_tokens + k]]
        plans = []
        executor = core.executor
        events = []  # ("run?", a step in flight, whether a run follows) and ("plan", its steps, launched behind one)

        def spy(plan, *tokens, **options):
            plans.append((max(group.num_steps for group in plan.groups),
                          any(group.num_spec is not None for group in plan.groups)))
            events.append(("plan", plans[-1][0], bool(options.get("launch")) and core.in_flight is not None))
            return executor(plan, *tokens, **options)

        core.executor = spy
        runs_quiet_steps, declined = core._runs_quiet_steps, [False]

        def every_other_run_declined() -> bool:
            # a run that could start with nothing in flight is declined every other time: a quiet step is launched
            # ahead instead, and the next call completes it, then runs the rest
            in_flight, runs = core.in_flight is not None, runs_quiet_steps()
            if runs and not in_flight:
                declined[0] = not declined[0]
                runs = not declined[0]
            events.append(("run?", in_flight, runs))
            return runs

        if not layout:
            core._runs_quiet_steps = every_other_run_declined
        for proposer in (speculator.proposer, oracle):
            speculator.proposer = proposer
            plans.clear()
            events.clear()
            outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert outputs == reference
            assert any(steps > 1 for steps, _ in plans) and any(checks for _, checks in plans)
            assert not any(steps > 1 and checks for steps, checks in plans)  # a run never checks proposals
            plan_events = [e for e in events if e[0] == "plan"]
            assert any(ahead for _, _, ahead in plan_events) == (not layout)  # steps launched behind one in flight
            # the step in flight completed, then a run (the next plan, where no request finished meanwhile)
            follows = [next((e for e in events[i + 1:] if e[0] == "plan"), None) for i, e in enumerate(events)
                       if e == ("run?", True, True)]
            assert any(plan is not None and plan[1] > 1 for plan in follows) == (not layout)
        assert llm.stats()["spec_decode"]["num_accepted_tokens"] > 0
        assert {pipelined for _, pipelined in speculator.sync_penalty.intervals} == {False, True}
        assert not llm.engine.block_manager.req_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("seed", range(2))
def test_quiet_steps_ahead_under_random_arrivals_stops_and_aborts(llama, seed):
    """Requests arrive at random steps (repetitive and random prompts, greedy and seeded), some stop on a token,
    some are aborted, blocks run short: every finished output is the one drawn without speculation, and afterwards
    nothing is left of any request (KV blocks, the speculator's waits, backoffs, probes and rates; the proposer told
    of each once)."""
    _, model_dir = llama
    rng = random.Random(seed)
    num = 10
    prompts = [p if i % 2 else p * 3 for i, p in enumerate(random_prompts(num, [rng.randint(3, 12) for _ in range(num)],
                                                                          seed=seed + 20))]
    params = [SamplingParams(max_tokens=rng.randint(4, 30), temperature=0.0 if rng.random() < 0.6 else 0.8, seed=i,
                             ignore_eos=True) for i in range(num)]
    reference = LLM(str(model_dir), compile=False, block_size=4, async_scheduling=False).generate(
        prompts, params, use_tqdm=False)
    expected = {f"r{i}": out.outputs[0].token_ids for i, out in enumerate(reference)}
    for i in (2, 5):  # a token mid-output as a stop token: these requests end early
        stop = expected[f"r{i}"][len(expected[f"r{i}"]) // 2]
        params[i] = SamplingParams(max_tokens=params[i].max_tokens, temperature=params[i].temperature, seed=i,
                                   stop_token_ids=[stop], ignore_eos=True)
        expected[f"r{i}"] = expected[f"r{i}"][:expected[f"r{i}"].index(stop) + 1]
    llm = LLM(str(model_dir), compile=False, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16,
              async_scheduling=True, speculative_config={"method": "suffix", "num_speculative_tokens": 6})
    engine = llm.engine
    core, speculator = engine.core, engine.core.speculator
    speculator.step_cost.at = lambda num_requests: (1e-3, 1e-4, 1e-4, 1e-4)
    # checks, probes, neither
    speculator._prices = lambda num_running, cost, wait_seconds: (rng.choice([0.3, 0.9, 2.0]), 16)
    oracle = NoisyOracle(dict(expected), seed)  # the true continuations, some tokens wrong: checks keep a part
    finished = []
    oracle.on_finish = lambda request, cache: finished.append(request.request_id)
    speculator.proposer = oracle
    arrivals = sorted(rng.sample(range(40), num))
    aborted = {f"r{i}" for i in rng.sample(range(num), 2)}
    ran_ahead, done_aborting = [], set()
    executor = core.executor
    core.executor = lambda plan, *tokens, **options: ran_ahead.append(
        bool(options.get("launch")) and core.in_flight is not None) or executor(plan, *tokens, **options)
    outputs, step, added = {}, 0, 0
    while added < num or engine.has_unfinished_requests():
        while added < num and arrivals[added] <= step:
            engine.add_request(f"r{added}", {"prompt_token_ids": prompts[added]}, params[added])
            added += 1
        for rid in aborted - done_aborting:
            request = engine.scheduler.requests.get(rid)
            if request is not None and request.num_output_tokens >= 2:
                engine.abort_request(rid)
                done_aborting.add(rid)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert {rid: tokens for rid, tokens in outputs.items() if rid not in aborted} == {
        rid: tokens for rid, tokens in expected.items() if rid not in aborted}
    assert sum(ran_ahead) > 10 and done_aborting and llm.stats()["spec_decode"]["num_accepted_tokens"] > 0
    assert core.in_flight is None and not engine.block_manager.req_blocks
    assert sorted(finished) == sorted(expected)  # the proposer told of each request once
    assert not speculator._quiet and not speculator._backoff
    assert not speculator._shadows and not speculator.acceptance.per_request


def test_a_preempted_request_drops_its_proposals():
    """Proposals follow a request's last token on the host; a request that leaves the device (here preempted)
    drops them, as a step scheduled before its next token arrives would take them as following that token."""
    sched = make_scheduler(num_blocks=8, budget=32, max_seqs=4)
    request = make_request("a", 9, max_tokens=20)
    add(sched, request)
    out = sched.schedule()
    sched.update_from_output(out, {"a": 7})
    request.spec_token_ids = [1, 2, 3]
    sched._preempt(request, sched.schedule())
    assert request.spec_token_ids == [] and request.status is RequestStatus.PREEMPTED


def test_a_grammar_that_fails_in_a_check_keeps_the_tokens_accepted_before_it():
    """A check whose last draw broke the request's grammar: the accepted proposals before it are output (their KV
    was computed), the failing draw is not, and the request ends with "error"; its blocks go back."""
    sched = make_scheduler(num_blocks=8, budget=32, max_seqs=4)
    request = make_request("a", 9, max_tokens=20)
    add(sched, request)
    sched.update_from_output(sched.schedule(), {"a": 7})
    request.spec_token_ids = [11, 12, 13]
    out = sched.schedule()
    assert out.scheduled[0].spec_token_ids == (11, 12, 13)
    request.error = "the output could not be kept to its grammar: token refused"  # as the sampler sets it
    sched.update_from_output(out, {"a": [11, 12, 5]})  # 11 and 12 accepted, 5 drawn where the grammar failed
    assert request.output_token_ids == [7, 11, 12] and request.status is RequestStatus.FINISHED_ERROR
    assert request.stop_reason == request.error and not sched.pools[0].req_blocks


@pytest.mark.parametrize("first_stage", [0, 2], ids=["token-alone", "drafted"])
def test_a_redrafting_check_beside_an_admitted_request_drops_its_fillers(first_stage):
    """A redrafting check's slots past its first stage's proposals hold fillers, which the C++ decoder drafts over,
    only in a plan of its request alone: beside a request admitted into its group they are dropped (the check runs
    its first stage's proposals, or its token alone), the budget they took given back; alone it keeps them, marked
    (ScheduledRequest.spec_fillers). Every block back at the end."""
    from torch_shift.engine.request import Redrafting

    sched = make_scheduler(num_blocks=32, budget=64, max_seqs=4)
    request = make_request("a", 9, max_tokens=40)
    add(sched, request)
    sched.update_from_output(sched.schedule(), {"a": 7})

    def propose():
        request.spec_token_ids = [11, 12][:first_stage] + [7] * (20 - first_stage)
        request.spec_stage = first_stage
        request.spec_redraft = Redrafting(2, 6, 16, 24, 1.0, 0.1, False)

    propose()
    out = sched.schedule()
    (alone,) = out.scheduled
    assert alone.num_tokens == 21 and alone.spec_fillers == 20 - first_stage
    sched.update_from_output(out, {"a": [13]})  # nothing accepted
    propose()
    add(sched, make_request("b", 12, max_tokens=3))
    out = sched.schedule()
    check, admitted = out.scheduled
    assert check.request_id == "a" and admitted.request_id == "b"
    assert check.spec_token_ids == (11, 12)[:first_stage] and check.spec_fillers == 0
    assert check.num_tokens == 1 + first_stage and admitted.num_tokens == 12
    assert out.groups[0].num_spec_tokens == first_stage and out.num_scheduled_tokens == 13 + first_stage
    sched.update_from_output(out, {"a": [11, 5][:first_stage] or [5], "b": 9})
    for rid in ("a", "b"):
        sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    assert not sched.pools[0].req_blocks


def test_a_declined_redrafting_checks_fillers_are_no_proposals():
    """A redrafting check the C++ decoder declined ran its forward over every slot: its first stage's proposals
    are counted as a check, the fillers after them (ScheduledRequest.spec_fillers) as nothing, also where its
    request finished in that step (the scheduler then cleared the request's spec_stage and spec_redraft)."""
    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 8})
    speculator = Speculator(config, 100_000, _Sevens())
    for finished in (False, True):
        request = Request(f"r{finished}", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0), 50)
        for num_real, drawn, counted in ((2, [11, 12, 7, 7], [(2, 2)]), (2, [11, 5], [(2, 1)]), (0, [7, 7], [])):
            proposed = (11, 12)[:num_real] + (7,) * (6 - num_real)
            if not finished:
                request.spec_stage = num_real
            entry = ScheduledRequest(request, 1 + len(proposed), 2, True, False, ([0],), proposed, 6 - num_real)
            assert speculator.observe([[entry]], {request.request_id: drawn}, 1e-3) == counted


class _TellsFinishes:
    """Proposes the token 7, as long as asked; records the requests it is told have finished."""

    name = "sevens"

    def __init__(self):
        self.finished = []

    def propose(self, requests, max_tokens):
        return [[7] * n for n in max_tokens]

    def on_finish(self, request, cache):
        self.finished.append(request.request_id)


def test_a_batch_at_disable_by_batch_size_needs_no_speculator_until_it_changes():
    """At disable_by_batch_size a batch proposes nothing while its requests stay: its steps are quiet (with one rank
    they run ahead of the host). Not where a running request was not seen (paused: it may hold proposals). A
    request that finished in a step that ran ahead is forgotten, the proposer told."""
    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2})
    proposer = _TellsFinishes()
    speculator = Speculator(config, 1000, proposer)
    params = SamplingParams(max_tokens=100)
    a, b = (Request(name, list(range(1, 6)), params, 100) for name in "ab")
    speculator.acceptance.observe("b", 3, 1, greedy=False)
    speculator.propose([a, b], 2)
    assert speculator.quiet_steps > 1000 and not a.spec_token_ids
    speculator.propose([a], 2)  # one of two got a token: the other may still hold proposals
    assert speculator.quiet_steps == 0
    speculator.propose([a, b], 2)
    b.status = RequestStatus.FINISHED_LENGTH
    speculator.pass_step([a, b])  # a step that ran ahead ended b
    assert speculator.quiet_steps == 0 and proposer.finished == ["b"] and "b" not in speculator.acceptance.per_request


def _speculator_where_no_check_pays(bar: float = 2.0) -> tuple[Speculator, list[Request]]:
    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 3})
    speculator = Speculator(config, 1000, _TellsFinishes())
    speculator.step_cost.at = lambda num_requests: (1e-3, 1e-4, 1e-4, 1e-4)
    speculator.step_cost.lacks_checks = lambda num_requests: False
    speculator._prices = lambda num_running, cost, wait_seconds: (bar, 16)
    params = SamplingParams(max_tokens=100)
    return speculator, [Request(name, list(range(1, n)), params, 100) for name, n in (("a", 6), ("b", 9))]


def test_a_wait_that_ends_where_no_check_pays_is_looked_at_before_its_tokens():
    """The end of a wait where no check can pay (the bar above 1): Speculator.relook_ahead, called while the step in
    flight's tokens are not on the host, leaves the speculator as `propose` after them would (the waits, the steps
    seen, the quiet steps to come with the step in flight's counted by skip_step), so that the next step runs ahead
    too. Where a check may pay, or an exploring check is due, it changes nothing: that step waits for its tokens. A
    batch that fills the C++ decoder's steps (no room for a proposed token) is such a wait's end too."""
    for bar, max_step_tokens in ((2.0, 0), (0.5, 2)):
        ahead, ahead_requests = _speculator_where_no_check_pays(bar)
        after, after_requests = _speculator_where_no_check_pays(bar)
        ahead.max_step_tokens = after.max_step_tokens = max_step_tokens
        ahead.propose(ahead_requests, 2)
        after.propose(after_requests, 2)
        token = 10
        for _ in range(40):  # two waits' ends and more, from different lengths
            if after.quiet_steps:
                assert ahead.quiet_steps == after.quiet_steps
                for speculator, requests in ((ahead, ahead_requests), (after, after_requests)):
                    for request in requests:
                        request.append_output_token(token)
                    speculator.skip_step(requests)
            else:
                assert ahead.quiet_steps == 0 and ahead.relook_ahead(ahead_requests, 2)
                for request in ahead_requests + after_requests:
                    request.append_output_token(token)
                ahead.skip_step(ahead_requests)
                after.propose(after_requests, 2)
            token += 1
            assert (ahead._quiet, ahead._steps, ahead.quiet_steps) == (after._quiet, after._steps, after.quiet_steps)
            assert not any(r.spec_token_ids for r in after_requests)
    for bar, explore in ((0.5, False), (2.0, True)):  # a check that may pay; a batch size's first checks due
        speculator, requests = _speculator_where_no_check_pays(bar)
        speculator.step_cost.lacks_checks = lambda num_requests: explore
        before = (dict(speculator._quiet), speculator._steps, speculator.quiet_steps, speculator._last_bar)
        assert not speculator.relook_ahead(requests, 2)
        assert (speculator._quiet, speculator._steps, speculator.quiet_steps, speculator._last_bar) == before


def test_steps_run_ahead_through_the_ends_of_waits_where_no_check_pays(llama):
    """With one rank and no check that can pay, every step after the first runs ahead of the host, at the ends of
    the requests' waits too, until one finishes: the outputs are those drawn without speculation."""
    _, model_dir = llama
    prompts = random_prompts(3, [7, 12, 9], seed=8)
    params = [SamplingParams(max_tokens=70, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(3)]
    reference = LLM(str(model_dir), compile=False, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(model_dir), compile=False, async_scheduling=True,
              speculative_config={"method": "suffix", "num_speculative_tokens": 6})
    core, speculator = llm.engine.core, llm.engine.core.speculator
    speculator.step_cost.at = lambda num_requests: (1e-3, 1e-4, 1e-4, 1e-4)
    speculator.step_cost.lacks_checks = lambda num_requests: False
    speculator._prices = lambda num_running, cost, wait_seconds: (2.0, 16)
    launches, executor = [], core.executor
    core.executor = lambda plan, *tokens, **options: launches.append(
        (bool(options.get("launch")), core.in_flight is not None)) or executor(plan, *tokens, **options)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    # the prompts' step waits for its tokens (the proposals of new requests follow it: launched, and waited for),
    # the next one starts the run ahead; then 68 steps launched behind the one in flight, the ends of waits (every
    # 16 steps) included
    assert launches[:2] == [(True, False), (True, False)] and launches[2:] == [(True, True)] * 68


def test_a_finish_and_an_arrival_in_one_step_that_ran_ahead(llama):
    """A request ends in a step that ran ahead while the next step, launched before it completed, admitted another:
    the running requests number the same, yet the speculator must forget the one that ended (its proposer's
    buffer, the suffix tree's cached outputs, a draft's KV blocks)."""
    _, model_dir = llama
    llm = LLM(str(model_dir), compile=False, async_scheduling=True,
              speculative_config={"method": "suffix", "num_speculative_tokens": 6})
    engine = llm.engine
    core, speculator = engine.core, engine.core.speculator
    speculator.step_cost.at = lambda num_requests: (1e-3, 1e-4, 1e-4, 1e-4)
    # no check can pay: quiet up to the next probe
    speculator._prices = lambda num_running, cost, wait_seconds: (2.0, 64)
    finished = []
    on_finish = speculator.on_finish
    speculator.on_finish = lambda request: finished.append(request.request_id) or on_finish(request)
    prompts = random_prompts(3, [9, 5, 7], seed=6)
    engine.add_request("short", {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request("long", {"prompt_token_ids": prompts[1]}, SamplingParams(max_tokens=40, ignore_eos=True))
    short = engine.scheduler.requests["short"]
    arrived_ahead = False
    while engine.has_unfinished_requests():
        in_flight = core.in_flight
        if (not arrived_ahead and in_flight is not None and short in in_flight.requests
                and short.num_output_tokens == short.max_tokens - 1):  # the step in flight makes its last token
            assert speculator.quiet_steps > 0  # the next step runs ahead: it admits the new request
            engine.add_request("late", {"prompt_token_ids": prompts[2]}, SamplingParams(max_tokens=8))
            arrived_ahead = True
        engine.step()
    assert arrived_ahead and sorted(finished) == ["late", "long", "short"]
    assert not speculator.proposer.tokens.buffers and not engine.block_manager.req_blocks


def test_sampled_checks_in_one_draw_keep_seeded_outputs(llama):
    """Sampled requests without penalties are checked in one sampler call over all their positions (a seeded
    one's generator set back to where position-by-position drawing leaves it), beside a request with penalties
    checked position by position: every seeded output is the one drawn without speculation."""
    _, model_dir = llama
    prompts = repetitive_prompts(5, seed=2)
    params = [
        SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=28, temperature=1.0, seed=6, top_p=0.9, ignore_eos=True),
        SamplingParams(max_tokens=26, temperature=0.6, seed=7, top_k=10, min_p=0.05, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=8, presence_penalty=0.4, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.7, seed=9, logit_bias={5: 2.0}, ignore_eos=True),
    ]
    reference = LLM(str(model_dir), compile=False, block_size=4).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(model_dir), compile=False, block_size=4, speculative_config=SPECS["ngram"])
    truth = {tuple(p): out.outputs[0].token_ids for p, out in zip(prompts, reference)}
    oracle = NoisyOracle({}, 1)

    def propose(request, k):
        done = request.num_output_tokens
        following = truth[tuple(request.prompt_token_ids)][done:done + oracle.rng.randint(0, k)]
        return [t if oracle.rng.random() < 0.85 else t + 1 for t in following]

    oracle._propose = propose
    llm.engine.core.speculator.proposer = oracle
    assert _outputs(llm.generate(prompts, params, use_tqdm=False)) == _outputs(reference)
    stats = llm.stats()["spec_decode"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert not llm.engine.block_manager.req_blocks


def test_stop_strings_cut_accepted_tokens(llama):
    """A stop string completed by an accepted proposal ends the output there: the tokens accepted after it are
    dropped, as decoding without speculation never draws them."""
    _, model_dir = llama
    prompts = repetitive_prompts(4, seed=2)
    base = LLM(str(model_dir), compile=False)
    texts = [o.outputs[0].text for o in base.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0,
                                                                              ignore_eos=True), use_tqdm=False)]
    stops = [text[len(text) // 2:len(text) // 2 + 2] for text in texts]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop], logprobs=1)
              for stop in stops if stop]
    reference = base.generate(prompts[:len(params)], params, use_tqdm=False)
    llm = LLM(str(model_dir), compile=False, speculative_config=SPECS["suffix"])
    full = {tuple(p): o.outputs[0].token_ids + [7] * 30 for p, o in zip(prompts, reference)}
    # the true continuation, several tokens past the stop string each time
    llm.engine.core.speculator.proposer.propose = lambda requests, rooms: [
        full[tuple(r.prompt_token_ids)][r.num_output_tokens:r.num_output_tokens + k] for r, k in zip(requests, rooms)]
    assert _outputs(llm.generate(prompts[:len(params)], params, use_tqdm=False)) == _outputs(reference)
    assert any(o.outputs[0].finish_reason == "stop" for o in reference)


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_a_stop_string_ends_a_check_that_a_stop_token_ends_later(llama, include_stop_str_in_output):
    """A check that accepts the tokens completing a stop string and, after them, one of `stop_token_ids`: the
    output ends at the stop string, as decoding without speculation ends it before the stop token is drawn (the stop
    token's id had made the search for stop strings skip the check's text)."""
    _, model_dir = llama
    prompts = repetitive_prompts(4, seed=2)
    base = LLM(str(model_dir), compile=False)
    tokenizer = base.get_tokenizer()
    free = base.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False)
    cases = []
    for prompt, out in zip(prompts, free):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        ends = next((n for n in range(1, len(ids) + 1) if stop and stop in tokenizer.decode(ids[:n])), None)
        later = [t for t in ids[ends:ends + 6] if t not in ids[:ends]] if ends else []
        if later:
            cases.append((prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop],
                                                 stop_token_ids=[later[-1]], logprobs=1,
                                                 include_stop_str_in_output=include_stop_str_in_output)))
    assert len(cases) >= 2
    reference = base.generate([p for p, _ in cases], [q for _, q in cases], use_tqdm=False)
    assert all(isinstance(o.outputs[0].stop_reason, str) for o in reference)
    # one check of the true continuation covers the stop string and the stop token after it
    llm = LLM(str(model_dir), compile=False, speculative_config={**SPECS["suffix"], "num_speculative_tokens": 24})
    full = {tuple(p): o.outputs[0].token_ids + [7] * 30 for p, o in zip(prompts, free)}
    llm.engine.core.speculator.proposer.propose = lambda requests, rooms: [
        full[tuple(r.prompt_token_ids)][r.num_output_tokens:r.num_output_tokens + k] for r, k in zip(requests, rooms)]
    assert _outputs(llm.generate([p for p, _ in cases], [q for _, q in cases], use_tqdm=False)) == _outputs(reference)


def test_structured_output_with_speculation(llama):
    pytest.importorskip("llguidance")
    _, model_dir = llama
    from torch_shift.engine.structured_output import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"]}
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
    prompts = repetitive_prompts(3, seed=4)
    reference = LLM(str(model_dir), compile=False).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(model_dir), compile=False, speculative_config=SPECS["suffix"])
    assert _outputs(llm.generate(prompts, params, use_tqdm=False)) == _outputs(reference)


def test_a_grammar_that_starts_after_its_marker_with_speculation(llama):
    """A grammar waiting for its marker applies from the position after it, inside a check of proposed tokens too."""
    pytest.importorskip("llguidance")
    _, model_dir = llama
    from torch_shift.engine.structured_output import StructuredOutputsParams

    reference_llm = LLM(str(model_dir), compile=False)
    tokenizer = reference_llm.get_tokenizer()
    prompts = repetitive_prompts(3, seed=4)
    free = reference_llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False)
    # a token the outputs write on their own (a check of proposed tokens may then run past it)
    marker = next(t for o in free for t in o.outputs[0].token_ids[4:]
                  if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])
    structured = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}},
                                         starts_after=tokenizer.decode([marker]))
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=structured)
    reference = reference_llm.generate(prompts, params, use_tqdm=False)
    assert any(marker in o.outputs[0].token_ids for o in reference)
    llm = LLM(str(model_dir), compile=False, speculative_config=SPECS["suffix"])
    # proposals of the unconstrained continuation: past the marker they are what the grammar must refuse
    continuation = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, free)}
    llm.engine.core.speculator.proposer.propose = lambda requests, rooms: [
        continuation[tuple(r.prompt_token_ids)][r.num_output_tokens:r.num_output_tokens + k]
        for r, k in zip(requests, rooms)]
    assert _outputs(llm.generate(prompts, params, use_tqdm=False)) == _outputs(reference)
    stats = llm.stats()["spec_decode"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_disable_by_batch_size(llama):
    _, model_dir = llama
    llm = LLM(str(model_dir), compile=False, speculative_config={**SPECS["suffix"], "disable_by_batch_size": 3})
    llm.generate(repetitive_prompts(6), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    assert llm.stats()["spec_decode"]["num_drafts"] == 0  # six requests ran together: above the bound
    llm.generate(repetitive_prompts(2), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    assert llm.stats()["spec_decode"]["num_drafts"] > 0  # two: below it


# -- every family, every rank running the program (torchrun's shape) ----------------------------------------

FAMILIES = {
    "shift": (4, {"sp": 2, "tp": 2, "shift_threshold": 8}),  # small steps in full TP, larger in SP x TP
    "flying": (2, {"dp": 2, "policy": "flying", "policy_config": {"dp_above": 2, "tp_below": 1}}),
    "seesaw": (2, {"pp": 2, "policy": "seesaw", "block_size": 4, "num_kv_blocks": 48, "num_cpu_kv_blocks": 64}),
}


def _generate_with_speculation(rank, world, model_dir, engine_args, prompts, spec):
    llm = LLM(str(model_dir), compile=False, speculative_config=spec, **engine_args)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True)]
    outputs = llm.generate(prompts, params * (len(prompts) // 2), use_tqdm=False)
    stats = llm.stats()
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs], stats


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_is_exact_with_speculation(layers4, draft_llama, family):
    """Suffix decoding under Shift, a draft model (on rank 0, whole) under Flying and Seesaw."""
    from torch_shift.parallel.launch import run_ranks

    world, engine_args = FAMILIES[family]
    spec = SPECS["suffix"] if family == "shift" else draft_spec(draft_llama)
    prompts = repetitive_prompts(6, seed=5)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True)] * 3
    reference = [o.outputs[0].token_ids for o in LLM(str(layers4), compile=False).generate(prompts, params,
                                                                                         use_tqdm=False)]
    ranks = run_ranks(_generate_with_speculation, world, layers4, engine_args, prompts, spec, timeout_s=300)
    for tokens, stats in ranks:
        assert tokens == reference
        assert stats["spec_decode"]["num_drafts"] > 0
    if family == "shift":  # proposed tokens count in the step's size: both layouts ran
        assert len(ranks[0][1]["steps_by_layout"]) == 2


# -- the draft-model method ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_llama(tmp_path_factory):
    """A smaller Llama (one layer, other weights) with the test models' vocabulary and tokenizer."""
    from conftest import build_hf_model, save_checkpoint

    return save_checkpoint(build_hf_model("llama", seed=1, num_hidden_layers=1), tmp_path_factory.mktemp("draft"))


def draft_spec(model_dir, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


def test_a_draft_model_proposes_what_it_would_decode_from_scratch(draft_llama):
    """Rounds of proposals with random acceptance, a bonus token after each, requests joining and leaving, prompts
    cut into several forwards, a pool too small for every request: each proposal is the draft's greedy
    continuation of the request's tokens, computed from scratch by a fresh proposer."""
    from torch_shift.engine.spec_decode.draft import DraftModelProposer
    from torch_shift.models.loader import load_model

    model = load_model(draft_llama)
    rng = random.Random(0)
    proposer = DraftModelProposer(model, num_blocks=40, block_size=4, max_num_batched_tokens=23,
                                  attention_backend="auto")
    params = SamplingParams(max_tokens=200)
    requests = [Request(f"r{i}", p, params, max_tokens=200) for i, p in enumerate(random_prompts(5, seed=2))]
    num_proposed = 0
    for _ in range(12):
        live = [r for r in requests if not r.status.finished]
        rooms = [rng.randint(1, 4) for _ in live]
        proposals = proposer.propose(live, rooms)
        for request, room, proposal in zip(live, rooms, proposals):
            if not proposal:  # the pool was full for it
                continue
            fresh = DraftModelProposer(model, num_blocks=64, block_size=4, max_num_batched_tokens=512)
            assert proposal == fresh.propose([request], [room])[0], request.request_id
            num_proposed += 1
            accepted = rng.randint(0, len(proposal))
            new = proposal[:accepted] + [rng.randrange(6, 512)]
            request.all_token_ids.extend(new)
            request.output_token_ids.extend(new)
        if live and rng.random() < 0.3:
            gone = rng.choice(live)
            gone.status = RequestStatus.FINISHED_STOPPED
            proposer.on_finish(gone, cache=True)
    assert num_proposed > 20 and proposer.num_forwards > 12
    for request in requests:
        proposer.on_finish(request, cache=True)
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_outputs_are_the_same_with_a_draft_model(llama, draft_llama):
    _, model_dir = llama
    prompts = repetitive_prompts(6)
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, logprobs=3),
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=5, stop_token_ids=[100, 200, 300]),
        SamplingParams(max_tokens=30, temperature=0.7, seed=3, n=2, top_k=20),
        SamplingParams(max_tokens=30, temperature=0.0, logprobs=1, frequency_penalty=0.2),
    ]
    reference = LLM(str(model_dir), compile=False, block_size=4).generate(prompts, params, use_tqdm=False)
    # a pool too small for all of them: preemptions, and blocks of rejected proposals taken again by others
    llm = LLM(str(model_dir), compile=False, block_size=4, num_kv_blocks=48, max_num_batched_tokens=32,
              speculative_config=draft_spec(draft_llama))
    assert _outputs(llm.generate(prompts, params, use_tqdm=False)) == _outputs(reference)
    assert llm.stats()["num_preemptions"] > 0
    stats = llm.stats()["spec_decode"]
    assert stats["method"] == "draft_model" and stats["num_draft_tokens"] > 0
    assert not llm.engine.block_manager.req_blocks
    proposer = llm.engine.core.speculator.proposer
    assert not proposer.states and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_the_target_as_its_own_draft_is_always_accepted(llama):
    """Greedy proposals of the target itself: a draft whose KV bookkeeping were wrong anywhere (positions, kept
    proposals, prompts cut into pieces) would propose other tokens than the target draws."""
    _, model_dir = llama
    prompts = random_prompts(6, seed=7)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = LLM(str(model_dir), compile=False).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(model_dir), compile=False, max_num_batched_tokens=32, speculative_config=draft_spec(model_dir, 5))
    assert _outputs(llm.generate(prompts, params, use_tqdm=False)) == _outputs(reference)
    stats = llm.stats()["spec_decode"]
    assert stats["num_accepted_tokens"] >= 0.95 * stats["num_draft_tokens"] > 0, stats


def test_suffix_beside_a_draft_proposes_the_suffix_draft_only_where_it_scores_the_drafts_length(draft_llama):
    """A request whose suffix draft is expected to keep fewer tokens than the draft model's proposal proposes what
    the draft model alone proposes; once its text repeats, its suffix draft (longer than k). After several blocks'
    worth of tokens the draft model never saw (suffix rounds after a draft-model round whose proposal was cut
    short), the draft model's next proposal is still the one a fresh draft computes, and its pool holds the
    request's blocks."""
    from torch_shift.engine.spec_decode.draft import (
        DRAFT_CHECKS_BEFORE_ESTIMATE,
        DraftModelProposer,
        SuffixBesideDraftProposer,
    )
    from torch_shift.models.loader import load_model

    model = load_model(draft_llama)
    k, block_size = 3, 4
    proposer = SuffixBesideDraftProposer(SuffixProposer(max_depth=16),
                                         DraftModelProposer(model, 64, block_size, 64), k)
    suffix_alone = SuffixProposer(max_depth=16)
    request = Request("r", random_prompts(1, seed=5)[0], SamplingParams(max_tokens=200), max_tokens=200)

    def add(tokens: list[int]) -> None:
        request.all_token_ids.extend(tokens)
        request.output_token_ids.extend(tokens)

    def check_draft_models(proposal: list[int]) -> None:
        assert suffix_alone.draft(request, 12).score < k
        fresh = DraftModelProposer(model, 64, block_size, 64)
        assert proposal == fresh.propose([request], [k])[0] and len(proposal) == k
        assert len(proposer.draft.blocks.block_table("r")) == -(-(request.num_tokens + k - 1) // block_size)

    check_draft_models(proposer.propose([request], [12])[0])
    add(proposer.draft.states["r"].fed_proposals[:1] + [3])  # its first token kept, then another drawn
    phrase = [7, 19, 23, 41, 5, 88, 13, 61]
    first = request.num_tokens
    add(phrase * 3)
    for _ in range(3):
        proposal = proposer.propose([request], [12])[0]
        assert proposal == suffix_alone.propose([request], [12])[0] and len(proposal) > k
        n = request.num_tokens - first
        add([phrase[i % len(phrase)] for i in range(n, n + len(proposal) + 1)])  # all kept, and the next one
    add([500, 501, 502])
    check_draft_models(proposer.propose([request], [12])[0])
    assert (proposer.num_suffix_drafts, proposer.num_model_drafts) == (3, 2)
    # a suffix draft expected to keep fewer than k tokens goes to the draft model while its checks are too few to
    # say what it keeps (ArcticInference's rule), and is taken once they say it keeps less
    add([500, 501])
    short = suffix_alone.draft(request, 12)
    assert short.token_ids and short.score < k
    assert proposer.expected_draft_tokens(k) == k and len(proposer.propose([request], [12])[0]) == k
    for _ in range(DRAFT_CHECKS_BEFORE_ESTIMATE):
        proposer.checked("r", k, 1)  # one token kept of every three: p = 1/2
    assert proposer.expected_draft_tokens(k) == pytest.approx(0.5 + 0.25 + 0.125)
    assert short.score >= 0.875 and proposer.propose([request], [12])[0] == short.token_ids
    assert (proposer.num_suffix_drafts, proposer.num_model_drafts) == (4, 3)
    request.status = RequestStatus.FINISHED_STOPPED
    proposer.on_finish(request, cache=True)
    assert proposer.draft.blocks.num_free_blocks == proposer.draft.blocks.num_blocks and not proposer.draft.states
    assert proposer.suffix.global_tree.num_cached == 1


def test_suffix_beside_a_draft_asks_the_draft_model_only_where_it_pays(draft_llama):
    """Where the budget finds the draft model's forwards dearer than what they keep (`draft_model_pays` false), a
    request proposes its suffix draft, however short, or nothing, as under suffix decoding alone, and the draft model
    runs no forward, but for one request now and then that keeps its rate current: once DRAFT_EXPLORE_SHARE of the
    calls' steps covers the last draft-model call's time, proposing what a fresh draft proposes, never for a probe's
    single token. An exploration's time is a debt that a paying call in between does not wipe. A draft-model call
    takes the time set here (a clock that only draft-model calls move)."""
    from torch_shift.engine.spec_decode.draft import (
        DRAFT_EXPLORE_SHARE,
        DraftModelProposer,
        SuffixBesideDraftProposer,
    )
    from torch_shift.models.loader import load_model

    model = load_model(draft_llama)
    k, block_size = 3, 4
    now, call_seconds = [0.0], [1e-3]
    proposer = SuffixBesideDraftProposer(SuffixProposer(max_depth=16), DraftModelProposer(model, 64, block_size, 64),
                                         k, clock=lambda: now[0])
    draft_propose = proposer.draft.propose

    def timed_propose(requests, rooms):
        now[0] += call_seconds[0]
        return draft_propose(requests, rooms)

    proposer.draft.propose = timed_propose
    suffix_alone = SuffixProposer(max_depth=16)
    request = Request("r", [300 + i for i in range(20)], SamplingParams(max_tokens=200), max_tokens=200)
    assert not suffix_alone.draft(request, 12).token_ids
    proposer.propose([request], [12])  # asked while its price is unknown
    assert proposer.draft.num_forwards == k
    proposer.draft_model_pays, proposer.step_seconds = False, 1e-3
    assert proposer.propose([request], [12]) == [[]]
    request.all_token_ids.extend([300, 301])
    request.output_token_ids.extend([300, 301])
    short = suffix_alone.draft(request, 12)
    assert short.token_ids and short.score < k == proposer.expected_draft_tokens(k)

    def calls_to_next_exploration(limit: int) -> tuple[int, list[int] | None]:
        forwards = proposer.draft.num_forwards
        for calls in range(1, limit + 1):
            proposal = proposer.propose([request], [12])[0]
            if proposer.draft.num_forwards > forwards:
                return calls, proposal
            assert proposal == short.token_ids
        return limit + 1, None

    window = 1e-3 / (DRAFT_EXPLORE_SHARE * 1e-3)  # calls of 1 ms steps, after a draft-model call of 1 ms
    calls, explored = calls_to_next_exploration(int(window) + 2)
    assert window - 2 <= calls + 1 <= window + 2
    fresh = DraftModelProposer(model, 64, block_size, 64)
    assert explored == fresh.propose([request], [k])[0] and len(explored) == k
    # an exploration of 5 ms leaves a debt of 4 ms, which a paying call in between does not wipe
    call_seconds[0] = 5e-3
    assert window - 2 <= calls_to_next_exploration(int(window) + 2)[0] <= window + 2
    proposer.draft_model_pays = True
    call_seconds[0] = 1e-3
    assert proposer.propose([request], [12])[0] == explored
    proposer.draft_model_pays = False
    assert calls_to_next_exploration(200)[0] == 201  # 5 ms of credit to make up: 250 calls; without the debt, 50
    # an exploration asks the draft for one request, and not for a probe's single token (never checked)
    proposer.step_seconds = 1.0  # the credit covers a call at once
    probe = Request("p", [100 + i for i in range(20)], SamplingParams(max_tokens=200), max_tokens=200)
    other = Request("o", [200 + i for i in range(20)], SamplingParams(max_tokens=200), max_tokens=200)
    forwards = proposer.draft.num_forwards
    proposals = proposer.propose([probe, other, request], [1, 12, 12])
    assert proposals in ([[], fresh.propose([other], [k])[0], short.token_ids],
                         [[], [], fresh.propose([request], [k])[0]])
    assert proposer.draft.num_forwards == forwards + k


def test_a_draft_ask_is_priced_at_its_one_token_forwards(draft_llama):
    """The draft model's price per request asked is k of its forwards of one token a request, at their time a row:
    feeding a new request's prompt (its first ask) is left out (else a draft once off stayed off), and explorations
    leave the price alone (their one request costs a batched forward's whole time). With k = 1, the call's time."""
    from torch_shift.engine.spec_decode.draft import DraftModelProposer, SuffixBesideDraftProposer
    from torch_shift.models.loader import load_model

    model = load_model(draft_llama)
    for k in (3, 1):
        proposer = SuffixBesideDraftProposer(SuffixProposer(max_depth=16), DraftModelProposer(model, 64, 4, 64), k)
        forward = proposer.draft._forward

        def slow_prompts(runs, forward=forward):
            if any(len(run.token_ids) > 1 for run in runs):
                time.sleep(0.3)
            return forward(runs)

        proposer.draft._forward = slow_prompts
        requests = [Request(f"r{i}", [100 * i + j for j in range(1, 21)], SamplingParams(max_tokens=200), 200)
                    for i in range(1, 3)]
        proposer.propose(requests, [12, 12])
        if k > 1:
            seconds, rows = proposer.draft.last_decode_forwards
            assert rows == 2 * (k - 1) and proposer.draft_ask_seconds == pytest.approx(k * seconds / rows)
            assert proposer.draft_ask_seconds < 0.3  # the prompts' 300 ms left out
        else:
            assert proposer.draft_ask_seconds >= 0.3 / 2  # the call, over its two requests
        price = proposer.draft_ask_seconds
        proposer.draft_model_pays, proposer.step_seconds = False, 100.0  # credit for a call at once
        for request in requests:
            request.all_token_ids.append(7)
        proposer.propose(requests, [12, 12])
        assert proposer.num_explorations == 1 and proposer.draft_ask_seconds == price


def test_outputs_are_the_same_with_suffix_decoding_beside_a_draft(llama, draft_llama):
    _, model_dir = llama
    prompts = repetitive_prompts(4) + random_prompts(2, seed=9)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0.8, seed=11, ignore_eos=True)] * 3
    reference = LLM(str(model_dir), compile=False, block_size=4).generate(prompts, params, use_tqdm=False)
    spec = {**draft_spec(draft_llama, 2), "enable_suffix_decoding": True, "suffix_decoding_min_token_prob": 0.0,
            "goodput_budget": False}
    llm = LLM(str(model_dir), compile=False, block_size=4, num_kv_blocks=48, max_num_batched_tokens=32,
              speculative_config=spec)
    # the second time, the global tree holds the first time's outputs: the greedy requests take suffix drafts
    for _ in range(2):
        assert _outputs(llm.generate(prompts, params, use_tqdm=False)) == _outputs(reference)
    stats = llm.stats()["spec_decode"]
    assert stats["method"] == "draft_model+suffix" and stats["num_accepted_tokens"] > 0
    proposer = llm.engine.core.speculator.proposer
    assert proposer.num_suffix_drafts > 0 and proposer.num_model_drafts > 0
    assert 0 < proposer.num_draft_checks <= proposer.num_model_drafts  # the speculator tells it its checks
    assert any(stats["accepted_per_position"][2:])  # suffix drafts kept past the draft model's k
    assert not llm.engine.block_manager.req_blocks
    assert not proposer.draft.states and proposer.draft.blocks.num_free_blocks == proposer.draft.blocks.num_blocks
    # under the goodput budget, which prices the draft model apart
    llm = LLM(str(model_dir), compile=False, block_size=4, num_kv_blocks=48, max_num_batched_tokens=32,
              speculative_config={**spec, "goodput_budget": True})
    assert _outputs(llm.generate(prompts, params, use_tqdm=False)) == _outputs(reference)
    proposer = llm.engine.core.speculator.proposer
    assert proposer.draft_ask_seconds > 0 and proposer.num_model_drafts > 0
    assert not llm.engine.block_manager.req_blocks and not proposer.draft.states


def test_a_draft_model_that_cannot_serve_is_refused(llama, tmp_path):
    from conftest import build_hf_model, save_checkpoint

    from torch_shift.models.toy import build_tokenizer

    _, model_dir = llama
    other_vocab = save_checkpoint(build_hf_model("llama", vocab_size=384, num_hidden_layers=1), tmp_path / "v")
    with pytest.raises(ValueError, match="vocabulary of 384 tokens, the target 512"):
        LLM(str(model_dir), compile=False, speculative_config=draft_spec(other_vocab))
    other_tokenizer = save_checkpoint(build_hf_model("llama", num_hidden_layers=1), tmp_path / "t", with_tokenizer=False)
    build_tokenizer(other_tokenizer, vocab_size=500)  # other merges, then padded ids: another vocabulary
    with pytest.raises(ValueError, match="another tokenizer than the target"):
        LLM(str(model_dir), compile=False, speculative_config=draft_spec(other_tokenizer))
    with pytest.raises(ValueError, match="no-such-draft"):
        LLM(str(model_dir), compile=False, speculative_config=draft_spec(tmp_path / "no-such-draft"))
    # the rank-0 half alone (what the planner's simulator drives) has no model to run a draft with
    from torch_shift.config import ModelConfig
    from torch_shift.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="a draft's forwards are not modelled"):
        LLMEngine.driver_only(EngineArgs(str(model_dir), speculative_config=draft_spec(model_dir)),
                              ModelConfig.from_dir(model_dir), num_kv_blocks=64)


# -- the goodput budget --------------------------------------------------------------------------------------

def _fitted(a: float, c: float, b: float, d: float = 0.0, batch_sizes=range(32, 64),
            fit: StepCostFit | None = None) -> StepCostFit:
    """Steps of the given batch sizes, each with some of its requests checking some proposed tokens."""
    fit = fit or StepCostFit()
    rng = random.Random(0)
    for _ in range(64):
        r = rng.choice(batch_sizes)
        p = rng.randint(0, r)
        s = p + rng.randrange(0, 3 * p + 1)  # every check has a token
        fit.observe(r, s, p, a + c * r + b * s + d * p)
    return fit


def test_step_cost_fit_recovers_the_step_time():
    fit = _fitted(2e-3, 1.5e-4, 3e-4, 4e-4)
    assert fit.at(40) == pytest.approx((2e-3, 1.5e-4, 3e-4, 4e-4), rel=2e-2)  # the pull toward b = c: a bias
    # one batch size: a and c are not told apart, but the steps of that batch size are priced right
    fit = _fitted(2e-3, 1.5e-4, 3e-4, 4e-4, batch_sizes=(64,))
    assert seconds(fit.at(64), 64, 10, 3) == pytest.approx(2e-3 + 1.5e-4 * 64 + 3e-4 * 10 + 4e-4 * 3, rel=1e-3)
    assert fit.at(64)[2:] == pytest.approx((3e-4, 4e-4), rel=1e-3)
    same = StepCostFit()
    for _ in range(40):
        same.observe(8, 0, 0, 1e-3)
    assert same.at(8) is None  # every step alike: nothing to fit


def test_step_cost_fit_is_not_moved_by_slowed_steps():
    """One step in eight slowed to twice its time (the machine's spells): the fit stays within 5% of the steps'
    cost, where plain least squares prices a one-token check 15% too dear."""
    rng = random.Random(1)
    fit = StepCostFit()
    steps = []
    for i in range(128):
        s = rng.randrange(0, 16)
        t = 1.5e-3 + 5e-5 * s + 2e-4 * (s > 0)
        if i % 8 == 0:
            t *= 2.0
        fit.observe(1, s, int(s > 0), t)
        steps.append((s, t))
    for s in (0, 1, 4, 15):
        assert seconds(fit.at(1), 1, s, int(s > 0)) == pytest.approx(1.5e-3 + 5e-5 * s + 2e-4 * (s > 0), rel=0.05)
    assert fit.at(1)[2] == pytest.approx(5e-5, rel=0.05)
    x = np.array([[1.0, s, s > 0] for s, _ in steps])
    plain = np.linalg.lstsq(x, np.array([t for _, t in steps]), rcond=None)[0]
    assert plain @ [1.0, 1, 1] > 1.1 * (1.5e-3 + 5e-5 + 2e-4)  # what the weights remove


def test_step_cost_fit_prices_each_batch_size_from_steps_like_it():
    """Steps at batch 1 and at batch 64 that no one line fits (a fixed cost at batch 1 that larger batches
    amortize): each batch size is priced by its own range; a batch size two ranges from any fitted one is not
    priced (the budget then checks every proposal) rather than extrapolated."""
    fit = _fitted(2e-3, 0.0, 5e-5, 1e-4, batch_sizes=(1,))
    _fitted(1e-3, 1e-4, 1e-4, 0.0, batch_sizes=(64,), fit=fit)
    assert seconds(fit.at(1), 1, 4, 1) == pytest.approx(2e-3 + 4 * 5e-5 + 1e-4, rel=1e-3)
    assert seconds(fit.at(64), 64, 4, 2) == pytest.approx(1e-3 + 64e-4 + 4e-4, rel=1e-3)
    assert fit.at(100) == fit.at(64) and fit.at(2) == fit.at(1)  # a neighbouring range
    assert fit.at(8) is None


def _goodput(rates, keep, num_requests, cost):
    expected = num_requests + sum(rate ** j for rate, n in zip(rates, keep) for j in range(1, n + 1))
    return expected / seconds(cost, num_requests, sum(keep), sum(n > 0 for n in keep))


@pytest.mark.parametrize("seed", range(60))
def test_tokens_that_pay_maximize_goodput(seed):
    """Against every choice of how many of each proposal's tokens to check, with a cost per check from none to
    more than a request's token."""
    import itertools

    rng = random.Random(seed)
    cost = (rng.uniform(1e-4, 5e-3), rng.uniform(0, 3e-4), rng.uniform(1e-5, 6e-4), rng.choice([0.0, 1.0]) *
            rng.uniform(0, 1e-3))
    num = rng.randint(1, 4)
    rates = [rng.uniform(0.02, 0.98) for _ in range(num)]
    lengths = [rng.randint(0, 5) for _ in range(num)]
    num_requests = rng.choice([1, 2, 8, 64])
    keep = tokens_that_pay(rates, lengths, num_requests, cost)
    assert all(0 <= k <= n for k, n in zip(keep, lengths))
    best = max(_goodput(rates, choice, num_requests, cost)
               for choice in itertools.product(*(range(n + 1) for n in lengths)))
    assert _goodput(rates, keep, num_requests, cost) == pytest.approx(best, rel=1e-9)


def test_a_check_that_costs_more_than_its_tokens_leaves_unlikely_proposals_unchecked():
    """A step where a proposed token is nearly free but a check is not (batch 1 on a small model): a proposal
    accepted one time in ten is not checked, nor asked for (lowest_paying_rate), while a likely one is checked
    whole; with no cost per check, both are checked."""
    dear_check = (1.5e-3, 0.0, 2e-5, 3e-4)
    assert tokens_that_pay([0.1, 0.8], [4, 4], 1, dear_check) == [0, 4]
    assert lowest_paying_rate(4, 1, dear_check) > 0.1
    assert 0.0 < lowest_paying_rate(4, 1, dear_check[:3] + (0.0,)) < 0.1
    assert tokens_that_pay([0.1, 0.8], [4, 4], 1, dear_check[:3] + (0.0,))[1] == 4
    assert tokens_that_pay([0.1, 0.8], [4, 4], 1, dear_check[:3] + (0.0,))[0] > 0


def test_the_proposers_time_per_ask_raises_the_rate_an_ask_needs():
    """Asking a request for a proposal costs the proposer's time whether or not anything is checked: the lowest
    paying rate rises with that time, and no rate pays once an ask costs more than the best check can gain."""
    cost = (1e-3, 1e-4, 2e-5, 1e-4)
    bars = [lowest_paying_rate(4, 8, cost, ask) for ask in (0.0, 2e-5, 1e-4)]
    assert 0.0 < bars[0] < bars[1] < bars[2] < 1.0
    assert lowest_paying_rate(4, 8, cost, 1e-2) == 2.0
    goodput = 8 / seconds(cost, 8, 0, 0)
    assert best_net(bars[1] + 1e-3, 4, cost, goodput) > 2e-5 * goodput > best_net(bars[1] - 1e-3, 4, cost, goodput)


def test_a_check_is_priced_against_steps_that_run_ahead_of_the_host():
    """Where steps run ahead of the host, a plain step costs the interval between the engine's calls of pipelined
    steps and a check (whose step waits for its tokens) that of a synchronous step plus its proposals' fitted time:
    both carry the host's time, which the fit of forwards leaves out. A rate that pays against synchronous forwards
    (free text sampled: about 0.25) no longer pays, a likely proposal still does. The intervals are the medians' per
    range of batch sizes, once each kind was seen a few times."""
    penalty = SyncPenalty()
    for _ in range(3):
        penalty.observe(1, False, 2.5e-3)
        penalty.observe(1, True, 1.6e-3)
    assert penalty.at(1) is None  # too few steps of each kind yet
    for seconds_ in (2.4e-3, 2.6e-3, 9e-3):  # an outlier does not move the median
        penalty.observe(1, False, seconds_)
        penalty.observe(1, True, 1.6e-3)
    assert penalty.at(1) == pytest.approx((2.5e-3, 1.6e-3)) and penalty.at(64) is None
    cost = (1.3e-3, 1e-4, 2e-5, 1e-4)  # a synchronous plain step's forward: 1.4 ms
    priced = with_sync_penalty(cost, 1, penalty.at(1))
    # each interval to a twentieth of the fitted step: 1.61 and 2.52 ms
    assert seconds(priced, 1, 0, 0) == pytest.approx(1.61e-3)
    assert seconds(priced, 1, 4, 1) == pytest.approx(2.52e-3 + 4 * 2e-5 + 1e-4)
    assert with_sync_penalty(cost, 1, None) == cost
    # a pipelined interval at least half the fitted step, a synchronous one at least the pipelined
    assert seconds(with_sync_penalty(cost, 1, (0.5e-3, 0.4e-3)), 1, 0, 0) == pytest.approx(0.7e-3)
    assert seconds(with_sync_penalty(cost, 1, (0.5e-3, 0.4e-3)), 1, 4, 1) == pytest.approx(0.7e-3 + 4 * 2e-5 + 1e-4)
    assert lowest_paying_rate(16, 1, cost) < 0.25 < lowest_paying_rate(16, 1, priced) < 0.6
    assert tokens_that_pay([0.25, 0.8], [16, 16], 2, with_sync_penalty(cost, 2, (1.9e-3, 1.6e-3)))[0] == 0


def test_a_look_pays_for_the_step_that_waited_for_it():
    """A request is looked at from its last token: the step before the look waits for it, unless it checked
    proposals (it waits anyway) or ended a multi-step run. The asks made after plain single steps bear the price of
    such a wait (the synchronous interval less the pipelined one), shared among a step's asks: where most asks
    follow plain steps (free text whose proposals rarely pay), fewer rates pay for a look."""
    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4, "goodput_budget": True})
    speculator = Speculator(config, 1000, _Sevens())
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=1000), 1000)
    for _ in range(100):  # each look after a plain single step: the step before it waited for the look
        request.spec_token_ids = []
        speculator.propose([request], 1)
        assert request.spec_token_ids  # asked (no fit yet: the method's starting rate clears the unfitted bar)
    waited = speculator.look_wait_share
    assert waited > 0.99
    for _ in range(20):  # each look after a check: its step waited for its tokens anyway
        speculator.propose([request], 1)
    assert speculator.look_wait_share < 0.5 * waited
    after_check = speculator.look_wait_share
    request.spec_token_ids = []
    speculator.propose([request], 1, num_steps=8)  # the look after a run: its steps ran ahead
    assert speculator.look_wait_share < after_check
    other = Request("s", [1, 2, 4], SamplingParams(max_tokens=1000), 1000)
    for _ in range(100):  # two requests looked at after one plain step share its wait
        request.spec_token_ids = other.spec_token_ids = []
        speculator.propose([request, other], 2)
    assert speculator.look_wait_share == pytest.approx(0.5, abs=0.01)

    cost = (1.3e-3, 1e-4, 2e-5, 1e-4)
    priced = with_sync_penalty(cost, 1, (2.5e-3, 1.6e-3))
    wait = priced[3] - cost[3]
    assert wait == pytest.approx(2.52e-3 - 1.61e-3)
    bars = []
    for share in (0.0, 0.5, 1.0):
        speculator.look_wait_share, speculator._bar_key = share, None
        bars.append(speculator._prices(1, priced, wait)[0])
    ask = speculator.ask_seconds / speculator.found_share
    assert bars[0] == lowest_paying_rate(config.max_proposal_tokens, 1, priced, ask) < bars[1] < bars[2] <= 1.0
    assert bars[2] == lowest_paying_rate(config.max_proposal_tokens, 1, priced, ask + wait / speculator.found_share)


class _Sevens:
    """A proposer whose every proposal is the token 7, as long as asked."""

    name = "sevens"

    def propose(self, requests, max_tokens):
        return [[7] * n for n in max_tokens]

    def on_finish(self, request, cache):
        pass


def test_probes_are_scored_against_the_next_draw_and_never_checked():
    """Requests whose rate is below what a check needs propose one token every PROBE_EVERY steps, all of them on
    the same steps whatever their lengths, in the quiet steps between the steps that look at them (which run ahead of
    the host); the token is not checked (the step holds no proposal) but compared with the token the request draws in
    its place, which counts as a check's outcome. A request whose rate passes the bar ends the quiet steps and
    proposes to be checked; where no check can pay, no probe."""
    from torch_shift.engine.spec_decode import PROBE_EVERY, RELOOK_PROBES

    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4, "goodput_budget": True})
    speculator = Speculator(config, 1000, _Sevens())
    speculator.clock = lambda: 0.0  # asks cost nothing: a stall in one (2.4 ms) lifted the bar above probed's rate
    dear_check = (1.5e-3, 0.0, 2e-5, 3e-4)  # a check pays from a rate of about 0.2 on
    speculator.step_cost.at = lambda num_requests: dear_check
    for i in range(50):  # the method's rate: mostly rejections
        speculator.acceptance.observe(f"earlier{i}", 4, 0, greedy=False)
    params = SamplingParams(max_tokens=200)
    probed = Request("probed", list(range(1, 6)), params, 200)
    other = Request("other", list(range(1, 12)), params, 200)  # another length, probed on the same steps
    requests = [probed, other]

    def quiet_step(drawn=7):  # a step that ran ahead: a token each (`drawn` for probed), then the speculator
        probed.all_token_ids.append(drawn)
        other.all_token_ids.append(3)
        speculator.skip_step(requests)

    for request in requests:
        request.all_token_ids.append(1)
    speculator.propose(requests, 2)  # the first step is no probe's: both go quiet past their next probes
    assert not speculator._shadows and not probed.spec_token_ids
    assert speculator.quiet_steps >= (RELOOK_PROBES - 1) * PROBE_EVERY
    while speculator._steps % PROBE_EVERY:
        quiet_step(drawn=1)
    assert speculator._shadows == {"probed": (7, False, probed.num_tokens), "other": (7, False, other.num_tokens)}
    assert probed.spec_token_ids == [] and other.spec_token_ids == []
    quiet_step()  # probed drew the probe's token, other did not
    assert speculator.acceptance.per_request["probed"] == [1, 1]
    assert speculator.acceptance.per_request["other"] == [0, 1]
    assert speculator._shadows == {}
    for _ in range(RELOOK_PROBES * PROBE_EVERY):  # more hits: probed's rate passes the bar, and the quiet steps end
        if not speculator.quiet_steps:
            break
        quiet_step()
    assert speculator.quiet_steps == 0 and speculator.acceptance.rate("probed", False) >= speculator._last_bar
    quiet_step()
    speculator.propose(requests, 2)
    assert len(probed.spec_token_ids) >= 2 and set(probed.spec_token_ids) == {7}  # checked: as many as pay
    assert other.spec_token_ids == []
    speculator.step_cost.at = lambda num_requests: (1e-3, 1e-4, 1.0, 0.0)  # no check can pay: no probe either
    fresh = Request("fresh", list(range(1, 4)), params, 100)
    speculator._steps = 2 * PROBE_EVERY - 1  # the next call is a probe's step
    speculator.propose([fresh], 2)
    assert fresh.spec_token_ids == [] and "fresh" not in speculator._shadows


def test_proposals_fit_beside_the_plain_decodes_in_a_step_of_the_cpp_decoder():
    """Where a step's plain decodes run on the C++ decoder (64 tokens), its proposals are cut to the room beside
    them, the least likely tokens first, exploring checks too: a step past it runs the model's forward, about 3x as
    long. A batch that fills the decoder proposes nothing and its steps are quiet; a batch already past it is not
    bounded."""
    from torch_shift.engine.spec_decode import within_room

    assert within_room([4, 4, 2], [0.9, 0.5, 0.99], 6) == [4, 0, 2]  # 0.5^j are the least likely tokens
    assert within_room([3, 1], [1.0, 1.0], 4) == [3, 1] and within_room([5], [0.8], 0) == [0]
    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4, "goodput_budget": True})
    params = SamplingParams(max_tokens=200)
    for num_running, room in ((6, 2), (8, 0), (9, None)):
        speculator = Speculator(config, 1000, _Sevens(), max_step_tokens=8)
        speculator.step_cost.at = lambda num_requests: (1e-3, 1e-5, 1e-6, 1e-6)  # every check pays
        requests = [Request(f"r{i}", list(range(1, 6)), params, 200) for i in range(num_running)]
        for request in requests:
            speculator.acceptance.observe(request.request_id, 10, 10 - (request.request_id == "r1"), greedy=False)
        speculator.propose(requests, num_running)
        proposed = sum(len(r.spec_token_ids) for r in requests)
        if room is None:
            assert proposed == 4 * num_running
        else:
            # each asked for no more than the room, the rest cut
            assert proposed == room and speculator.num_cut_tokens == num_running * min(4, room) - room
            assert not requests[1].spec_token_ids or room == 0  # its rate is the lowest
            assert (speculator.quiet_steps > 0) == (room == 0)
    # an exploring check (a batch size without checks to price one) is cut to the room too
    speculator = Speculator(config, 1000, _Sevens(), max_step_tokens=8)
    speculator.step_cost.at = lambda num_requests: (1e-3, 1e-5, 1.0, 1.0)  # no check pays
    speculator.step_cost.lacks_checks = lambda num_requests: True
    requests = [Request(f"r{i}", list(range(1, 6)), params, 200) for i in range(7)]
    for request in requests:
        speculator.acceptance.observe(request.request_id, 10, 9, greedy=True)
    speculator._steps = 100
    speculator.propose(requests, 7)
    assert sorted(len(r.spec_token_ids) for r in requests) == [0] * 6 + [1]


def test_a_request_below_the_bar_is_not_looked_at_until_its_next_probe():
    """Between the steps that look at it a request whose rate is below the bar costs no pricing and no rate lookup:
    the steps in between only count its tokens and make its probes (on free text the speculator's calls were 6% of a
    batch-1 step). It is looked at again after RELOOK_PROBES probes."""
    from torch_shift.engine.spec_decode import PROBE_EVERY, RELOOK_PROBES

    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4, "goodput_budget": True})
    speculator = Speculator(config, 1000, _Sevens())
    speculator.clock = lambda: 0.0  # asks cost nothing: a slow one stretched the probes' interval
    speculator.step_cost.at = lambda num_requests: (1.5e-3, 0.0, 2e-5, 3e-4)
    for i in range(50):
        speculator.acceptance.observe(f"earlier{i}", 4, 0, greedy=False)
    looked_at = []
    rate = speculator.acceptance.rate
    speculator.acceptance.rate = lambda request_id, greedy: looked_at.append(request_id) or rate(request_id, greedy)
    request = Request("free", list(range(1, PROBE_EVERY + 2)), SamplingParams(max_tokens=1000), 1000)
    probes = []
    for _ in range(2 * RELOOK_PROBES * PROBE_EVERY):  # a look at every step (as where other requests check)
        speculator.propose([request], 1)
        assert request.spec_token_ids == []
        probes.append("free" in speculator._shadows)
        speculator._shadows.clear()
        request.all_token_ids.append(1)
    # where it goes quiet, then once after each RELOOK_PROBES probes; a probe on each probe's step
    assert looked_at == ["free"] * 3
    assert probes.count(True) == 2 * RELOOK_PROBES


def test_a_few_slow_first_checks_do_not_turn_speculation_off_for_good():
    """The first checks of a run took five times their later cost (the machine's spells, a first call's warm-up):
    fitted on them, no proposal pays, and without checks no step could correct the price. While the batch size's
    range has too few checks in its window, its likeliest request checks its whole proposal every EXPLORE_EVERY
    steps; once those show checks cheap, every step checks a proposal again."""
    from torch_shift.engine.spec_decode import EXPLORE_EVERY

    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4, "goodput_budget": True})
    speculator = Speculator(config, 100_000, _Sevens())
    request = Request("edit", [1, 2, 3], SamplingParams(max_tokens=50_000), 100_000)

    def cheap(num_proposed, num_checks):  # a check's later cost: 5% of a step, and 2% a token
        return 1e-3 * (1.0 + 0.05 * num_checks + 0.02 * num_proposed)

    for i in range(100 + 28):  # plain steps, then the slow checks: the range's window (128 steps) is full
        slow = i >= 100
        speculator.step_cost.observe(1, 4 * slow, slow, cheap(4 * slow, slow) * (5 if slow else 1))
        if slow:
            speculator.acceptance.observe("edit", 4, 4, greedy=False)
    assert lowest_paying_rate(4, 1, speculator.step_cost.at(1)) > speculator.acceptance.rate("edit", greedy=False)

    checked = []
    for _ in range(600):
        speculator.propose([request], 1)
        proposed = tuple(request.spec_token_ids)
        entries = [[ScheduledRequest(request, 1 + len(proposed), request.num_tokens - 1, True, False, ([0],),
                                     proposed)]]
        drawn = [7] * (len(proposed) + 1)  # every proposed token accepted
        speculator.observe(entries, {"edit": drawn}, cheap(len(proposed), int(bool(proposed))))
        request.all_token_ids += drawn
        checked.append(bool(proposed))
    assert not any(checked[:100])  # while the slow checks are in the window
    assert 100 < checked.index(True) <= 128 + EXPLORE_EVERY  # once nearly all have left it
    assert speculator.step_cost.at(1)[3] < 2e-4
    assert all(checked[-100:])


class _SevensBesideADraft(_Sevens):
    """_Sevens with a draft model's price: the rate its checks keep its tokens at, and its seconds per request."""

    def __init__(self, rate: float | None, ask_seconds: float, draft_sleep: float = 0.0):
        self.rate, self.draft_ask_seconds, self.draft_sleep = rate, ask_seconds, draft_sleep
        self.draft_model_pays = True
        self.last_draft_seconds = 0.0
        self.pays_when_asked: list[bool] = []

    def draft_rate(self):
        return self.rate

    def propose(self, requests, max_tokens):
        self.pays_when_asked.append(self.draft_model_pays)
        start = time.perf_counter()
        time.sleep(self.draft_sleep)  # the draft model's forwards
        self.last_draft_seconds = time.perf_counter() - start
        return super().propose(requests, max_tokens)


def test_the_budget_prices_a_draft_model_beside_suffix_decoding_apart():
    """A request whose own rate is high (its suffix drafts are kept) is still asked, but the draft model beside them
    only where its k tokens at its own rate gain more than its forwards' time would have made: a weak draft (p = 0.2)
    whose forwards take a quarter of a step does not pay, a good one (p = 0.9) does, as does a draft with too few
    checks to say, or any draft without the goodput budget."""
    cost = (4e-3, 0.0, 2e-5, 1e-4)  # a batch-1 step of 4 ms, a check's token nearly free

    def pays(rate, ask_seconds, budget=True):
        config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4,
                                              "goodput_budget": budget})
        proposer = _SevensBesideADraft(rate, ask_seconds)
        speculator = Speculator(config, 1000, proposer)
        speculator.step_cost.at = lambda num_requests: cost
        for _ in range(20):
            speculator.acceptance.observe("r", 4, 4, greedy=True)
        request = Request("r", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0), 100)
        speculator.propose([request], 1)
        assert request.spec_token_ids  # the request itself is asked either way
        assert proposer.step_seconds == (4e-3 if budget else 0.0)
        return proposer.pays_when_asked == [True]

    goodput = 1 / 4e-3
    assert best_net(0.2, 4, cost, goodput) < 1e-3 * goodput < best_net(0.9, 4, cost, goodput)
    assert not pays(0.2, 1e-3)
    assert pays(0.9, 1e-3)
    assert pays(0.2, 1e-5)  # forwards this cheap pay even for a weak draft's quarter token
    assert pays(None, 1e-3)
    assert pays(0.2, 1e-3, budget=False)
    # the draft model's time is not the price of asking a request (its suffix draft): that is the rest of the call
    from torch_shift.engine.spec_decode import ASK_AVERAGING

    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4, "goodput_budget": True})
    speculator = Speculator(config, 1000, _SevensBesideADraft(0.9, 1e-3, draft_sleep=0.02))
    speculator.propose([Request("r", [1, 2, 3], SamplingParams(max_tokens=100), 100)], 1)
    assert speculator.ask_seconds < ASK_AVERAGING * 5e-3  # without the draft's 20 ms: 5% of them at least
    # a request's ask is priced at the longest proposal, a suffix draft's, not at the draft model's k
    config = SpeculativeConfig.from_user({"method": "draft_model", "model": "d", "num_speculative_tokens": 4,
                                          "enable_suffix_decoding": True})
    speculator = Speculator(config, 1000, _SevensBesideADraft(0.9, 1e-3))
    speculator.ask_seconds = 3e-3
    at_k, longest = (lowest_paying_rate(n, 1, cost, 3e-3) for n in (4, config.max_proposal_tokens))
    assert config.max_proposal_tokens == 12 and longest < at_k < 1.0
    assert speculator._prices(1, cost)[0] == longest


def test_acceptance_rates_start_from_the_methods_and_follow_each_request():
    rates = AcceptanceRates()
    for i in range(50):
        rates.observe(f"free{i % 5}", 4, 0, greedy=False)
    rates.observe("repeats", 4, 4, greedy=False)
    rates.observe("repeats", 4, 4, greedy=False)
    assert rates.rate("new", greedy=False) < 0.2  # the method's recent rate: mostly rejections
    assert rates.rate("repeats", greedy=False) > 0.6 > rates.rate("free0", greedy=False)
    rates.forget("repeats")
    assert rates.rate("repeats", greedy=False) == rates.rate("new", greedy=False)


def test_greedy_and_sampled_requests_start_from_priors_of_their_own():
    """Repetitive greedy work (every proposal accepted), then sampled free text: a new sampled request starts from
    the sampled requests' rate, not the greedy ones'; each kind's checks move only its own prior."""
    rates = AcceptanceRates()
    for i in range(40):
        rates.observe(f"agent{i % 4}", 8, 8, greedy=True)
    assert rates.rate("chat", greedy=True) > 0.9
    assert rates.rate("chat", greedy=False) == pytest.approx(0.5)  # nothing known of sampled requests yet
    for i in range(20):
        rates.observe(f"chat{i % 4}", 4, 0, greedy=False)
    assert rates.rate("chat", greedy=False) < 0.2 and rates.rate("agent", greedy=True) > 0.9


def test_the_budget_cuts_what_does_not_pay_and_outputs_stay_the_same(llama):
    """A step cost where a checked token costs far more than the tokens it may save (as with a small model at a
    large batch on a CPU): no request is asked for a proposal; one where it costs nothing: every proposal is
    checked whole. The outputs are the same either way."""
    _, model_dir = llama
    prompts = repetitive_prompts(8, seed=5)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reference = LLM(str(model_dir), compile=False).generate(prompts, params, use_tqdm=False)
    checked = {}
    for name, b in (("dear", 1.0), ("free", 0.0)):
        llm = LLM(str(model_dir), compile=False, speculative_config={**SPECS["ngram"], "goodput_budget": True})
        speculator = llm.engine.core.speculator
        speculator.step_cost.at = lambda num_requests, b=b: (1e-3, 1e-4, b, 0.0)  # the test's, not the machine's
        # nor the machine's waits: a busy machine's (a test beside other work) priced the free checks out
        speculator.sync_penalty.at = lambda num_requests: None
        assert _outputs(llm.generate(prompts, params, use_tqdm=False)) == _outputs(reference)
        checked[name] = llm.stats()["spec_decode"]
        assert not llm.engine.block_manager.req_blocks
    assert checked["dear"]["num_draft_tokens"] == 0  # not even a probe: no token can pay
    assert checked["free"]["num_draft_tokens"] > 0 and checked["free"]["num_cut_tokens"] == 0
