"""Pipeline parallelism, and Seesaw's two layouts over one replica (paper 003).

A pipeline replica of P ranks runs P stages of consecutive layers (`stage_layers`): the embedding
on the first, the final norm and the LM head on the last. The model file stays free of parallel
code: a `PipelineStage` is built from the model's own `DecoderLayer`s and runs a range of them.
A step's batch is cut into micro-batches (`micro_batch_count`, carried in the step plan; every rank
cuts it the same way, `split_micro_batches`), and each stage runs them in order, receiving a
micro-batch's activations from the stage before and sending its own on as soon as they are done, so
that all stages work at once. The last stage returns the logits.

Under Seesaw the same ranks also form a TP-P group. Each rank holds what it needs for both layouts:
its stage's layers (whole) and its TP shard of every layer, either both resident
(`weights="resident"`: a switch swaps modules) or with the inactive set only as a host copy
(`"host"`: the layers of both sets share one device buffer, and a switch copies the other set in).
The KV pool is one buffer viewed as the stage's layers with every KV head under PP, as every
layer with the rank's heads under TP: the same bytes per block.
"""

from __future__ import annotations

import re
import time

import numpy as np
import torch
from torch import nn

from torch_shift.compilation import CompiledForward, seal
from torch_shift.config import ModelConfig
from torch_shift.kv.host_tier import KVRegion
from torch_shift.models.decoder import AttentionFn, DecoderLayer, DecoderLM, embed, make_norm
from torch_shift.models.linear import Linear, prepare_linears
from torch_shift.models.loader import part_views
from torch_shift.models.rope import RotaryEmbedding
from torch_shift.parallel import comm
from torch_shift.parallel.groups import DeploymentGroups
from torch_shift.parallel.layers import ShardDecoder, shard_group, warn_where_decoders_differ
from torch_shift.parallel.layout_model import LayoutCounters, MicroBatch
from torch_shift.parallel.layouts import Deployment, Layout, stage_layers
from torch_shift.parallel.runs import Run
from torch_shift.parallel.shift import TensorReader, load_base

_ACTIVATION_TAG = 1 << 16  # point-to-point tags of activations (logits to rank 0 use the group index)


class PipelineStage(nn.Module):
    """Layers `layers` of a decoder (local indices from 0, the KV pool of a stage holds only its own), the
    embedding when it is the first stage, the final norm and the LM head when it is the last."""

    def __init__(self, config: ModelConfig, layers: range, is_first: bool, is_last: bool):
        super().__init__()
        self.layer_range = layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if is_first else None
        self.layers = nn.ModuleList(DecoderLayer(config, i, layers.start + i) for i in range(len(layers)))
        self.norm = make_norm(config, config.hidden_size) if is_last else None
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False) if is_last else None
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings, config.local_rope)
        self.config = config

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """inputs: token ids [T] on the first stage, the previous stage's hidden states [T, hidden] on the
        others -> hidden states [T, hidden] (after the final norm on the last stage), or, on the last stage, of
        the tokens at `logits_indices` only (DecoderLM.forward's)."""
        assert logits_indices is None or self.norm is not None, "only the last stage's rows go to the LM head"
        x, residual = embed(self.config, self.embed_tokens, inputs) if self.embed_tokens is not None else inputs, None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, positions, self.rotary, attention, residual, logits_indices if i == last else None)
        if residual is not None:
            return self.norm(x, residual)[0] if self.norm is not None else x + residual
        return self.norm(x) if self.norm is not None else x


def load_stage(config: ModelConfig, layers: range, is_first: bool, is_last: bool, read: TensorReader,
               dtype: torch.dtype, device: torch.device, shared: DecoderLM | None = None) -> PipelineStage:
    """A stage with its parameters read; `shared`: a model on this rank whose embedding, final norm and
    rotary tables (replicated in TP) the stage uses instead of copies of its own."""
    with torch.device("meta"):
        stage = PipelineStage(config, layers, is_first, is_last).to(dtype)
    stage.to_empty(device=device)
    stage.rotary.materialize(device)
    skip: set[str] = set()
    if shared is not None:
        stage.rotary = shared.rotary
        if is_first:
            stage.embed_tokens = shared.embed_tokens
            skip.add("embed_tokens.weight")
        if is_last:
            stage.norm = shared.norm
            skip.add("norm.weight")
            if config.tie_word_embeddings:
                stage.lm_head.weight = shared.embed_tokens.weight
                skip.add("lm_head.weight")
    with torch.no_grad():
        for name, _ in stage.named_parameters(remove_duplicate=False):
            if name in skip:
                continue
            source = re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{layers.start + int(m.group(1))}.", name)
            if source == "lm_head.weight" and config.tie_word_embeddings:
                source = "embed_tokens.weight"
            for part, dest in part_views(stage, name).items():
                dest.copy_(read(source, part, None))
    return stage.eval().requires_grad_(False)


class PipelineModel(LayoutCounters, nn.Module):
    """One rank of a pipeline replica: its stage, and under Seesaw its TP shard of every layer."""

    def __init__(self, config: ModelConfig, stage: PipelineStage, stage_ranks: tuple[int, ...], rank: int,
                 tp: DecoderLM | None = None, tp_rank: int = 0, weights: str = "resident"):
        super().__init__()
        assert weights in ("resident", "host"), weights  # EngineArgs checked seesaw_weights
        self.config = config
        self.stage = stage
        self.tp = tp
        self.stage_ranks = stage_ranks
        self.stage_index = stage_ranks.index(rank)
        self.tp_rank = tp_rank
        self.weights = weights
        h_kv, pp = config.num_key_value_heads, len(stage_ranks)
        # the pool is allocated in the TP geometry when there is one (the PP view regroups it)
        self.num_kv_layers = config.num_hidden_layers if tp is not None else len(stage.layer_range)
        self.num_local_kv_heads = h_kv // pp if tp is not None else h_kv
        self.reset_counters()
        self.forwards: dict[str, object] = {}  # "pp" / "tp" -> compiled forward (compile_layouts)
        self.tp_decoder: ShardDecoder | None = None  # the TP layout's small steps in C++ (native_decode)
        self.activation_dtype = next(iter(stage.layers.parameters())).dtype  # activations between stages
        self._active = "pp"  # which set of layer weights the device holds ("host" weights)
        self._host_weights: dict[str, torch.Tensor] = {}  # "host" weights: a flat copy of each set
        if weights == "host":
            self._share_device_weights()

    # -- weights ----------------------------------------------------------------------------------------
    def _share_device_weights(self) -> None:
        """The layer weights of both layouts as views of one device buffer (the larger set's size), with
        a host copy of each set; the PP set is loaded."""
        assert self.tp is not None, "host copies switch between two layouts"
        sets = {"pp": list(self.stage.layers.parameters()), "tp": list(self.tp.layers.parameters())}
        size = max(sum(p.numel() for p in params) for params in sets.values())
        first = sets["pp"][0]
        self._device_weights = torch.empty(size, dtype=first.dtype, device=first.device)
        pin = first.device.type == "cuda"
        for kind, params in sets.items():
            host = torch.cat([p.detach().reshape(-1).cpu() for p in params])
            self._host_weights[kind] = host.pin_memory() if pin else host
            offset = 0
            for p in params:
                p.data = self._device_weights[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self._device_weights[:self._host_weights["pp"].numel()].copy_(self._host_weights["pp"])

    def activate(self, kind: str) -> None:
        """Make `kind`'s ("pp" or "tp") layer weights the ones on the device (a copy with host weights)."""
        if kind == self._active:
            return
        start = time.perf_counter()
        if self.weights == "host":
            host = self._host_weights[kind]
            self._device_weights[:host.numel()].copy_(host, non_blocking=True)
            if self._device_weights.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
        self._active = kind
        self.num_reshards += 1
        self.reshard_seconds += time.perf_counter() - start

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of weights this rank holds on its device and as host copies."""
        storages = {}
        for p in self.parameters():
            storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
        host = sum(t.untyped_storage().nbytes() for t in self._host_weights.values())
        return {"device": sum(storages.values()), "host": host}

    def prepare_weights(self, drop_dense: bool = True) -> int:
        """Pack both sets of layer weights for the machine's matmul (torch_shift.models.linear), unless they
        share one device buffer with host copies (`seesaw_weights="host"`), which switches swap."""
        if self.weights == "host":
            return 0
        return prepare_linears(self, drop_dense)

    # -- KV ---------------------------------------------------------------------------------------------
    def idle_in(self, layout: Layout, num_tokens: int) -> bool:
        return False

    def forward_steps(self, layout: Layout, batch: MicroBatch, run: Run) -> np.ndarray | None:
        """A multi-step run of Seesaw's TP layout in one call of its C++ decoder (a pipeline layout runs none:
        Scheduler._run_blocks)."""
        if layout.pp > 1 or self.tp_decoder is None:
            return None
        self.activate("tp")
        return self.run_steps_in_one_call(self.tp_decoder, layout, batch, run)

    def kv_region(self, layout: Layout) -> KVRegion:
        """What this rank's pool holds of the whole KV cache under `layout`."""
        config = self.config
        if layout.pp > 1:
            layers = self.stage.layer_range
            return KVRegion(layers.start, len(layers), 0, config.num_key_value_heads)
        per = config.num_key_value_heads // len(self.stage_ranks)
        return KVRegion(0, config.num_hidden_layers, self.tp_rank * per, per)

    # -- forward ----------------------------------------------------------------------------------------
    def compile_layouts(self) -> None:
        """Compile the stage's forward and the TP layout's (dynamic token count, attention as an opaque op)."""
        self.forwards = {"pp": CompiledForward(self.stage)}
        if self.tp is not None:
            self.forwards["tp"] = CompiledForward(self.tp)

    def seal_compiled(self) -> None:
        """After the start-up warm-up: the compiled forwards stop checking every guard (compilation.CompiledForward)."""
        seal(self.forwards.values())

    def native_decode(self) -> bool:
        """Run Seesaw's TP layout's steps of at most MAX_TOKENS tokens through one C++ call on each rank where its
        shards allow (torch_shift.models.native_decoder; resident weights, which are packed); whether they do. The
        pipeline's stages keep their forwards. After `prepare_weights`: it reads the packed weights."""
        self.tp_decoder = ShardDecoder.build(self.tp) if self.tp is not None and self.weights == "resident" else None
        if self.tp is not None:
            warn_where_decoders_differ({"tp": self.tp_decoder is not None}, shard_group(self.tp))
        return self.tp_decoder is not None

    def staged_check_tokens(self) -> int:
        return 0  # Seesaw's TP steps run their checks in one stage

    def forward_step(self, layout: Layout, micro_batches: list[MicroBatch]) -> torch.Tensor | None:
        """A step of `layout`: Seesaw's TP layout (every rank returns the logits, gathered over the
        vocabulary), or the pipeline over the micro-batches (the last stage returns the logits of all of
        them in order, the others None)."""
        self.layout_counts[layout.name] += 1
        with comm.recording(self.ledger), comm.layout_scope(layout.name):
            if layout.pp > 1:
                return self._pipeline(micro_batches)
            assert self.tp is not None, f"{layout.name}: this pipeline replica has no TP layout"
            self.activate("tp")
            (batch,) = micro_batches
            native = self.tp_decoder
            logits = (native.step(batch.input_ids, batch.positions, batch.logits_indices, batch.attention)
                      if native is not None else None)
            if logits is not None:
                return logits
            hidden = self.forwards.get("tp", self.tp)(batch.input_ids, batch.positions, batch.attention,
                                                      batch.logits_indices)
            return self.tp.compute_logits(hidden)

    def _pipeline(self, micro_batches: list[MicroBatch]) -> torch.Tensor | None:
        """Activations arriving from the stage before are all posted for at once; each micro-batch's output
        leaves for the next stage as soon as it is computed, while the next one is computed."""
        self.activate("pp")
        stage, index = self.stage, self.stage_index
        forward = self.forwards.get("pp", stage)
        first, last = index == 0, index == len(self.stage_ranks) - 1
        hidden_size = self.config.hidden_size
        dtype = self.activation_dtype
        received = []
        if not first:
            for m, batch in enumerate(micro_batches):
                buffer = torch.empty(batch.input_ids.shape[0], hidden_size, dtype=dtype, device=batch.input_ids.device)
                received.append((buffer, comm.irecv(buffer, self.stage_ranks[index - 1], _ACTIVATION_TAG + m)))
        sends, logits = [], []
        for m, batch in enumerate(micro_batches):
            if first:
                inputs = batch.input_ids
            else:
                inputs, work = received[m]
                work.wait()
            if last:
                hidden = forward(inputs, batch.positions, batch.attention, batch.logits_indices)
                logits.append(stage.lm_head(hidden))
            else:
                hidden = forward(inputs, batch.positions, batch.attention)
                sends.append(comm.isend(hidden, self.stage_ranks[index + 1], _ACTIVATION_TAG + m))
        for work in sends:
            work.wait()
        return torch.cat(logits) if last else None


def build_pipeline_model(deployment: Deployment, groups: DeploymentGroups, rank: int, config: ModelConfig,
                         read: TensorReader, dtype: torch.dtype, device: torch.device,
                         weights: str = "resident") -> PipelineModel:
    """This rank's stage of its replica (only its layers read) and, under Seesaw, its TP shards."""
    ranks = deployment.replicas[deployment.replica_of(rank)]
    index = ranks.index(rank)
    tp = None
    tp_rank = 0
    if any(layout.kind == "tp" for layout in deployment.layouts_of(rank)):  # Seesaw: the same ranks decode in TP
        tp = load_base(config, groups.replica, read, dtype, device)
        tp_rank = groups.replica.tp_rank
    stage = load_stage(config, stage_layers(config.num_hidden_layers, deployment.pp, index), index == 0,
                       index == deployment.pp - 1, read, dtype, device, shared=tp)
    return PipelineModel(config, stage, ranks, rank, tp, tp_rank, weights)
