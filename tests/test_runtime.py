"""The life of a parallel engine's local ranks inside the user's process: start, heartbeat, shutdown.

These tests start `LLM(..., sp/tp=2)` in the test process itself (launch path (b)), as a user does.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from torch_shift import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)
PROMPTS = ["the quick brown fox", "x"]


def _continue_and_shutdown(llm: LLM, pids: list[int]) -> None:
    for pid in pids:  # a test that failed half-way must not leave a stopped process behind
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    llm.shutdown(timeout_s=5)


@pytest.mark.timeout(120)
def test_a_stopped_rank_is_reported_and_a_shutdown_from_another_thread_ends_it(llama):
    """The server's watchdog: the heartbeat shows a SIGSTOPped rank within a fraction of a second, and
    `shutdown` from another thread, while the engine thread is blocked in the step's collectives, kills
    the rank and returns within its bound; the blocked step ends with an error."""
    _, model_dir = llama
    llm = LLM(str(model_dir), sp=2, tp=1, shift_threshold=4)
    worker = llm.engine.parallel.launched.procs[1]
    try:
        assert llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert llm.engine.unresponsive_ranks(max_silence_s=1.0) == []
        os.kill(worker.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while llm.engine.unresponsive_ranks(max_silence_s=0.5) != [1]:
            assert time.monotonic() < deadline, "the stopped rank was not reported"
            time.sleep(0.05)

        errors: list[BaseException] = []

        def generate() -> None:
            try:
                llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            except BaseException as e:  # noqa: BLE001 - the result of this test
                errors.append(e)

        engine_thread = threading.Thread(target=generate)
        engine_thread.start()
        time.sleep(1.0)
        assert engine_thread.is_alive()  # blocked: its peer is stopped
        start = time.monotonic()
        llm.engine.shutdown(timeout_s=5.0)
        assert time.monotonic() - start < 5.0 + 3.0  # the bound, with room for a loaded machine
        engine_thread.join(timeout=10)
        assert not engine_thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
        assert "shut down" in str(errors[0])
        assert not worker.is_alive() and worker.exitcode == -signal.SIGKILL
        assert llm.engine.unresponsive_ranks(max_silence_s=0.5) == []
    finally:
        _continue_and_shutdown(llm, [worker.pid])
