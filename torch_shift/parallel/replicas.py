"""Each rank's model under every layout it takes part in, behind one call:
`forward_step(input_ids, positions, attention, logits_indices, layout) -> logits | None`.

- a replica of full weights (one rank, static DP, Flying Serving's DP replicas): `ReplicaModel`,
  whose TP layouts over several replicas (paper 004) are views of the full weights, part by part
  for the fused q/k/v and gate/up, the LM head's rows by vocabulary (`derive_tp`);
- an (SP, TP) replica: `ShiftModule` (base and shift layouts, paper 000);
- a pipeline replica: `PipelineModel` (a stage of layers, and Seesaw's TP shards, paper 003).

A layout that binds several replicas returns logits on its first rank only (the one rank 0 reads
them from); the others return None.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from torch_shift.compilation import CompiledForward, seal
from torch_shift.config import ModelConfig
from torch_shift.kv.host_tier import KVRegion
from torch_shift.models.decoder import DecoderLM
from torch_shift.models.linear import prepare_linears
from torch_shift.models.loader import build_model
from torch_shift.models.native_decoder import LaunchedStep, NativeDecoder
from torch_shift.parallel import comm
from torch_shift.parallel.groups import DeploymentGroups
from torch_shift.parallel.layers import ShardDecoder, shard_group, warn_where_decoders_differ
from torch_shift.parallel.layout_model import LayoutCounters, MicroBatch
from torch_shift.parallel.layouts import Deployment, Layout
from torch_shift.parallel.plan import tp_plan
from torch_shift.parallel.runs import Run
from torch_shift.parallel.shift import TensorReader, build_shift_module, derive_tp


class ReplicaModel(LayoutCounters, nn.Module):
    def __init__(self, model: DecoderLM, views: dict[str, DecoderLM] | None = None, view_weights: str = "view"):
        super().__init__()
        self.model = model
        self.view_weights = view_weights  # Flying's TP weights: zero-copy "view"s or "copy"
        self.views = nn.ModuleDict(views or {})
        self.num_local_kv_heads = model.config.num_key_value_heads
        self.num_kv_layers = model.config.num_hidden_layers
        self.reset_counters()  # every layout's weights are resident: no reshard ever
        self.forwards = {}  # layout name (None: the replica's own) -> compiled forward (compile_layouts)
        self.native_decoder: NativeDecoder | None = None  # the replica's own small steps (native_decode)
        self.view_decoders: dict[str, ShardDecoder] = {}  # and Flying's TP layouts' on each rank of their groups

    def prepare_weights(self, drop_dense: bool = True) -> int:
        """Pack the weights for the machine's matmul (torch_shift.models.linear), unless Flying's TP layouts
        are views of them (`flying_weights="view"`: zero-copy but for the padding of a vocabulary that does not
        divide over a group), which packing would turn into copies."""
        if self.views and self.view_weights == "view":
            return 0
        return prepare_linears(self, drop_dense)

    def compile_layouts(self) -> None:
        self.forwards = {name: CompiledForward(view) for name, view in self.views.items()}
        self.forwards[None] = CompiledForward(self.model)

    def native_decode(self) -> bool:
        """Run the replica's own steps of at most MAX_TOKENS tokens through one C++ call where its model allows
        (torch_shift.models.native_decoder), and on each rank of a TP layout over several replicas (Flying's) that
        layout's, where its weights are packed copies (`flying_weights="copy"`); whether any does. After
        `prepare_weights`: it reads the packed weights."""
        self.native_decoder = NativeDecoder.build(self.model)
        self.view_decoders = {}
        for name, view in self.views.items():  # in the deployment's order of layouts on every rank
            decoder = ShardDecoder.build(view)
            if decoder is not None:
                self.view_decoders[name] = decoder
            warn_where_decoders_differ({name: decoder is not None}, shard_group(view))
        return self.native_decoder is not None or bool(self.view_decoders)

    def staged_check_tokens(self) -> int:
        """The replica's own decoder's; none where Flying may merge replicas into a TP layout for small steps."""
        return self.native_decoder.max_tokens if self.native_decoder is not None and not self.views else 0

    def launch_step(self, layout: Layout, batch: MicroBatch, placeholders: tuple | None = None,
                    draws: np.ndarray | None = None) -> tuple[torch.Tensor, LaunchedStep]:
        """The replica's own step of at most MAX_TOKENS tokens launched on the C++ decoder's thread (asynchronous
        scheduling; `NativeDecoder.launch`, the batch's `first_stage` and `redraft` a check's in stages): its logits,
        written once the returned step ran."""
        assert layout.kv_width == 1 and self.native_decoder is not None
        self.layout_counts[layout.name] += 1
        return self.native_decoder.launch(batch.input_ids, batch.positions, batch.logits_indices, batch.attention,
                                          placeholders, draws, batch.first_stage, batch.redraft)

    def wait_launched(self) -> None:
        """Wait for the steps `launch_step` launched."""
        if self.native_decoder is not None and self.native_decoder.launched:
            self.native_decoder.wait()

    def seal_compiled(self) -> None:
        """After the start-up warm-up: the compiled forwards stop checking every guard (compilation.CompiledForward)."""
        seal(self.forwards.values())

    def idle_in(self, layout: Layout, num_tokens: int) -> bool:
        return False

    def forward_steps(self, layout: Layout, batch: MicroBatch, run: Run) -> np.ndarray | None:
        """A multi-step run in one call of the replica's own C++ decoder, or of its view's in Flying's TP group."""
        key = layout.name if layout.kv_width > 1 else None
        native = self.native_decoder if key is None else self.view_decoders.get(key)
        return None if native is None else self.run_steps_in_one_call(native, layout, batch, run)

    def kv_region(self, layout: Layout) -> KVRegion:
        """What this rank's pool holds of the whole KV cache under a layout of width 1: all of it."""
        assert layout.kv_width == 1, f"{layout.name}: a layout over several replicas views its pools by width"
        config = self.model.config
        return KVRegion(0, config.num_hidden_layers, 0, config.num_key_value_heads)

    def forward_step(self, layout: Layout, micro_batches: list[MicroBatch]) -> torch.Tensor | None:
        """The replica's own layout runs its full weights; a layout over several replicas (Flying's TP
        group) the views of them derived for it, whose logits every rank of the group holds whole (gathered; the
        runner takes the first rank's, and each rank draws from its own in a multi-step run)."""
        (batch,) = micro_batches
        self.layout_counts[layout.name] += 1
        key = layout.name if layout.kv_width > 1 else None
        if key is None and self.native_decoder is not None and self.native_decoder.runs(len(batch.input_ids),
                                                                                            batch.attention):
            logits = self.native_decoder(batch.input_ids, batch.positions, batch.logits_indices, batch.attention,
                                         batch.first_stage, batch.redraft)
            if logits is not None:
                return logits
        model = self.views[key] if key is not None else self.model
        forward = self.forwards.get(key, model)
        with comm.recording(self.ledger), comm.layout_scope(layout.name):
            native = self.view_decoders.get(key)
            if native is not None:
                logits = native.step(batch.input_ids, batch.positions, batch.logits_indices, batch.attention)
                if logits is not None:
                    return logits
            hidden = forward(batch.input_ids, batch.positions, batch.attention, batch.logits_indices)
            # a view's LM head holds the rank's rows of the vocabulary: every rank of the group computes its share,
            # which the group gathers (the first rank's whole head alone, while the others waited, made a TP-2 batch-1
            # decode step of the 106M model 6-10% longer: docs/performance.md)
            logits = model.compute_logits(hidden)
        return logits


def build_layout_model(deployment: Deployment, groups: DeploymentGroups | None, rank: int, config: ModelConfig,
                       read: TensorReader, dtype: torch.dtype, device: torch.device,
                       shift_threshold: int | None = None, shift_weights: str = "copy",
                       flying_weights: str = "copy", seesaw_weights: str = "resident",
                       expert_parallel: bool = False) -> nn.Module:
    """This rank's model: only its shards read, its layouts derived from them."""
    if deployment.pp > 1:
        from torch_shift.parallel.pipeline import build_pipeline_model

        return build_pipeline_model(deployment, groups, rank, config, read, dtype, device, seesaw_weights)
    if groups is not None and groups.replica is not None:  # (SP, TP) inside a replica
        with_shift = any(layout.kind == "shift" for layout in deployment.layouts)
        return build_shift_module(config, groups.replica, read, dtype, device,
                                  shift_threshold if with_shift else None, shift_weights, expert_parallel)
    full = build_model(config, read, dtype, device)
    views = {}
    for layout in deployment.layouts_of(rank):
        if layout.kv_width > 1:
            group, mesh = groups.pool[layout.ranks]
            views[layout.name] = derive_tp(full, config, None, tp_plan(mesh, layout.name), group, flying_weights)
    return ReplicaModel(full, views, flying_weights)
