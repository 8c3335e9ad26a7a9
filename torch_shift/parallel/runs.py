"""A multi-step run on a rank (GroupStep.num_steps, ModelRunner._run_steps): its steps, how its rows draw their
tokens, and what ends it early: a stop token drawn, which every rank of the run's layout draws alike, or rank 0's
interrupt (a request arrived or was aborted while the run computes: torch_shift.serve.async_engine), which they must
all see at the same step. A batch-1 check whose later stages the C++ decoder drafts (GroupStep.redraft) is a run
too, its stages its steps: a request that arrives while it computes waits for one stage, not for the check.

The interrupt lives in int64 words every rank of the deployment shares (`words`: the control channel's,
ShmCommunicator.words, or a process's own with one rank). Word 0 is the interrupt: rank 0's front end sets it from
any thread, its engine loop clears it before it takes new requests. Word 1 + i is the limit of the runs of the
deployment's i-th layout, (run << 16) | steps. The run's leader (its layout's first rank, which computes every step)
writes it at the start of each step: the run's steps at the first, the step's number + 1 where the interrupt is set.
Every rank reads it after the step, whose collectives the leader joined after its write (x86-64's stores stay in
order, as the collectives' own protocol relies on). A rank that finds a later run's number there stops too: the
leader went on to its next run while this rank had yet to read, so it left the run at this step. Written by one
rank, read after a step by the others, the word needs no agreement of its own; the C++ decoder's runs read and write
it as this class does (kernels/cpu_decoder.cpp, ts_decoder_steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RUN_WORDS = 512  # shared words the runs use: the interrupt, then one per layout
MAX_RUN_STEPS = (1 << 16) - 1
_INTERRUPT = 0


def limit_word(layout_index: int) -> int:
    """The word of the runs of the deployment's `layout_index`-th layout."""
    assert 1 + layout_index < RUN_WORDS, layout_index
    return 1 + layout_index


@dataclass
class Run:
    """One rank's part in one multi-step run: its steps; how its rows draw their tokens (`draws`: float32
    [num_steps, 5, rows] of models.fused.sample_rows, or None: each row's argmax); what ends it early: the group's
    stop tokens and, where the ranks share `words` (None: they do not, and nothing interrupts the run), the run's
    limit word, its number (each rank counts every plan's runs, so the same on every rank) and whether this rank
    leads it."""

    num_steps: int
    stop_token_ids: np.ndarray  # int64
    draws: np.ndarray | None = None
    words: np.ndarray | None = None
    word: int = 0
    number: int = 0
    leader: bool = False

    def __post_init__(self):
        assert 1 <= self.num_steps <= MAX_RUN_STEPS, self.num_steps
        assert self.stop_token_ids.dtype == np.int64 and self.stop_token_ids.flags.c_contiguous
        assert (np.diff(self.stop_token_ids) > 0).all(), "the C++ decoder looks stop tokens up in sorted order"
        assert self.draws is None or (self.draws.dtype == np.float32 and self.draws.flags.c_contiguous
                                      and self.draws.shape[:2] == (self.num_steps, 5))

    def native_args(self, num_rows: int) -> tuple[int, int, int, int, int, int, int]:
        """ts_decoder_steps' arguments after the run's own: the stop tokens (address, count), the limit and interrupt
        words' addresses (0: none), the run's number, whether this rank leads it, and the draws' address (0: none)."""
        stops = self.stop_token_ids
        draws = 0
        if self.draws is not None:
            assert self.draws.shape[2] == num_rows, (self.draws.shape, num_rows)
            draws = self.draws.ctypes.data
        return (stops.ctypes.data, len(stops), *self.native_words(), draws)

    def native_words(self) -> tuple[int, int, int, int]:
        """The C++ decoder's view of what ends the run on rank 0's interrupt: the limit word's address, the interrupt's
        (0, 0 where the ranks share no words), the run's number and whether this rank leads it."""
        if self.words is None:
            return 0, 0, self.number, 0
        base = self.words.ctypes.data
        return base + 8 * self.word, base + 8 * _INTERRUPT, self.number, int(self.leader)

    def begin_step(self, step: int) -> None:
        """Before step `step` (from 0) of a run whose steps run in Python: the leader's writes."""
        words = self.words
        if words is None or not self.leader:
            return
        if step == 0:
            words[self.word] = self.number << 16 | self.num_steps
        if words[_INTERRUPT] and int(words[self.word]) & MAX_RUN_STEPS > step + 1:
            words[self.word] = self.number << 16 | (step + 1)

    def ends_after(self, step: int, drawn: np.ndarray) -> bool:
        """After step `step`, which drew `drawn`: whether the run ends with it."""
        if step + 1 >= self.num_steps or np.isin(drawn, self.stop_token_ids).any():
            return True
        if self.words is None:
            return False
        limit = int(self.words[self.word])
        return limit >> 16 != self.number or limit & MAX_RUN_STEPS <= step + 1


def interrupt(words: np.ndarray) -> None:
    """A multi-step run in progress ends after its current step (any thread of rank 0)."""
    words[_INTERRUPT] = 1


def clear_interrupt(words: np.ndarray) -> None:
    words[_INTERRUPT] = 0
