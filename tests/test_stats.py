"""EngineStats (torch_shift.engine.stats): what LLM.stats() says a step's time went to."""

from __future__ import annotations

from test_scheduler import make_request
from test_step_plan import CONFIG

from torch_shift.engine.scheduler import ScheduledRequest
from torch_shift.engine.stats import EngineStats
from torch_shift.parallel.layouts import build_deployment


def _entry(request, num_tokens: int, num_computed_tokens: int, spec_token_ids=()) -> ScheduledRequest:
    return ScheduledRequest(request, num_tokens, num_computed_tokens, True, False, ([],),
                            spec_token_ids=tuple(spec_token_ids))


def test_a_step_is_filed_by_what_its_entries_compute():
    """A one-token decode and a check of proposals decode; a prompt chunk prefills, and so does a chunk that
    recomputes a preempted request's outputs past its prompt (its prompt found in the prefix cache); decodes beside
    prompt chunks are a mixed step."""
    stats = EngineStats(build_deployment(CONFIG))
    a, b = make_request("a", 8), make_request("b", 8)
    steps = [([_entry(a, 1, 8)], "decode"),
             ([_entry(a, 1, 9), _entry(b, 5, 8, spec_token_ids=(1, 2, 3, 4))], "decode"),
             ([_entry(b, 6, 10)], "prefill"),
             ([_entry(a, 1, 10), _entry(b, 8, 0)], "mixed")]
    for entries, kind in steps:
        stats.record_step([entries], 1.0, 0.0, 0.0)
    assert dict(stats.time_s) == {"decode": 2.0, "prefill": 1.0, "mixed": 1.0, "swapping": 0.0, "resharding": 0.0}
    assert stats.as_dict()["num_decode_steps"] == 2 and stats.as_dict()["mean_decode_batch"] == 1.5
