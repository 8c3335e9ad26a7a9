"""One rank's part of every step: apply the plan's deltas to its replica's persistent batch, build
the inputs of the group it belongs to, run the model in that group's layout over the paged KV cache
(viewed at the layout's KV width), and return logits.

Every rank runs this, rank 0 included, on the same plan: there is one path for one rank and many.
Rank 0 returns the logits of every group in plan order; a group without rank 0 sends its logits
from its first rank to rank 0 (the only other traffic outside the layouts' own collectives).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_shift.engine.input_batch import InputBatch, StepInputs
from torch_shift.engine.step_plan import GroupStep, StepPlan
from torch_shift.kv.attention import PagedAttention
from torch_shift.kv.cache import KVCache
from torch_shift.kv.flex_attention import FlexPagedAttention
from torch_shift.parallel.layouts import Deployment


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, deployment: Deployment, rank: int, max_rows: int,
                 max_model_len: int, vocab_size: int, sliding_window: int | None = None,
                 attention_backend: str = "sdpa", compile: bool = False):
        if attention_backend not in ("sdpa", "flex"):
            raise ValueError(f"attention_backend must be 'sdpa' or 'flex', got {attention_backend!r}")
        self.model = model
        self.kv_cache = kv_cache
        self.deployment = deployment
        self.rank = rank
        self.replica = deployment.replica_of(rank)
        self.vocab_size = vocab_size
        self.attention_backend = attention_backend
        self.device = kv_cache.k[0].device
        self.dtype = kv_cache.k[0].dtype
        self.batch = InputBatch(max_rows, max_model_len, kv_cache.block_size, self.device, sliding_window,
                                attention_backend)
        self._kv_views: dict[int, KVCache] = {}
        if compile:
            model.compile_layouts()

    def kv_view(self, width: int) -> KVCache:
        if width not in self._kv_views:
            self._kv_views[width] = self.kv_cache.view(width)
        return self._kv_views[width]

    def prepare(self, plan: StepPlan, group: GroupStep) -> StepInputs:
        """The inputs of `group` on this rank (after the plan's deltas were applied)."""
        layout = self.deployment[group.layout]
        return self.batch.prepare(group, layout.replicas.index(self.replica), layout.kv_width)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[torch.Tensor | None] | None:
        """Rank 0: the logits of every group, in plan order; other ranks: None."""
        delta = plan.deltas.get(self.replica)
        if delta is not None:
            self.batch.apply(delta)
        logits: list[torch.Tensor | None] = [None] * len(plan.groups)
        for i, group in enumerate(plan.groups):
            layout = self.deployment[group.layout]
            if self.rank not in layout.ranks:
                continue
            inputs = self.prepare(plan, group)
            kv = self.kv_view(layout.kv_width)
            if self.attention_backend == "flex":
                attention = FlexPagedAttention(kv, inputs.attention)
            else:
                attention = PagedAttention(kv, inputs.attention)
            out = self.model.forward_step(inputs.input_ids, inputs.positions, attention, inputs.logits_indices,
                                          group.layout)
            if self.rank == 0:
                logits[i] = out
            elif layout.ranks[0] == self.rank and group.num_logits:
                dist.send(out.contiguous(), dst=0, tag=i)
        if self.rank != 0:
            return None
        for i, group in enumerate(plan.groups):
            leader = self.deployment[group.layout].ranks[0]
            if leader != 0 and group.num_logits:
                logits[i] = torch.empty(group.num_logits, self.vocab_size, dtype=self.dtype, device=self.device)
                dist.recv(logits[i], src=leader, tag=i)
        return logits
