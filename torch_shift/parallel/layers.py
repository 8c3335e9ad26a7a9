"""Linear layers over local shards; the only places a layout's collectives happen in the model. Each has a
`packed` slot that torch_shift.models.linear.prepare_linears fills (see there). And `ShardDecoder` and
`UlyssesDecoder`: a shard of such layers run whole by the C++ decoder, its collectives inside the call."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from torch_shift.models.fused import gate_up_silu
from torch_shift.models.linear import PackedWeight, linear
from torch_shift.models.moe import Experts, SparseMoeBlock, adopt_routing
from torch_shift.models.native_decoder import NativeDecoder, Redraft
from torch_shift.parallel import comm
from torch_shift.parallel.agreement import warn_where_ranks_differ
from torch_shift.parallel.runs import Run
from torch_shift.parallel.ulysses import UlyssesAttention


class PartsLinear(nn.Module):
    """A column-parallel fused projection whose parts are separate (possibly strided) tensors, e.g.
    zero-copy views of another layout's shards: one matmul per part, outputs concatenated (one matmul of
    their packed concatenation once prepared)."""

    packed: PackedWeight | None = None

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(w, requires_grad=False) for w in weights)
        self.biases = (nn.ParameterList(nn.Parameter(b, requires_grad=False) for b in biases)
                       if biases is not None else None)
        self.bias = None

    def dense_weight(self) -> torch.Tensor:
        return torch.cat(list(self.weights))

    def drop_dense(self) -> None:
        """Once packed: the parts' views let go of the other layout's storage (the bias is kept whole)."""
        if self.biases is not None:
            self.bias = nn.Parameter(torch.cat(list(self.biases)), requires_grad=False)
        self.weights = nn.ParameterList()
        self.biases = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, self.bias if self.biases is None else torch.cat(list(self.biases)))
        if self.biases is None:
            return torch.cat([linear(x, w) for w in self.weights], dim=-1)
        return torch.cat([linear(x, w, b) for w, b in zip(self.weights, self.biases)], dim=-1)


class RowParallelLinear(nn.Module):
    """Input features sharded; partial outputs summed over `group` (o_proj, down_proj), then the bias (whole on
    every rank) added once."""

    packed: PackedWeight | None = None

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = comm.all_reduce(self.partial(x), self.group)
        return out if self.bias is None else out + self.bias

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output, before the sum over `group` and the bias."""
        return linear(x, self.weight, None, self.packed)


class VocabParallelLMHead(nn.Module):
    """Vocabulary rows sharded over the shift group (padded to a multiple of its size); the
    logits are gathered in shift-rank order, which is vocabulary order, and trimmed."""

    packed: PackedWeight | None = None

    def __init__(self, weight: torch.Tensor, vocab_size: int, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = comm.all_gather(linear(x, self.weight, None, self.packed), self.group, dim=-1)
        return logits[..., : self.vocab_size]


def shard_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group over which `model` is a tensor-parallel rank's shard (its o projection's), or None."""
    return getattr(model.layers[0].attn.o_proj, "group", None)


def warn_where_decoders_differ(built: dict[str, bool], group: dist.ProcessGroup | None) -> None:
    """Every rank of `group` (None: nothing compared) says, once its decoders are built, whether each of its layouts'
    steps runs in the C++ decoder; the group's first rank warns where the ranks differ (a rank without one runs those
    steps in Python, with the same bits, while its peers wait for it: agreement.warn_where_ranks_differ)."""
    if group is not None:
        warn_where_ranks_differ(built, "whether the C++ decoder runs each layout's steps (a rank without it runs them "
                                "in Python, and its peers wait for it)", group)


class ShardDecoder:
    """A tensor-parallel rank's shard of a dense model (RowParallelLinear o and down projections, an LM head whole or
    VocabParallelLMHead) run by the C++ decoder (torch_shift.models.native_decoder): its partial sums added through
    the group's shared-memory all-reduce inside the call, as the forward's are, and its logits gathered over the
    vocabulary where the head is sharded, inside the call too. Every rank of the layout runs the same steps."""

    def __init__(self, decoder: NativeDecoder, group: dist.ProcessGroup, communicator: int):
        self.decoder = decoder
        self.group = group
        self.communicator = communicator  # the id the decoder was built with (comm.native_communicator)

    @classmethod
    def build(cls, model: nn.Module) -> ShardDecoder | None:
        """The decoder of `model`'s shard, or None where it does not run it (native_decoder's checks, a group
        without the shared-memory communicator's C++ collectives)."""
        group = shard_group(model)
        communicator = comm.native_communicator(group) if group is not None else None
        decoder = NativeDecoder.build(model, group, communicator) if communicator is not None else None
        return None if decoder is None else cls(decoder, group, communicator)

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
             attention: object, first_stage: int = 0, redraft: Redraft | None = None) -> torch.Tensor | None:
        """The step's logits (every rank's, of the same `logits_indices` on every rank, whose shards it gathers), or
        None where the decoder does not take it: more tokens than it runs, another attention, an emulated link (whose
        delays only the Python collectives make), or another communicator than the one it was built with.
        `first_stage`, `redraft`: a batch-1 check in stages (NativeDecoder.launch), each rank running the same ones
        (each drafts the same from the same tokens)."""
        if not self._takes(len(input_ids), attention):
            return None
        logits = self.decoder(input_ids, positions, logits_indices, attention, first_stage, redraft)
        if logits is None:
            return None
        self._record(len(input_ids), len(logits_indices))
        return logits

    def steps(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, attention: object,
              run: Run) -> np.ndarray | None:
        """A multi-step run's steps in one call (NativeDecoder.steps), counted in the ledger as `step`'s each; None
        where `step` would decline them."""
        if not self._takes(len(input_ids), attention):
            return None
        drawn = self.decoder.steps(input_ids, positions, logits_indices, attention, run)
        if drawn is None:
            return None
        for _ in range(len(drawn)):
            self._record(len(input_ids), len(logits_indices))
        return drawn

    def _takes(self, num_tokens: int, attention: object) -> bool:
        return (self.decoder.runs(num_tokens, attention)
                and comm.native_communicator(self.group) == self.communicator)

    def _record(self, num_tokens: int, num_logits: int) -> None:
        """Count a call's step in the ledger as the forward's: its all-reduces, and where the head is sharded the
        logits' all-gather, as VocabParallelLMHead's counts it."""
        model, element_size = self.decoder.model, self.decoder.element_size
        record_decoder_all_reduces(model, num_tokens, num_logits, element_size, self.group)
        if self.decoder.gathers_logits:
            comm.record_outside("all_gather", 1, num_logits * model.lm_head.packed.out_features * element_size,
                                self.group)


def record_decoder_all_reduces(model: nn.Module, num_tokens: int, num_logits: int, element_size: int,
                               group: dist.ProcessGroup) -> None:
    """Count a C++ decoder call's all-reduces in the ledger as the forward's: two a layer, [tokens, hidden] each, the
    last layer's of its logits rows alone (DecoderLM.forward's logits_indices)."""
    row_bytes = model.config.hidden_size * element_size
    comm.record_outside("all_reduce", 2 * (len(model.layers) - 1), num_tokens * row_bytes, group)
    comm.record_outside("all_reduce", 2, num_logits * row_bytes, group)


class UlyssesDecoder:
    """A sequence-parallel rank's tokens of a dense model's step (the base layout of static SP or of Shift: every rank
    holds its share of the step's tokens, all of its TP shard's heads) run by the C++ decoder: each layer's attention
    runs Ulysses' two all-to-alls around the paged kernel inside the call (kernels/cpu_ops.cpp's, which
    `UlyssesAttention.install_native` installs for a compiled forward's attention calls too; the same protocol as the
    Python path, so a rank whose step the decoder declines still exchanges with the others), the o and down
    projections' partial sums go through the TP group's all-reduce where TP > 1, and the step's result is the rank's
    logits rows' final hidden states, which the caller gathers over "sp" for the LM head. A rank given no tokens
    (fewer than SP ranks) attends for the others in one call (`attend`). Static SP-2's batch-1 decode ran the
    compiled forward before (docs/performance.md)."""

    def __init__(self, decoder: NativeDecoder, sp_group: dist.ProcessGroup, sp_communicator: int,
                 tp_group: dist.ProcessGroup, tp_communicator: int | None):
        self.decoder = decoder
        self.sp_group, self.sp_communicator = sp_group, sp_communicator
        self.tp_group, self.tp_communicator = tp_group, tp_communicator  # None: TP 1, nothing summed

    @classmethod
    def build(cls, model: nn.Module, sp_group: dist.ProcessGroup) -> UlyssesDecoder | None:
        """The decoder of `model`'s shard (its o and down projections RowParallelLinear over the TP group, of one rank
        or more), or None where it does not run it: native_decoder's checks, or a group without the shared-memory
        communicator's C++ collectives."""
        tp_group = getattr(model.layers[0].attn.o_proj, "group", None)
        sp_communicator = comm.native_communicator(sp_group)
        if tp_group is None or sp_communicator is None:
            return None
        tp_communicator = comm.native_communicator(tp_group) if tp_group.size() > 1 else None
        if tp_group.size() > 1 and tp_communicator is None:
            return None
        decoder = NativeDecoder.build(model, tp_group, tp_communicator, head=False)
        return None if decoder is None else cls(decoder, sp_group, sp_communicator, tp_group, tp_communicator)

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_rows: torch.Tensor,
             ulysses: UlyssesAttention) -> torch.Tensor | None:
        """The hidden states [len(logits_rows), hidden] of this rank's `logits_rows` (indices into its tokens), or
        None where the decoder does not take the step: more tokens than it runs, another attention inside Ulysses,
        or other communicators than those it was built with (an emulated link's included)."""
        if not self._takes(len(input_ids), ulysses):
            return None
        with comm.recording(None):  # a layer whose exchange falls back to Python's path (counted below, once)
            hidden = self.decoder(input_ids, positions, logits_rows, ulysses)
        if hidden is None:  # Ulysses did not install in C++: the same exchanges through the forward's Python path
            return None
        # the ledger counts the call's collectives as the forward's: two all-to-alls a layer over "sp" (none where
        # this rank attends every head chunk itself), two all-reduces of [tokens, hidden] over "tp"
        if ulysses.exchanges:
            self._record_all_to_alls(ulysses)
        record_decoder_all_reduces(self.decoder.model, len(input_ids), len(logits_rows), self.decoder.dtype.itemsize,
                                   self.tp_group)
        return hidden

    def attend(self, ulysses: UlyssesAttention) -> bool:
        """This rank's part in a step that gives it no tokens (ShiftModule._attend_only: each layer's attention of its
        head chunk over the other ranks' tokens) in one C++ call, its waits for their layers asleep; False (nothing
        run) where the decoder does not take the step."""
        if not self._takes(1, ulysses):
            return False
        with comm.recording(None):
            if not self.decoder.attend(ulysses):
                return False
        self._record_all_to_alls(ulysses)
        return True

    def _takes(self, num_tokens: int, ulysses: UlyssesAttention) -> bool:
        return (self.decoder.runs(num_tokens, ulysses.inner)
                and comm.native_communicator(self.sp_group) == self.sp_communicator
                and (self.tp_communicator is None
                     or comm.native_communicator(self.tp_group) == self.tp_communicator))

    def _record_all_to_alls(self, ulysses: UlyssesAttention) -> None:
        attn = self.decoder.model.layers[0].attn
        for nbytes in ulysses.message_bytes(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                            self.decoder.dtype.itemsize):
            comm.record_outside("all_to_all", len(self.decoder.model.layers), nbytes, self.sp_group)


class RowParallelSparseMoe(nn.Module):
    """A sparse MoE block whose experts each hold a slice of their FFN's intermediate dim (TP, as the dense MLP:
    gate/up rows, down columns), the router whole; every rank routes the same tokens the same way, and the
    partial outputs are summed over `group`; a shared expert (Qwen2-MoE) is split as a dense MLP, its partial output
    (scaled by its replicated gate) added to the experts' before the one sum, as vLLM's Qwen2-MoE does. Its parameters
    keep SparseMoeBlock's names."""

    def __init__(self, block: SparseMoeBlock, experts: Experts, group: dist.ProcessGroup):
        super().__init__()
        adopt_routing(self, block)
        self.experts = experts
        self.group = group
        self.adds_down_bias = dist.get_rank(group) == 0  # the experts' down_bias (whole) joins the sum once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.router(x), self.top_k, self.norm_topk_prob, self.float32_routing_weights,
                           self.routing, self.swiglu_limit, self.swiglu_alpha, down_bias=self.adds_down_bias)
        shared = self.shared_expert
        if shared is not None:
            assert shared.down_proj.group is self.group, "the shared expert is split over the experts' ranks"
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared.down_proj.partial(
                gate_up_silu(shared.gate_up_proj, x))
        return comm.all_reduce(out, self.group)
