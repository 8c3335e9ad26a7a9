"""ShiftModule: one model in two layouts that share one paged KV cache (paper 000, Alg. 3).

The base layout is combined (SP, TP) (Alg. 2): weights sharded over "tp", tokens over "sp",
Ulysses all-to-alls around attention. The shift layout is full TP over all P ranks in
shift-rank order. Both put head chunk `tp * SP + sp` on rank (sp, tp), so both read and write
the same KV blocks. The shift shards are slices of the base shards: zero-copy views
(`shift_weights="view"`) or contiguous copies (`"copy"`, +1/SP of the sharded weights, the
paper's choice).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torch_shift.compilation import CompiledForward, attention_op, seal, step_attention
from torch_shift.config import ModelConfig
from torch_shift.kv.cache import KVCache
from torch_shift.kv.host_tier import KVRegion
from torch_shift.models.batch import CausalAttention, PackedBatch
from torch_shift.models.decoder import AttentionFn, DecoderLM
from torch_shift.models.linear import Linear, prepare_linears
from torch_shift.models.loader import FUSED_PARTS, part_views
from torch_shift.models.moe import Experts, SparseMoeBlock
from torch_shift.models.native_decoder import NativeDecoder, Redraft
from torch_shift.models.sources import model_source
from torch_shift.parallel import comm
from torch_shift.parallel.agreement import check_ranks_agree, tensor_digest, value_digest
from torch_shift.parallel.expert_parallel import ExpertParallelSparseMoe
from torch_shift.parallel.groups import ShiftGroups, mesh_shape
from torch_shift.parallel.layers import (
    PartsLinear,
    RowParallelLinear,
    RowParallelSparseMoe,
    ShardDecoder,
    UlyssesDecoder,
    VocabParallelLMHead,
    warn_where_decoders_differ,
)
from torch_shift.parallel.layout_model import LayoutCounters, MicroBatch
from torch_shift.parallel.layouts import Layout
from torch_shift.parallel.plan import (
    ParallelPlan,
    PartSlice,
    base_plan,
    expert_shard,
    local_part_slice,
    padded_vocab,
    shift_plan,
    validate_expert_parallel,
    validate_mesh_for_model,
)
from torch_shift.parallel.runs import Run
from torch_shift.parallel.ulysses import UlyssesAttention, kv_send_index

# Reads one part of a parameter (our name, part or None), restricted to a slice (None: all of it).
TensorReader = Callable[[str, str | None, PartSlice | None], torch.Tensor]

def _local_head_counts(plan: ParallelPlan, config: ModelConfig) -> tuple[int, int]:
    """(query heads, KV heads) a rank attends to under `plan`, from its q and k slices."""
    name = "layers.0.attn.qkv_proj.weight"
    q, k = (local_part_slice(plan, config, name, part) for part in ("q", "k"))
    return q.length // config.head_dim, k.length // config.head_dim


def _sharded_skeleton(config: ModelConfig, plan: ParallelPlan) -> DecoderLM:
    """A DecoderLM on the meta device whose Linear layers are what the plan makes of them: a Shard(0)
    weight becomes a local column shard, a Shard(1) weight a row shard whose partial outputs are
    summed over the plan's mesh axis, the LM head a vocab-parallel head."""
    with torch.device("meta"):
        model = DecoderLM(config)
        heads, kv_heads = _local_head_counts(plan, config)
        for layer in model.layers:
            layer.attn.num_heads, layer.attn.num_kv_heads = heads, kv_heads
            if layer.attn.sinks is not None:
                layer.attn.sinks = nn.Parameter(torch.empty(heads))
        for name, module in list(model.named_modules()):
            weight_name = name + ".weight"
            sharded = plan.shard_dim_and_axis(weight_name) if isinstance(module, nn.Linear) else None
            if sharded is None:
                continue
            dim, axis = sharded
            mesh, _ = plan.lookup(weight_name)
            group = mesh.get_group(axis)
            out_features, in_features = module.weight.shape
            parts = FUSED_PARTS.get(name.split(".")[-1], (None,))
            slices = [local_part_slice(plan, config, weight_name, part) for part in parts]
            if name == "lm_head":
                rows = padded_vocab(config.vocab_size, group.size()) // group.size()
                local = VocabParallelLMHead(torch.empty(rows, in_features), config.vocab_size, group)
            elif dim == 0:
                local = Linear(in_features, sum(sl.length for sl in slices), bias=module.bias is not None)
            else:
                bias = None if module.bias is None else torch.empty(out_features)
                local = RowParallelLinear(torch.empty(out_features, slices[0].length), group, bias)
            model.set_submodule(name, local)
        for name, module in list(model.named_modules()):
            shard = (expert_shard(plan, config, name + ".experts.down_proj")
                     if isinstance(module, SparseMoeBlock) else None)
            if shard is not None:  # whole experts [first, first + count) on this rank
                axis = plan.shard_dim_and_axis(name + ".experts.down_proj")[1]
                experts = Experts(shard[1], config.hidden_size, config.moe_intermediate_size,
                                  bias=config.expert_bias, first_expert=shard[0])
                # SP ranks hold their own tokens; TP ranks the same ones
                model.set_submodule(name, ExpertParallelSparseMoe(module, experts,
                                                                  _group_of(plan, name + ".experts.down_proj"),
                                                                  tokens_partitioned=axis == "sp"))
            elif isinstance(module, SparseMoeBlock) and plan.shard_dim_and_axis(name + ".experts.down_proj"):
                group = _group_of(plan, name + ".experts.down_proj")
                width = local_part_slice(plan, config, name + ".experts.down_proj", "0").length
                experts = Experts(config.num_experts, config.hidden_size, width, bias=config.expert_bias)
                model.set_submodule(name, RowParallelSparseMoe(module, experts, group))
    return model


def _group_of(plan: ParallelPlan, param_name: str) -> dist.ProcessGroup:
    """The process group over which the plan shards the parameter."""
    mesh, _ = plan.lookup(param_name)
    _, axis = plan.shard_dim_and_axis(param_name)
    return mesh.get_group(axis)


def load_base(config: ModelConfig, groups: ShiftGroups, read: TensorReader, dtype: torch.dtype,
              device: torch.device, expert_parallel: bool = False) -> DecoderLM:
    """The base-layout model with only this rank's shards read."""
    plan = base_plan(groups, expert_parallel)
    model = _sharded_skeleton(config, plan)
    model.to(dtype).to_empty(device=device)
    model.rotary.materialize(device)
    with torch.no_grad():
        for name, _ in model.named_parameters():
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue
            for part, dest in part_views(model, name).items():
                part_slice = local_part_slice(plan, config, name, part)
                tensor = read(name, part, part_slice)
                if name == "lm_head.weight":
                    dest.zero_()  # rows past the vocabulary (padding to a multiple of P)
                    dest = dest[: tensor.shape[0]]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(f"{name}[{part}]: read shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
                dest.copy_(tensor)
        if config.tie_word_embeddings:
            head = model.lm_head.weight.data
            head.zero_()
            sl = local_part_slice(plan, config, "lm_head.weight", None)
            head[: sl.length].copy_(model.embed_tokens.weight.data[sl.start: sl.start + sl.length])
    return model.eval().requires_grad_(False)


def derive_tp(source: DecoderLM, config: ModelConfig, source_plan: ParallelPlan | None, target_plan: ParallelPlan,
              group: dist.ProcessGroup, weights: str) -> DecoderLM:
    """A TP model whose shards are slices of `source`'s (which holds a superset of each: its shards
    under `source_plan`, or whole tensors when that is None): views, or contiguous copies that re-fuse
    q/k/v and gate/up. Embedding, norms and rotary tables are `source`'s own modules, and so is the LM head,
    unless the target shards the vocabulary and `source` holds it whole: then the rank's rows of it.
    Shift (paper 000) derives full TP from the (SP, TP) shards; Flying (paper 004) derives TP-d over
    a group of replicas from each replica's full weights."""
    if weights not in ("view", "copy"):
        raise ValueError(f"layout weights must be 'view' or 'copy', got {weights!r}")
    derived = copy.copy(source)  # shallow: shares every submodule until replaced below
    derived._modules = dict(source._modules)
    derived.layers = nn.ModuleList()
    heads, kv_heads = _local_head_counts(target_plan, config)

    def target_window(name: str, part: str | None) -> tuple[int, int, int]:
        """(dim, start within the source's tensor, length) of the target's slice of a part."""
        t = local_part_slice(target_plan, config, name, part)
        s = local_part_slice(source_plan, config, name, part) if source_plan is not None else None
        first = s.start if s is not None else 0
        assert s is None or (s.dim == t.dim and s.start <= t.start and t.start + t.length <= s.start + s.length), \
            (name, part)
        return t.dim, t.start - first, t.length

    def target_slice(name: str, part: str | None, source_tensor: torch.Tensor) -> torch.Tensor:
        view = source_tensor.narrow(*target_window(name, part))
        return view if weights == "view" else view.contiguous()

    for i, source_layer in enumerate(source.layers):
        layer = copy.copy(source_layer)
        layer._modules = dict(source_layer._modules)
        attn = copy.copy(source_layer.attn)
        attn._modules = dict(source_layer.attn._modules)
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        prefix = f"layers.{i}."
        if source_layer.attn.sinks is not None:
            attn._parameters = dict(source_layer.attn._parameters)  # the copy's own: the source keeps its sinks
            attn.sinks = nn.Parameter(target_slice(prefix + "attn.sinks", None, source_layer.attn.sinks.data),
                                      requires_grad=False)
        qkv_name = prefix + "attn.qkv_proj.weight"
        parts = [target_slice(qkv_name, p, t) for p, t in part_views(source, qkv_name).items()]
        biases = None
        if config.attention_bias:
            bias_name = prefix + "attn.qkv_proj.bias"
            biases = [target_slice(bias_name, p, t) for p, t in part_views(source, bias_name).items()]
        attn.qkv_proj = _fused(parts, biases, weights)
        o_name = prefix + "attn.o_proj.weight"
        o_bias = source_layer.attn.o_proj.bias
        attn.o_proj = RowParallelLinear(target_slice(o_name, None, source.get_parameter(o_name).data), group,
                                        None if o_bias is None else o_bias.data)
        def derive_mlp(source_mlp: nn.Module, mlp_prefix: str) -> nn.Module:
            """A gated MLP's (a dense layer's, or a shared expert's) target slices: gate/up rows, down columns."""
            mlp = copy.copy(source_mlp)
            mlp._modules = dict(source_mlp._modules)
            gu_name = mlp_prefix + "gate_up_proj.weight"
            mlp.gate_up_proj = _fused([target_slice(gu_name, p, t) for p, t in part_views(source, gu_name).items()],
                                      None, weights)
            down_name = mlp_prefix + "down_proj.weight"
            mlp.down_proj = RowParallelLinear(target_slice(down_name, None, source.get_parameter(down_name).data),
                                              group)
            return mlp

        if isinstance(source_layer.mlp, ExpertParallelSparseMoe):  # the same experts, tokens replicated now
            mlp = ExpertParallelSparseMoe(source_layer.mlp, source_layer.mlp.experts, group, tokens_partitioned=False)
        elif isinstance(source_layer.mlp, (SparseMoeBlock, RowParallelSparseMoe)):
            mlp = _derive_experts(source_layer.mlp, prefix + "mlp.experts.", target_window, group, weights)
        else:
            mlp = derive_mlp(source_layer.mlp, prefix + "mlp.")
        if getattr(mlp, "shared_expert", None) is not None:
            mlp.shared_expert = derive_mlp(source_layer.mlp.shared_expert, prefix + "mlp.shared_expert.")
        layer.attn, layer.mlp = attn, mlp
        derived.layers.append(layer)
    head = local_part_slice(target_plan, config, "lm_head.weight", None)
    if head is not None and not isinstance(source.lm_head, VocabParallelLMHead):
        derived.lm_head = _vocab_rows(source.lm_head.weight.data, head, config.vocab_size, group, weights)
    return derived


def _vocab_rows(weight: torch.Tensor, rows: PartSlice, vocab_size: int, group: dist.ProcessGroup,
                weights: str) -> VocabParallelLMHead:
    """A rank's rows `rows` of a whole LM head `weight` as a VocabParallelLMHead over `group`: a view or a copy,
    padded with zero rows to the others' count where they run past the vocabulary (a copy then)."""
    count = padded_vocab(vocab_size, group.size()) // group.size()
    part = weight[rows.start:rows.start + rows.length]
    if rows.length < count:
        part = torch.cat([part, part.new_zeros(count - rows.length, part.shape[1])])
    elif weights == "copy":
        part = part.clone()
    return VocabParallelLMHead(part, vocab_size, group)


def _derive_experts(block: nn.Module, prefix: str, target_window: Callable, group: dist.ProcessGroup,
                    weights: str) -> RowParallelSparseMoe:
    """The target layout's slice of every expert's FFN, the router shared. The down projections' slices are views
    (or copies); each expert's gate and up rows are two runs of rows that no single view holds: always a copy."""
    gate_up, down = block.experts.gate_up_proj.data, block.experts.down_proj.data
    half = gate_up.shape[1] // 2
    _, first, rows = target_window(prefix + "gate_up_proj", "0.gate")  # every expert is sharded alike
    first_gu = first
    local_gate_up = torch.cat([gate_up[:, first:first + rows], gate_up[:, half + first:half + first + rows]], dim=1)
    _, first, columns = target_window(prefix + "down_proj", "0")
    local_down = down[:, :, first:first + columns]
    if weights != "view":
        local_down = local_down.contiguous()
    with torch.device("meta"):
        experts = Experts(gate_up.shape[0], gate_up.shape[2], rows)
    experts.gate_up_proj = nn.Parameter(local_gate_up, requires_grad=False)
    experts.down_proj = nn.Parameter(local_down, requires_grad=False)
    if block.experts.gate_up_bias is not None:  # the gate and up biases sliced as their rows; down_bias whole
        bias = block.experts.gate_up_bias.data
        experts.gate_up_bias = nn.Parameter(torch.cat([bias[:, first_gu:first_gu + rows],
                                                       bias[:, half + first_gu:half + first_gu + rows]], dim=1),
                                            requires_grad=False)
        experts.down_bias = block.experts.down_bias
    return RowParallelSparseMoe(block, experts, group)


def derive_shift(base: DecoderLM, config: ModelConfig, groups: ShiftGroups, shift_weights: str) -> DecoderLM:
    """The shift-layout model: its shards are slices of the base shards (views or copies)."""
    return derive_tp(base, config, base_plan(groups), shift_plan(groups), groups.shift_group, shift_weights)


def _fused(weights: list[torch.Tensor], biases: list[torch.Tensor] | None, shift_weights: str) -> nn.Module:
    if shift_weights == "view":
        return PartsLinear(weights, biases)
    linear = Linear(weights[0].shape[1], sum(w.shape[0] for w in weights), bias=biases is not None,
                    device="meta")
    linear.weight = nn.Parameter(torch.cat(weights), requires_grad=False)
    if biases is not None:
        linear.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    return linear


class ShiftModule(LayoutCounters, nn.Module):
    """`forward_step` runs one engine step in the layout the step plan names and returns its logits;
    `forward` runs a whole batch without a KV cache in the layout its token count picks."""

    def __init__(self, base: DecoderLM, shift: DecoderLM | None, groups: ShiftGroups, config: ModelConfig,
                 shift_threshold: int | None, shift_weights: str):
        super().__init__()
        self.base = base
        self.shift = shift
        self.groups = groups
        self.config = config
        self.shift_threshold = shift_threshold
        self.shift_weights = shift_weights
        # a buffer, so that `.to()` moves it with the weights (index_select wants it on their device)
        index = kv_send_index(config.num_key_value_heads, groups.sp, groups.tp, groups.tp_rank)
        self.register_buffer("kv_send_index", None if index is None else
                             index.to(base.embed_tokens.weight.device), persistent=False)
        self.reset_counters()  # both layouts' weights are resident: no reshard ever
        self.forwards = {"base": self.base, "shift": self.shift}  # per layout; see compile_layouts()
        # a layout's small steps in C++ (native_decode): a TP layout's, and the base layout's SP ranks' tokens
        self.native_decoders: dict[str, ShardDecoder | UlyssesDecoder | NativeDecoder] = {}
        # both layouts attend head chunk `shift rank`: the KV cache holds the shift plan's KV heads
        _, self.num_local_kv_heads = _local_head_counts(shift_plan(groups), config)
        self.num_kv_layers = config.num_hidden_layers
        # experts split over the SP ranks exchange tokens in every layer: a rank without rows still runs the layers
        self.experts_over_sp = any(isinstance(layer.mlp, ExpertParallelSparseMoe) for layer in base.layers)
        k_rows = local_part_slice(shift_plan(groups), config, "layers.0.attn.qkv_proj.weight", "k")
        self._kv_region = KVRegion(0, config.num_hidden_layers, k_rows.start // config.head_dim,
                                   self.num_local_kv_heads)
        self.solo_steps = False  # one-token base steps on SP rank 0 alone (share_kv)
        self._kv_peers: list[KVCache | None] | None = None
        # whether SP rank 0 holds the whole LM head for those steps (`solo_lm_head`, None on the other SP ranks; set on
        # every SP rank by build_shift_module): else the SP ranks share its vocabulary in them, in two collectives
        # that wake each idle SP rank on a core SP rank 0's decode pool is using
        self.solo_head = False
        self.solo_lm_head: Linear | None = None

    def share_kv(self, peers: list[KVCache | None] | None) -> None:
        """The SP group's KV caches are shared (torch_shift.parallel.shared_kv; the same call on every rank of the
        replica, `peers` SP rank 0's view of every SP rank's cache, None elsewhere): from now on a base step of one
        token runs on SP rank 0 (with its TP group) alone, which writes and attends each head chunk in its rank's
        cache, and the other SP ranks join only its LM head (whose vocabulary they share)."""
        assert (peers is not None) == (self.groups.sp_rank == 0) and not self.experts_over_sp
        self.solo_steps = True
        self._kv_peers = peers

    def unshare_kv(self) -> None:
        """The engine that shared the KV closes: one-token base steps exchange again, and the SP peers' caches are
        no longer held here (a model the user built outlives its engines)."""
        self.solo_steps = False
        self._kv_peers = None

    def solo_head_possible(self) -> bool:
        """Whether SP rank 0 may hold the whole LM head for one-token base steps (the same answer on every rank): a
        base layout of SP ranks alone (no TP, no experts over them) whose one-token steps run in the base layout (no
        shift layout, or a threshold of 0). The head costs (SP - 1) / SP of the vocabulary's rows more on that
        rank."""
        groups = self.groups
        return (groups.sp > 1 and groups.tp == 1 and not self.experts_over_sp
                and (self.shift is None or self.shift_threshold == 0))

    def drop_solo_head(self) -> None:
        """The SP ranks' KV is not shared (the same call on every rank of the replica): SP rank 0's whole LM head,
        for one-token steps on it alone, goes."""
        self.solo_head = False
        self.solo_lm_head = None
        self.native_decoders.pop("solo", None)

    def _solo(self, num_tokens: int) -> bool:
        return self.solo_steps and num_tokens == 1

    def idle_in(self, layout: Layout, num_tokens: int) -> bool:
        """An SP rank but the first in a one-token base step where SP rank 0 holds the whole LM head."""
        return (self.solo_head and self.groups.sp_rank != 0 and layout.kind != "shift" and self._solo(num_tokens))

    def kv_region(self, layout: Layout) -> KVRegion:
        """What this rank's pool holds of the whole KV cache (the same in both layouts): every layer, the
        KV heads of its shift rank (one replicated head when there are more ranks than KV heads)."""
        return self._kv_region

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, seq, vocab] of a whole batch [batch, seq], without a KV cache.

        `attention_mask` (1 = token, 0 = padding, on either side): only the real tokens run, each
        row as if alone (positions counted from its first real token, as transformers' `generate`
        does), and the logits at padding are zero. The layout is chosen by the number of real
        tokens, as the engine chooses per step. Every rank calls it with the same batch (compared: a ValueError on
        every rank where one differs).
        """
        check_ranks_agree({"input_ids": tensor_digest(input_ids), "attention_mask": tensor_digest(attention_mask)},
                          "a parallelized module's forward", self.groups.shift_group)
        device = self.base.embed_tokens.weight.device
        batch = PackedBatch.from_padded(input_ids, attention_mask, self.config, device)
        if batch.num_tokens == 0:
            return torch.zeros(*batch.mask.shape, self.config.vocab_size, dtype=self.base.embed_tokens.weight.dtype,
                               device=device)
        attention = CausalAttention(batch.seq_lens, self.config.sliding_window)
        every = torch.arange(batch.num_tokens, device=device)
        which = self.choose_layout(batch.num_tokens)
        self.layout_counts[which] += 1
        with comm.recording(self.ledger), comm.layout_scope(which):
            logits = self._forward(which, batch.input_ids, batch.positions, attention, every)
        return batch.unpack(logits)

    def prepare_weights(self, drop_dense: bool = True) -> int:
        """Pack both layouts' weights for the machine's matmul (torch_shift.models.linear); the shift
        layout's views of the base shards become packed copies. Returns the bytes packed."""
        return prepare_linears(self, drop_dense)

    def compile_layouts(self) -> None:
        """Compile each layout's forward (dynamic token dimension, attention as an opaque op)."""
        self.forwards = {layout: CompiledForward(model) if model is not None else None
                         for layout, model in (("base", self.base), ("shift", self.shift))}

    def seal_compiled(self) -> None:
        """After the start-up warm-up: the compiled forwards stop checking every guard (compilation.CompiledForward)."""
        seal(self.forwards.values())

    def native_decode(self) -> bool:
        """Run each layout's steps of at most MAX_TOKENS tokens (a rank's share of them under SP) through one C++ call
        on each rank where the model allows (torch_shift.models.native_decoder): the shift layout's and static TP's
        shards (ShardDecoder), and the tokens of the base layout's SP ranks (UlyssesDecoder); whether any does. After
        `prepare_weights`: it reads the packed weights. Batch-1 decode of the 106M model at TP-2, alternated with the
        compiled forward in one engine: 1.13x faster in float32, 1.27x in bfloat16; Shift's TP steps 1.07x; static
        SP-2's about 1.05x (0.95-1.14 over eight runs), most of its gain being the idle rank's waits asleep
        (docs/performance.md). Every rank of the replica calls it (warn_where_decoders_differ)."""
        self.native_decoders = {}
        models = {which: model for which, model in (("base", self.base), ("shift", self.shift)) if model is not None}
        for which, model in models.items():
            if which == "base" and self.groups.sp > 1:
                decoder = UlyssesDecoder.build(model, self.groups.sp_group)
            else:
                decoder = ShardDecoder.build(model)
            if decoder is not None:
                self.native_decoders[which] = decoder
        if "base" in self.native_decoders and self.solo_lm_head is not None:
            # SP rank 0's one-token steps with the whole LM head, for multi-step runs: the base layers' C++ decoder
            # (the TP group is this rank alone) with that head and its argmax
            solo = copy.copy(self.base)
            solo._modules = {**self.base._modules, "lm_head": self.solo_lm_head}
            decoder = NativeDecoder.build(solo, self.groups.tp_group, None)
            if decoder is not None:
                self.native_decoders["solo"] = decoder
        warn_where_decoders_differ({which: which in self.native_decoders for which in models}, self.groups.shift_group)
        return bool(self.native_decoders)

    def choose_layout(self, num_scheduled_tokens: int) -> str:
        """Paper 000, Alg. 3: more tokens than the threshold -> base, else shift."""
        if self.shift is None or num_scheduled_tokens > self.shift_threshold:
            return "base"
        return "shift"

    def staged_check_tokens(self) -> int:
        """The shift layout's (full TP), where a small step runs; static TP's without it."""
        decoder = self.native_decoders.get("shift") or (self.native_decoders.get("base") if self.groups.sp == 1
                                                         else None)
        return decoder.decoder.max_tokens if isinstance(decoder, ShardDecoder) else 0

    def forward_step(self, layout: Layout, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """One engine step: a layout of kind "shift" runs full TP, any other (the deployment's SP x TP
        base, "tp", "dp@i") the base layout."""
        (batch,) = micro_batches
        self.layout_counts[layout.name] += 1
        with comm.recording(self.ledger), comm.layout_scope(layout.name):
            return self._forward("shift" if layout.kind == "shift" else "base", batch.input_ids, batch.positions,
                                 batch.attention, batch.logits_indices, batch.first_stage, batch.redraft)

    def forward_steps(self, layout: Layout, batch: MicroBatch, run: Run) -> np.ndarray | None:
        """A multi-step run in one call of the shard's C++ decoder: the shift layout's TP steps, static TP's, and SP
        rank 0's one-token steps over the shared KV where it holds the whole LM head (`solo_head`: its own decoder
        of the base layers and that head)."""
        which = "shift" if layout.kind == "shift" else "base"
        attention = batch.attention
        if which == "base" and self.groups.sp > 1:
            # SP rank 0 alone over the shared KV with the whole LM head (a run of one request); the other SP ranks
            # are idle in those steps (idle_in)
            which = "solo"
            if not (self.solo_head and self._solo(len(batch.input_ids)) and callable(getattr(attention, "over", None))):
                return None
            attention = self._solo_attention(attention, len(batch.input_ids))
        native = self.native_decoders.get(which)
        if native is None:
            return None
        return self.run_steps_in_one_call(native, layout, batch, run, attention)

    def _forward(self, which: str, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                 logits_indices: torch.Tensor, first_stage: int = 0, redraft: Redraft | None = None) -> torch.Tensor:
        if which == "base" and self.groups.sp > 1:
            return self._base_step(input_ids, positions, attention, logits_indices)
        native = self.native_decoders.get(which)
        logits = (native.step(input_ids, positions, logits_indices, attention, first_stage, redraft)
                  if native is not None else None)
        if logits is not None:
            return logits
        if which == "shift":
            assert self.shift is not None, "this ShiftModule was built without a shift layout"
            return self.shift.compute_logits(self.forwards["shift"](input_ids, positions, attention, logits_indices))
        return self._base_step(input_ids, positions, attention, logits_indices)

    def _base_step(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                   logits_indices: torch.Tensor) -> torch.Tensor:
        sp, sp_rank = self.groups.sp, self.groups.sp_rank
        if sp == 1:
            # plain TP: the step's attention as it is (wrapped for Ulysses with SP 1, its all-to-alls only copied,
            # and the compiled forward's attention ran its Python path instead of the C++ one: a TP-2 decode step
            # of the 106M model took 2 ms more for it, docs/performance.md)
            return self.base.compute_logits(self.forwards["base"](input_ids, positions, attention, logits_indices))
        n = input_ids.shape[0]
        solo_attention = callable(getattr(attention, "over", None))
        # the other SP ranks skipped this step (idle_in), whatever attention it runs
        assert solo_attention or not (self.solo_head and self._solo(n)), "a one-token step without the shared KV"
        if self._solo(n) and solo_attention:
            return self._solo_step(input_ids, positions, attention, logits_indices)
        # SP rank r holds counts[r] tokens (n // sp or one more), after those of ranks < r, none padded: a step of
        # fewer tokens than SP ranks leaves the last ranks no rows, and they read no weights (padded, batch-1 decode
        # in SP-2 read the weights on both ranks, one of them for a padding row)
        counts = [n // sp + (r < n % sp) for r in range(sp)]
        start = sum(counts[:sp_rank])
        n_local = counts[sp_rank]
        ulysses = UlyssesAttention(attention, self.groups.sp_group, counts, self.kv_send_index)
        # the LM head needs the sampled positions' hidden states on every rank: each SP rank fills
        # the rows of its own tokens and a sum over "sp" assembles them
        local = logits_indices - start
        mine = (local >= 0) & (local < n_local)
        native = self.native_decoders.get("base") if n_local else None
        ids, at = input_ids[start:start + n_local], positions[start:start + n_local]
        mine_rows = native.step(ids, at, local[mine], ulysses) if native is not None else None
        if mine_rows is None and (n_local or self.experts_over_sp):
            mine_rows = self.forwards["base"](ids, at, ulysses, local[mine])
        if mine_rows is not None:
            rows = mine_rows.new_zeros(logits_indices.shape[0], mine_rows.shape[-1])
            rows[mine] = mine_rows
        else:
            hidden = self._attend_only(ulysses)
            rows = hidden.new_zeros(logits_indices.shape[0], hidden.shape[-1])
        rows = comm.all_reduce(rows, self.groups.sp_group)
        return self.base.compute_logits(rows)

    def _solo_step(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                   logits_indices: torch.Tensor) -> torch.Tensor | None:
        """A one-token base step over the shared KV (share_kv): SP rank 0 runs every layer for the token and
        attends each head chunk into that chunk's rank's cache (`attention.over` it), then the LM head alone where
        it holds it whole (`solo_head`: the other SP ranks return None at once; a static SP-2 batch-1 float32 step
        of the 106M model spent 0.9 ms of 12-14 in the two collectives, docs/performance.md); else the other SP
        ranks wait for the LM head, whose vocabulary the SP ranks share."""
        if self.groups.sp_rank == 0:
            ulysses = self._solo_attention(attention, len(input_ids))
            native = self.native_decoders.get("base")
            rows = native.step(input_ids, positions, logits_indices, ulysses) if native is not None else None
            if rows is None:
                rows = self.forwards["base"](input_ids, positions, ulysses, logits_indices)
            if self.solo_head:
                return self.solo_lm_head(rows)
        elif self.solo_head:  # SP rank 0 computes the logits alone: nothing to do here
            return None
        else:
            weight = self.base.embed_tokens.weight
            rows = weight.new_zeros(logits_indices.shape[0], self.config.hidden_size)
        return self.base.compute_logits(comm.all_reduce(rows, self.groups.sp_group))

    def _solo_attention(self, attention: AttentionFn, num_tokens: int) -> UlyssesAttention:
        """SP rank 0's attention in a step it runs alone over the shared KV: each head chunk into its rank's cache."""
        own = attention.kv_cache
        chunk_attention = [attention if cache is None else attention.over(
            cache.regroup(own.num_layers, own.num_kv_heads)) for cache in self._kv_peers]
        return UlyssesAttention(attention, self.groups.sp_group, [num_tokens] + [0] * (self.groups.sp - 1),
                                self.kv_send_index, chunk_attention)

    def _attend_only(self, ulysses: UlyssesAttention) -> torch.Tensor:
        """A rank without rows in the step (fewer tokens than SP ranks): only its head chunk of each layer's
        attention over the other ranks' tokens, which the all-to-alls bring, instead of every layer's kernels on no
        rows (an SP-2 batch-1 decode step took 0.83-1.07x the time, median 0.93, alternated with that;
        docs/performance.md), all of it in one C++ call where the base layout's decoder takes the step. Returns the
        hidden states of no rows."""
        weight = self.base.embed_tokens.weight
        native = self.native_decoders.get("base")
        if native is not None and native.attend(ulysses):
            return weight.new_empty(0, self.config.hidden_size)
        # through the attention operator, as a compiled forward calls it: in C++ where Ulysses installs there
        attend = attention_op if isinstance(self.forwards["base"], CompiledForward) else ulysses
        with step_attention(ulysses):
            for layer in self.base.layers:
                attn = layer.attn
                q = weight.new_empty(0, attn.num_heads, attn.head_dim)
                kv = weight.new_empty(0, attn.num_kv_heads, attn.head_dim)
                if attn.sinks is None and attn.sliding_window is None:
                    attend(attn.layer_idx, q, kv, kv)
                else:
                    attend(attn.layer_idx, q, kv, kv, attn.sinks, attn.sliding_window)
        return weight.new_empty(0, self.config.hidden_size)


def build_shift_module(config: ModelConfig, groups: ShiftGroups, read: TensorReader, dtype: torch.dtype,
                       device: torch.device, shift_threshold: int | None = 256,
                       shift_weights: str = "copy", expert_parallel: bool = False) -> ShiftModule:
    validate_mesh_for_model(config, groups.sp, groups.tp, expert_parallel)
    if expert_parallel:
        validate_expert_parallel(config, groups.sp, groups.tp)
    if shift_threshold is not None and shift_threshold < 0:
        raise ValueError(f"shift_threshold must be >= 0 or None, got {shift_threshold}")
    base = load_base(config, groups, read, dtype, device, expert_parallel)
    # with SP = 1 the base layout is already full TP: one layout, one copy of the weights
    shift = derive_shift(base, config, groups, shift_weights) if shift_threshold is not None and groups.sp > 1 else None
    module = ShiftModule(base, shift, groups, config, shift_threshold, shift_weights)
    if module.solo_head_possible() and device.type == "cpu":  # the only device whose SP ranks share their KV
        module.solo_head = True
        if groups.sp_rank == 0:
            module.solo_lm_head = load_solo_lm_head(base, config, read, dtype, device)
    return module


def load_solo_lm_head(base: DecoderLM, config: ModelConfig, read: TensorReader, dtype: torch.dtype,
                      device: torch.device) -> Linear:
    """The whole LM head, for SP rank 0's one-token steps (ShiftModule.share_kv): read whole, or the whole
    embedding where the two are tied."""
    head = Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
    if config.tie_word_embeddings:
        weight = base.embed_tokens.weight.data
    else:
        weight = read("lm_head.weight", None, PartSlice(0, 0, config.vocab_size)).to(device=device, dtype=dtype)
    if tuple(weight.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(f"lm_head.weight: read shape {tuple(weight.shape)}, expected "
                         f"{(config.vocab_size, config.hidden_size)}")
    head.weight = nn.Parameter(weight, requires_grad=False)
    return head.eval()


def _weights_sample(model: nn.Module) -> dict[str, tuple]:
    """Each parameter's shape and a few of its values (a DTensor's placements instead: its local shards differ by
    rank): ranks whose models were initialised apart (no common seed, no checkpoint) differ here."""
    from torch.distributed.tensor import DTensor

    sample = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            sample[name] = (tuple(p.shape), str(p.placements))
        else:
            flat = p.detach().reshape(-1)
            sample[name] = (tuple(p.shape), value_digest(flat[::max(1, flat.numel() // 8)][:8].float())[:8])
    return sample


def _mesh_wide_group(mesh: DeviceMesh) -> dist.ProcessGroup | None | bool:
    """The group of every rank of the mesh (None: the default group), or False where there is none to agree in:
    a mesh of one rank, or one this rank is not in or that `ShiftGroups.from_mesh` refuses."""
    ranks = mesh.mesh.flatten().tolist()
    if len(ranks) == 1 or dist.get_rank() not in ranks:
        return False
    if len(ranks) == dist.get_world_size():
        return None
    return mesh.get_group(mesh.ndim - 1) if mesh.ndim == 1 or mesh.shape[0] == 1 else False


def parallelize(model: nn.Module, mesh: DeviceMesh, shift_threshold: int | None = 256,
                shift_weights: str = "copy") -> ShiftModule:
    """Shard a model over a ("sp", "tp") DeviceMesh, or a 1-D ("tp",) one, into a ShiftModule: the
    base layout (SP, TP) and the shift layout (full TP), chosen per call or per engine step by
    the number of tokens (more than `shift_threshold` -> base; None: no shift layout).

    `model`: transformers' LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or
    Qwen3ForCausalLM, torchtitan's Llama 3, or torch_shift's DecoderLM; its parameters plain
    tensors or DTensors (e.g. under FSDP2 or TP); its config is read from the model. Every rank
    calls this with the same model. Each rank reads only its shards from the model's parameters (a
    DTensor is gathered one parameter at a time) onto the mesh's device: the model is only read,
    and can be dropped afterwards.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize takes the model as an nn.Module, got {type(model).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"parallelize takes a DeviceMesh (torch.distributed.device_mesh.init_device_mesh), got "
                        f"{type(mesh).__name__}")
    if shift_threshold is not None and (isinstance(shift_threshold, bool) or not isinstance(shift_threshold, int)
                                        or shift_threshold < 0):
        raise ValueError(f"shift_threshold must be an int >= 0 or None, got {shift_threshold!r}")
    if shift_weights not in ("copy", "view"):
        raise ValueError(f"shift_weights must be 'copy' or 'view', got {shift_weights!r}")
    accelerator = getattr(torch, mesh.device_type, None) if mesh.device_type != "cpu" else None
    if mesh.device_type != "cpu" and (accelerator is None or not accelerator.is_available()):
        raise ValueError(f"the mesh is on {mesh.device_type!r}, which this machine does not have")
    on_meta = next((name for name, p in model.named_parameters() if p.is_meta), None)
    if on_meta is not None:
        raise ValueError(f"the model's parameters are on the meta device ({on_meta}, ...): they hold no weights to "
                         "shard; materialize them first (model.to_empty(device=...) and load a checkpoint)")
    source = model_source(model)
    dtype = next(model.parameters()).dtype
    try:
        # ranks that differ in any of these failed inside a collective (gloo aborts the process) or ran on silently
        fingerprint = {"model": type(model).__qualname__, "config": source.config, "dtype": dtype,
                       "mesh": {"axes": mesh.mesh_dim_names, "shape": tuple(mesh.shape), "device": mesh.device_type,
                                "ranks": mesh.mesh.flatten().tolist()},
                       "shift_threshold": shift_threshold, "shift_weights": shift_weights,
                       "weights": _weights_sample(model)}
        with_ranks = _mesh_wide_group(mesh)
        if with_ranks is not False:
            check_ranks_agree(fingerprint, "parallelize", with_ranks)
        sp, tp = mesh_shape(mesh)
        validate_mesh_for_model(source.config, sp, tp)  # before any group is made
    except BaseException:
        source.close()
        raise
    device = torch.device(mesh.device_type)
    if device.type != "cpu":
        device = torch.device(device.type, getattr(torch, device.type).current_device())
    try:
        return build_shift_module(source.config, ShiftGroups.from_mesh(mesh), source, dtype, device,
                                  shift_threshold, shift_weights)
    finally:
        source.close()
