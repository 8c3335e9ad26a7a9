"""What a rank's model is to the model runner, whatever layouts it runs: the `LayoutModel` protocol.

Three classes implement it: `ShiftModule` (an SP x TP replica: base and shift layouts, paper 000),
`ReplicaModel` (a replica of full weights: one rank, static DP, Flying's TP groups as views, paper 004)
and `PipelineModel` (a pipeline stage, and Seesaw's TP shards beside it, paper 003). The runner hands
each step's group to `forward_step` with its `Layout` (data: its kind, widths, ranks) and the group's
micro-batches: one, except for a pipeline layout, whose batch the plan cuts into several.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

from torch_shift.kv.host_tier import KVRegion
from torch_shift.models.decoder import AttentionFn
from torch_shift.parallel import comm
from torch_shift.parallel.comm import CommLedger
from torch_shift.parallel.layouts import Layout
from torch_shift.parallel.runs import Run

if TYPE_CHECKING:
    from torch_shift.models.native_decoder import Redraft


@dataclass
class MicroBatch:
    """A forward's inputs on this rank: the tokens of the batch (or of one micro-batch of it)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionFn  # the step's attention over this rank's KV pool (torch_shift.attention)
    logits_indices: torch.Tensor  # rows of the hidden states that go through the LM head
    first_stage: int = 0  # a batch-1 check in two stages where the C++ decoder runs it (GroupStep.first_stage)
    redraft: Redraft | None = None  # and its stages after the first drafted there (GroupStep.redraft)


class LayoutCounters:
    """What a layout model counts (a mixin of the three): forwards per layout, the bytes its collectives sent,
    and the switches of the device's weights between layouts and their time."""

    def reset_counters(self) -> None:
        self.layout_counts: Counter[str] = Counter()
        self.ledger = CommLedger()  # bytes each collective sent from this rank, by layout (eager steps)
        self.num_reshards = 0
        self.reshard_seconds = 0.0

    def run_steps_in_one_call(self, decoder, layout: Layout, batch: MicroBatch, run: Run,
                              attention: AttentionFn | None = None) -> np.ndarray | None:
        """`forward_steps` through `decoder`'s `steps` (a C++ decoder, or a shard's), attending through `attention`
        (default the batch's): counted as forwards of `layout`, one per step run, their collectives in the ledger;
        None where the decoder declines them."""
        with comm.recording(self.ledger), comm.layout_scope(layout.name):
            drawn = decoder.steps(batch.input_ids, batch.positions, batch.logits_indices,
                                  batch.attention if attention is None else attention, run)
        if drawn is not None:
            self.layout_counts[layout.name] += len(drawn)
        return drawn


@runtime_checkable
class LayoutModel(Protocol):
    num_kv_layers: int  # layers of this rank's KV pool, in the geometry it is allocated in
    num_local_kv_heads: int  # KV heads of this rank's pool in that geometry
    layout_counts: Counter[str]  # forwards run per layout name
    ledger: CommLedger  # bytes the layouts' collectives sent from this rank (eager steps)
    reshard_seconds: float  # time spent switching the device's weights between layouts, in all

    def kv_region(self, layout: Layout) -> KVRegion:
        """What this rank's pool holds of the whole KV cache under `layout` (a layout of KV width 1)."""
        ...

    def forward_step(self, layout: Layout, micro_batches: list[MicroBatch]) -> torch.Tensor | None:
        """Run one step of `layout` over its micro-batches in order; returns the logits of all of them on the
        rank that returns the layout's logits (`Layout.logits_rank`), None on the others."""
        ...

    def forward_steps(self, layout: Layout, batch: MicroBatch, run: Run) -> np.ndarray | None:
        """A multi-step run's decode steps of `batch` (decodes only, a logits row each) in one call, where this rank's
        decoder runs them all (the C++ decoder, which draws the tokens: NativeDecoder.steps): each row's token in each
        step (its argmax, or drawn with the run's draws), int64 [steps run, rows], fed to the next step as its input
        id; `run.num_steps` steps, or fewer where the run ends early (a stop token drawn, rank 0's interrupt); else
        None, nothing run (the runner then runs them one by one through `forward_step`). Every rank of the layout
        decides alike."""
        ...

    def idle_in(self, layout: Layout, num_tokens: int) -> bool:
        """Whether this rank of `layout` computes nothing in its steps of `num_tokens` tokens (the runner then
        prepares no inputs for it, and the rank naps while it waits for the next plan: Worker.follow)."""
        ...

    def prepare_weights(self, drop_dense: bool = True) -> int:
        """Prepare the weights for the machine's matmul (torch_shift.models.linear); returns bytes packed."""
        ...

    def compile_layouts(self) -> None:
        """torch.compile every layout's forward (attention as an opaque op, dynamic token count)."""
        ...

    def native_decode(self) -> bool:
        """Run steps of at most MAX_TOKENS tokens of the layouts that allow it through one C++ call
        (torch_shift.models.native_decoder: a replica's own layout on the CPU); whether any layout does."""
        ...

    def seal_compiled(self) -> None:
        """Once every compiled forward ran (the runner's warm-up): skip dynamo's full guard check from then on."""
        ...

    def staged_check_tokens(self) -> int:
        """The most tokens of a batch-1 check that the C++ decoder of the layout such a small step runs in (after
        `native_decode`) takes in two stages (`MicroBatch.first_stage`); 0 where none does."""
        ...

    def reset_counters(self) -> None:
        """Zero the counters above (after the runner's warm-up steps)."""
        ...
