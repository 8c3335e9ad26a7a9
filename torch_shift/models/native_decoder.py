"""A dense decoder's steps of at most `MAX_TOKENS` tokens in one C++ call on the CPU (kernels/cpu_decoder.cpp).

An eager or compiled forward of a small step calls about ten kernels per layer, with the interpreter or inductor's
wrapper and PyTorch's dispatcher between them; after each weight streams through the caches that code runs cold.
`NativeDecoder` describes the model to the C++ decoder once (the addresses of its packed weights, norms, embedding
and rotary table) and runs each small step there: the embedding, every layer (RMSNorm, the q/k/v GEMV, the q/k norms
where the model has them, rotary, the step's paged attention, the output GEMV, the residual, the MLP) and the LM
head's rows. It calls the kernels the eager forward calls, in its order, and rounds SiLU as PyTorch does (checked on
this machine before it is used), so its logits are bitwise the eager forward's (tests/test_native_decoder.py). Where
the forward's packed linear runs oneDNN's matmul instead of the GEMV (bfloat16 packed for AMX above 5 rows where the
GEMV cannot use the tile unit), the decoder calls that operator's C++ implementation by the weight's handle
(cpu_ops.cpp's ts_packed_linear_rows).

It runs Llama, Mistral, Qwen2 and Qwen3 (decoder.py's DecoderLM) of float32 or bfloat16 on one rank, with every
linear weight packed for the GEMV kernel (AVX-512) or in torch_shift's 16-feature blocks (AVX2), or a rank's shard of
such a model in a tensor-parallel layout (`build(model, group, communicator)`: column shards of q/k/v and gate/up, row
shards of o and down whose partial outputs it sums through the group's shared-memory communicator as the forward's
all-reduce does, and a shard of the vocabulary in the LM head, whose logits it gathers through the same communicator
as the forward's all-gather does). Under sequence
parallelism (`head=False`) a rank runs its share of a step's tokens with Ulysses' all-to-alls inside each layer's
attention call and returns their final hidden states for the caller's LM head; a rank without tokens in a step runs
only each layer's attention for the others (`attend`). `NativeDecoder.build` returns None for anything else (experts,
attention sinks, a CPU without AVX2), which keeps its forward.

With asynchronous scheduling a step is launched instead (`launch`): it runs on a thread of the decoder's own while the
engine schedules and prepares the next step, and the engine's thread helps with its GEMVs once it waits for it
(`LaunchedStep.synchronize`). Its input ids may come from the argmax rows of the step launched before it, which the
decoder's thread reads when it starts the step (placeholders, as a GPU's step reads the last one's tokens on the GPU).
"""

from __future__ import annotations

import ctypes
import weakref
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from torch_shift.compilation import enter_step_attention, exit_step_attention
from torch_shift.kernels import DecoderKernels, decoder_kernels, native_attention, register_native_attention
from torch_shift.models.decoder import MLP, Attention, DecoderLayer, DecoderLM, RMSNorm
from torch_shift.models.fused import _DTYPE_CODES, _SPLIT_ROW, ROW_ARGMAX, _silu_lanes, _sum_lanes
from torch_shift.models.linear import Linear, gemv_rows
from torch_shift.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from torch_shift.engine.spec_decode.suffix import GlobalTree
    from torch_shift.parallel.runs import Run

# kernels/cpu_decoder.cpp's ModelField and LayerField
_MODEL_FIELDS = ("dtype", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "lanes", "positions",
                 "embed", "final_norm", "lm_head", "cos_sin", "silu_lanes", "blocked", "gemv_code", "max_tokens",
                 "communicator", "lm_head_rows", "gemv_rows", "lm_head_handle")
_LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "kv_layer", "window", "o", "o_bias",
                 "post_norm", "gate_up", "down", "qkv_handle", "o_handle", "gate_up_handle", "down_handle")


# the most tokens a step run here has (kernels/cpu_decoder.cpp's kMaxTokens): a decode step of up to that many
# requests, a check of proposed tokens, a short prompt's chunk
MAX_TOKENS = 64


class Stage(NamedTuple):
    """A stage of a redrafting check: its proposed and accepted tokens, and its seconds in the decoder (its draft's
    and its rows')."""

    proposed: int
    accepted: int
    seconds: float


class Redraft(ctypes.Structure):
    """kernels/cpu_decoder.cpp's Redraft: a batch-1 check whose stages after the first the C++ decoder drafts itself
    with suffix decoding's rule over the request's own tokens (`history`, up to the step's first input id) and, with
    `global_tree`, the outputs of earlier requests (the suffix proposer's GlobalTree with its index in C++, which the
    layout's first rank holds and passes as `tree`: rank 0's, or its copy, ModelRunner.suffix_global_tree), each
    stage's next input the token drawn after the proposals accepted (run_redrafting). `of` builds one;
    `redraft_stages(counts)` reads the stages it ran once the step ran."""

    _fields_ = [("history", ctypes.c_void_p), ("history_len", ctypes.c_int64), ("stop_ids", ctypes.c_void_p),
                ("num_stops", ctypes.c_int64), ("fresh_tokens", ctypes.c_int64), ("more_tokens", ctypes.c_int64),
                ("max_stages", ctypes.c_int64), ("max_depth", ctypes.c_int64),
                ("max_spec_factor", ctypes.c_double), ("min_token_prob", ctypes.c_double),
                ("global_tree", ctypes.c_int64), ("global_tokens", ctypes.c_void_p), ("global_size", ctypes.c_int64),
                ("global_index", ctypes.c_void_p), ("stage_counts", ctypes.c_void_p), ("limit", ctypes.c_void_p),
                ("interrupt", ctypes.c_void_p), ("run", ctypes.c_int64), ("leader", ctypes.c_int64)]

    @classmethod
    def of(cls, history: np.ndarray, stop_token_ids: np.ndarray, fresh_tokens: int, more_tokens: int,
           max_stages: int, max_depth: int, max_spec_factor: float, min_token_prob: float,
           global_tree: bool, tree: GlobalTree | None = None, run: Run | None = None) -> Redraft:
        """`run`: the words and number through which rank 0 ends the check after its current stage, as a multi-step
        run's (torch_shift.parallel.runs); None: nothing interrupts it."""
        history = np.ascontiguousarray(history, dtype=np.int64)
        stops = np.ascontiguousarray(stop_token_ids, dtype=np.int64)
        counts = np.zeros(redraft_counts_length(max_stages), dtype=np.int64)
        tokens = index = tokens_address = None
        size = 0
        if tree is not None:  # its outputs indexed now; read while the step runs, on the decoder's thread too
            assert global_tree and tree.native_index is not None
            index, tokens_address, size = tree.indexed().native_array
            tokens = tree.tokens
        redraft = cls(history.__array_interface__["data"][0], len(history), stops.__array_interface__["data"][0],
                      len(stops), fresh_tokens, more_tokens, max_stages, max_depth, max_spec_factor,
                      min_token_prob, int(global_tree), tokens_address, size, index,
                      counts.__array_interface__["data"][0], *(run.native_words() if run is not None else (0, 0, 0, 0)))
        # alive while the decoder may read or write them (the tree's array too: the tree grows into a new one, and
        # the tree, which frees its index)
        redraft._arrays = (history, stops, counts, tokens, tree)
        return redraft

    @property
    def counts(self) -> np.ndarray:
        """What the decoder writes of the stages it ran (int64 [1 + 3 max_stages]: `redraft_stages` reads it)."""
        return self._arrays[2]


def redraft_counts_length(max_stages: int) -> int:
    """The length of a check's `counts` (Redraft.counts) of up to `max_stages` stages: the stages run, then each one's
    proposed and accepted tokens and nanoseconds."""
    return 1 + 3 * max_stages


def redraft_stages(counts: np.ndarray) -> list[Stage]:
    """The stages a redrafting check ran, in order, from its Redraft's `counts` once the step ran (on the layout's
    logits rank, or received from it: ModelRunner); none where the decoder did not run the check (it declined the
    step, whose forward ran instead as a one-stage check)."""
    return [Stage(int(counts[1 + 3 * i]), int(counts[2 + 3 * i]), 1e-9 * int(counts[3 + 3 * i]))
            for i in range(int(counts[0]))]


class NativeDecoder:
    """`decoder(input_ids, positions, logits_indices, attention)` -> logits, for a step of 1 to `max_tokens` tokens
    whose attention is the CPU paged kernel's (`runs` says which steps)."""

    def __init__(self, model: DecoderLM, kernels: DecoderKernels, handle: int, max_tokens: int,
                 tensor_parallel: bool = False, head: bool = True, gathers_logits: bool = False):
        self.model = model  # keeps every weight the decoder reads alive
        self.kernels = kernels
        self.handle = handle
        # MAX_TOKENS; where a larger step's linears run oneDNN's matmul (bfloat16 on AMX without the tile unit's
        # GEMV), the decoder calls it as the eager forward does (the same bits), or takes no more than the GEMV's rows
        # where it cannot
        self.max_tokens = max_tokens
        self.dtype = model.embed_tokens.weight.dtype
        self.element_size = model.embed_tokens.weight.element_size()
        # the vocabulary, or this rank's shard of it; without the head, the hidden size (its rows' hidden states)
        self.logits_width = (model.config.vocab_size if gathers_logits else model.lm_head.packed.out_features if head
                             else model.config.hidden_size)
        self.tensor_parallel = tensor_parallel  # a rank's shard, which runs its steps with its peers
        self.gathers_logits = gathers_logits  # the shards of the vocabulary gathered in the call
        # each logits row's argmax found in the call (`ROW_ARGMAX`): where they are the vocabulary's
        self.finds_argmax = head and self.logits_width == model.config.vocab_size
        self.head = head
        # launched steps not yet waited for, in order: what they write and read stays alive until they ran
        self.launched: deque[LaunchedStep] = deque()
        weakref.finalize(self, _destroy, kernels, handle, self.launched)

    @classmethod
    def build(cls, model: torch.nn.Module, group: object | None = None, communicator: int | None = None,
              head: bool = True) -> NativeDecoder | None:
        """The decoder of `model`, or None where it cannot run it exactly (see the module's docstring). `group`: the
        process group over which `model` is a tensor-parallel rank's shard (its row-sharded o and down projections
        and its LM head name it as their `group`), whose all-reduces run through the shared-memory communicator
        `communicator` (torch_shift.parallel.comm.native_communicator; None for a group of one rank, which sums
        nothing). `head=False`: a step's result is its logits rows' final hidden states (after the model's last
        norm, as DecoderLM.forward returns them), the LM head left to the caller (a sequence-parallel rank's, whose
        rows are gathered first). An LM head sharded by vocabulary rows over `group` (VocabParallelLMHead) has its
        logits gathered in the call, as the forward's all-gather does."""
        kernels = decoder_kernels()
        alone = group is not None and group.size() == 1
        if (kernels is None or (group is not None and communicator is None and not alone)
                or not _supported(model, group, head) or not register_native_attention()):
            return None
        config = model.config
        dtype = model.embed_tokens.weight.dtype
        attn = model.layers[0].attn
        intermediate = model.layers[0].mlp.gate_up_proj.packed.out_features // 2
        silu_lanes = _silu_lanes(dtype, intermediate)
        blocked = model.lm_head.packed.blocked
        gemv_limit = gemv_rows(model)
        # more rows than the GEMV takes: oneDNN's matmul, reached through the operator library's weight handles
        registered = all(m.packed.native for m in model.modules() if getattr(m, "packed", None) is not None)
        max_tokens = MAX_TOKENS if blocked or registered else min(MAX_TOKENS, gemv_limit)
        if silu_lanes is None or gemv_limit < 1:
            return None
        model_fields = dict(
            dtype=_DTYPE_CODES[dtype], hidden=config.hidden_size, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
            head_dim=config.head_dim, intermediate=intermediate, vocab=config.vocab_size, lanes=_sum_lanes(),
            positions=model.rotary.cos_sin.shape[1], embed=model.embed_tokens.weight.data_ptr(),
            final_norm=model.norm.weight.data_ptr(), lm_head=_gemv_address(model.lm_head) if head else 0,
            cos_sin=model.rotary.cos_sin.data_ptr(), silu_lanes=silu_lanes, blocked=int(blocked),
            gemv_code=model.lm_head.packed.gemv_code, max_tokens=max_tokens,
            communicator=-1 if group is None or alone else communicator,
            lm_head_rows=model.lm_head.packed.out_features if head else config.hidden_size, gemv_rows=gemv_limit,
            lm_head_handle=model.lm_head.packed.handle if head else -1)
        layer_fields = []
        for layer in model.layers:
            attn = layer.attn
            layer_fields += [dict(
                input_norm=layer.input_norm.weight.data_ptr(), qkv=_gemv_address(attn.qkv_proj),
                qkv_bias=_address(attn.qkv_proj.bias),
                q_norm=_address(attn.q_norm.weight if attn.q_norm is not None else None),
                k_norm=_address(attn.k_norm.weight if attn.k_norm is not None else None), kv_layer=attn.layer_idx,
                window=-1 if attn.sliding_window is None else attn.sliding_window, o=_gemv_address(attn.o_proj),
                o_bias=_address(attn.o_proj.bias), post_norm=layer.post_attention_norm.weight.data_ptr(),
                gate_up=_gemv_address(layer.mlp.gate_up_proj), down=_gemv_address(layer.mlp.down_proj),
                qkv_handle=attn.qkv_proj.packed.handle, o_handle=attn.o_proj.packed.handle,
                gate_up_handle=layer.mlp.gate_up_proj.packed.handle, down_handle=layer.mlp.down_proj.packed.handle)]
        model_array = (ctypes.c_int64 * len(_MODEL_FIELDS))(*(model_fields[name] for name in _MODEL_FIELDS))
        layer_array = (ctypes.c_int64 * (len(_LAYER_FIELDS) * len(layer_fields)))(
            *(fields[name] for fields in layer_fields for name in _LAYER_FIELDS))
        handle = kernels.create(model_array, layer_array, len(layer_fields), config.rms_norm_eps)
        assert handle, "the C++ decoder refused a model the checks above accepted"
        # (kernels/cpu_decoder.cpp's Decoder::gathers_logits)
        gathers = head and model_fields["communicator"] >= 0 and model_fields["lm_head_rows"] != config.vocab_size
        return cls(model, kernels, handle, max_tokens, tensor_parallel=group is not None, head=head,
                   gathers_logits=gathers)

    def runs(self, num_tokens: int, attention: object) -> bool:
        """Whether a step of `num_tokens` tokens attending through `attention` runs here: its matmuls all run
        torch_shift's kernels as the eager forward's would (the GEMV, or the AVX2 blocks' kernel), and its attention
        is the CPU paged kernel's, which the C++ side reads once installed."""
        return (1 <= num_tokens <= self.max_tokens and hasattr(attention, "install_native")
                and native_attention() is not None)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
                 attention: object, first_stage: int = 0, redraft: Redraft | None = None) -> torch.Tensor | None:
        """The step's logits (or its logits rows' hidden states, `head=False`); None, nothing run, where `attention`
        did not install in C++ (the caller runs the step's forward instead). `first_stage`, `redraft`: a batch-1
        check in stages (`launch`'s)."""
        if self.launched:
            self.wait()
        input_ids, positions, rows = _int64(input_ids), _int64(positions), _int64(logits_indices)
        num_logits = rows.shape[0]
        logits = torch.empty(num_logits, self.logits_width, dtype=self.dtype)
        # (a shard's logits have no argmax of the vocabulary's unless gathered here, nor hidden states any; without
        # it a check runs in one stage)
        row_argmax = np.empty(num_logits, dtype=np.int64) if self.finds_argmax else None
        if row_argmax is None:
            first_stage, redraft = 0, None
        # not a context manager: its calls were 8% of a batch-1 step's Python
        if not enter_step_attention(attention):
            exit_step_attention()
            return None
        try:
            rc = self.kernels.step(self.handle, input_ids.data_ptr(), positions.data_ptr(), input_ids.shape[0],
                                   rows.data_ptr(), num_logits, logits.data_ptr(),
                                   None if row_argmax is None else row_argmax.__array_interface__["data"][0],
                                   first_stage, None if redraft is None else ctypes.addressof(redraft))
        finally:
            exit_step_attention()
        self._check(rc)
        if row_argmax is not None:
            setattr(logits, ROW_ARGMAX, row_argmax)
        return logits

    def steps(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, attention: object,
              run: Run) -> np.ndarray | None:
        """A multi-step run's decode steps in one call (ts_decoder_steps; decodes only, a logits row each): each row's
        token in each step (its argmax, or drawn with `run.draws`), int64 [steps run, rows], each fed to the next step
        as its row's input id, its position and KV slot moved on in `attention`'s arrays, which the C++ step reads
        (`advance_arrays`); `run.num_steps` of them, or fewer where the run ends early (a stop token drawn, rank 0's
        interrupt); None, nothing run, where the decoder finds no argmax (a shard's vocabulary, no head) or
        `attention` cannot move on or did not install in C++."""
        advance = getattr(attention, "advance_arrays", None)
        if not self.finds_argmax or advance is None:
            return None
        if self.launched:
            self.wait()
        input_ids, positions, rows = _int64(input_ids), _int64(positions), _int64(logits_indices)
        num_tokens = input_ids.shape[0]
        assert rows.shape[0] == num_tokens, "a run's steps are decodes, a logits row each"
        logits = torch.empty(num_tokens, self.logits_width, dtype=self.dtype)
        row_argmax = np.empty(num_tokens, dtype=np.int64)
        drawn = np.empty((run.num_steps, num_tokens), dtype=np.int64)
        if not enter_step_attention(attention):
            exit_step_attention()
            return None
        try:
            rc = self.kernels.steps(self.handle, input_ids.data_ptr(), positions.data_ptr(), num_tokens,
                                    rows.data_ptr(), logits.data_ptr(), row_argmax.ctypes.data, run.num_steps,
                                    drawn.ctypes.data, *advance(), *run.native_args(num_tokens))
        finally:
            exit_step_attention()
        if rc < 0:
            self._check(rc)
        return drawn[:rc]

    def attend(self, attention: object) -> bool:
        """A sequence-parallel rank's part in a step that gives it no tokens: each layer's attention of its head chunk
        over the other ranks' tokens, which `attention` (a UlyssesAttention) exchanges, in one call; False, nothing
        run, where `attention` did not install in C++."""
        if self.launched:
            self.wait()
        try:
            if not enter_step_attention(attention):
                return False
            rc = self.kernels.attend(self.handle)
        finally:
            exit_step_attention()
        self._check(rc)
        return True

    def launch(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
               attention: object, placeholders: tuple[np.ndarray, np.ndarray] | None = None,
               draws: np.ndarray | None = None, first_stage: int = 0,
               redraft: Redraft | None = None) -> tuple[torch.Tensor, LaunchedStep]:
        """The step of `__call__`, launched on the decoder's thread after those launched before it: its logits
        (and their rows' argmax, `ROW_ARGMAX`), written once the returned step ran, and that step. `placeholders`:
        (indices of input ids, rows of the last launched step's logits) whose tokens those ids take. `draws`
        (Sampler.draws: float32 [5, logits rows]): each row's token is drawn with them (models.fused.sample_rows)
        instead of its argmax, into the step's `row_argmax`. `first_stage` (> 0): a batch-1 check of proposed tokens,
        every token a logits row, run in two stages: the rows after its first `first_stage` only where each of those
        drew the next input id (the proposals they check all accepted); else those rows are not run, their argmax -1
        (cpu_decoder.cpp's run_in_stages). `redraft` (with `first_stage`): the stages after the first are drafted by
        the decoder, each after the token its last drew (run_redrafting): the rows that end up drawn hold those
        tokens, each the next's input, and -1 after them."""
        assert not self.tensor_parallel and self.head, "a parallel rank's steps run in step with its peers"
        input_ids, positions, rows = _int64(input_ids), _int64(positions), _int64(logits_indices)
        num_logits = rows.shape[0]
        logits = torch.empty(num_logits, self.logits_width, dtype=self.dtype)
        row_argmax = np.empty(num_logits, dtype=np.int64)
        if placeholders is None:  # a check's, a synchronous step's: no array calls (10-20 us each, cold)
            index_address = sources_address = None
            num_placeholders = 0
        else:
            index, sources = (np.ascontiguousarray(a, np.int64) for a in placeholders)
            index_address, sources_address, num_placeholders = index.ctypes.data, sources.ctypes.data, len(index)
        if draws is not None:
            assert draws.dtype == np.float32 and draws.shape == (5, num_logits) and draws.flags.c_contiguous
        try:
            installed = enter_step_attention(attention)  # copied by the launch
            assert installed, "a launched step's attention runs in C++ (runs() took it)"
            ticket = self.kernels.launch(self.handle, input_ids.data_ptr(), positions.data_ptr(), input_ids.shape[0],
                                         rows.data_ptr(), num_logits, logits.data_ptr(), row_argmax.ctypes.data,
                                         index_address, sources_address, num_placeholders,
                                         None if draws is None else draws.ctypes.data, first_stage,
                                         None if redraft is None else ctypes.addressof(redraft))
        finally:
            exit_step_attention()
        if ticket == -203:
            raise RuntimeError("the system refused the C++ decoder's thread")
        assert ticket > 0, f"the C++ decoder refused a launch ({ticket})"
        if draws is None:  # rows drawn otherwise are not their argmax
            setattr(logits, ROW_ARGMAX, row_argmax)
        step = LaunchedStep(self, ticket, logits, row_argmax, attention, draws, redraft)
        self.launched.append(step)
        return logits, step

    def wait(self, until: LaunchedStep | None = None) -> None:
        """Wait for the launched steps up to `until` (None: all of them), in order, helping with their GEMVs; raises
        the first one's error."""
        last = until.ticket if until is not None else self.launched[-1].ticket if self.launched else 0
        while self.launched and self.launched[0].ticket <= last:
            step = self.launched.popleft()
            step.done = True
            self._check(self.kernels.wait(self.handle, step.ticket))

    def _check(self, rc: int) -> None:
        if rc == -300:  # the peers' error, raised by the communicator's wait (a rank died or stalled), or Ulysses' own
            raise RuntimeError(self.kernels.collective_error())
        if rc == -201:
            raise IndexError("a token id outside the vocabulary, or a logits row outside the step")
        if rc == -3:
            raise IndexError(f"a position is outside the rotary table of {self.model.rotary.cos_sin.shape[1]} "
                             "positions")
        assert rc == 0, f"the C++ decoder failed ({rc})"


class LaunchedStep:
    """A step running on the C++ decoder's thread (`NativeDecoder.launch`): `synchronize` waits for it (as a CUDA
    event's does for a GPU's step)."""

    def __init__(self, decoder: NativeDecoder, ticket: int, logits: torch.Tensor, row_argmax: np.ndarray,
                 attention: object, draws: np.ndarray | None = None, redraft: Redraft | None = None):
        self.decoder = weakref.ref(decoder)  # a decoder gone waited for its steps (_destroy)
        self.ticket = ticket
        self.logits = logits
        self.row_argmax = row_argmax  # each row's token: its argmax, or drawn with `draws`
        self.draws = draws
        self.attention = attention  # keeps the KV cache it writes alive
        self.redraft = redraft  # and the stage counts it writes
        self.done = False

    def synchronize(self) -> None:
        decoder = self.decoder()
        if not self.done and decoder is not None:
            decoder.wait(self)




def _destroy(kernels: DecoderKernels, handle: int, launched: deque) -> None:
    kernels.destroy(handle)  # its thread ends after the steps launched
    launched.clear()


def _int64(t: torch.Tensor) -> torch.Tensor:
    """`t` as contiguous int64; the runner's already are, and checking costs less than a call that finds nothing to
    do."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def _supported(model: torch.nn.Module, group: object | None = None, head: bool = True) -> bool:
    if type(model) is not DecoderLM:
        return False
    config = model.config
    embed = model.embed_tokens.weight
    dtype, eps = embed.dtype, config.rms_norm_eps
    packed = getattr(model.lm_head, "packed", None)
    layout = (packed.blocked, packed.gemv_code) if packed is not None else None  # every weight alike, checked below
    if (embed.device.type != "cpu" or dtype not in _DTYPE_CODES or not embed.is_contiguous()
            or embed.shape[0] != config.vocab_size or config.sparse_layers or config.attention_sinks
            or config.gemma_norms or config.embed_scale is not None or config.local_rope is not None
            or config.query_scale is not None
            or config.head_dim % 2 or max(config.hidden_size, config.head_dim) >= _SPLIT_ROW or _sum_lanes() is None
            or type(model.rotary) is not RotaryEmbedding or model.rotary.cos_sin.dtype != torch.float32
            or not model.rotary.cos_sin.is_contiguous() or not _norm_ok(model.norm, dtype, eps)
            or (head and not _gemv_ok(model.lm_head, dtype, layout, bias=False, group=group))):
        return False
    # a rank's shard attends its heads and holds its share of the MLP's neurons: the same in every layer
    heads, kv_heads = ((config.num_attention_heads, config.num_key_value_heads) if group is None else
                       (model.layers[0].attn.num_heads, model.layers[0].attn.num_kv_heads))
    first_down = getattr(getattr(model.layers[0].mlp, "down_proj", None), "packed", None)
    if group is not None and first_down is None:  # not packed (views of another layout's weights)
        return False
    intermediate = config.intermediate_size if group is None else first_down.in_features
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        if (type(layer) is not DecoderLayer or type(attn) is not Attention or type(mlp) is not MLP
                or attn.sinks is not None or not _norm_ok(layer.input_norm, dtype, eps)
                or not _norm_ok(layer.post_attention_norm, dtype, eps)
                or (attn.q_norm is not None
                    and not (_norm_ok(attn.q_norm, dtype, eps) and _norm_ok(attn.k_norm, dtype, eps)))
                or not _gemv_ok(attn.qkv_proj, dtype, layout, bias=True)
                or not _gemv_ok(attn.o_proj, dtype, layout, bias=group is None, group=group, reduced=True)
                or not _gemv_ok(mlp.gate_up_proj, dtype, layout, bias=False)
                or not _gemv_ok(mlp.down_proj, dtype, layout, bias=False, group=group, reduced=True)
                or (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (heads, kv_heads, config.head_dim)
                or attn.qkv_proj.packed.out_features != (heads + 2 * kv_heads) * config.head_dim
                or mlp.gate_up_proj.packed.out_features != 2 * intermediate
                or mlp.down_proj.packed.in_features != intermediate):
            return False
    return True


def _norm_ok(norm: torch.nn.Module, dtype: torch.dtype, eps: float) -> bool:
    return type(norm) is RMSNorm and norm.weight.dtype == dtype and norm.weight.is_contiguous() and norm.eps == eps


def _gemv_ok(linear: torch.nn.Module, dtype: torch.dtype, layout: tuple[bool, int] | None, bias: bool,
             group: object | None = None, reduced: bool = False) -> bool:
    """Whether the decoder runs `linear` as the forward does: its weight packed for the GEMV on oneDNN's layout, or
    in the 16-feature blocks, `layout` (blocked, the kernel's code) as every other weight of the model. With `group`,
    also a rank's shard whose outputs the forward sums or gathers over `group` (torch_shift.parallel.layers'
    RowParallelLinear and VocabParallelLMHead name it), without a bias; with `reduced` too, only such a shard (the o
    and down projections, whose outputs the decoder all-reduces)."""
    packed = getattr(linear, "packed", None)
    sharded = group is not None and getattr(linear, "group", None) is group and getattr(linear, "bias", None) is None
    plain = type(linear) is Linear and not (reduced and group is not None)
    return ((plain or sharded) and packed is not None and packed.gemv is not None
            and packed.dtype == dtype and (packed.blocked, packed.gemv_code) == layout and packed.native
            and (getattr(linear, "bias", None) is None
                 or (bias and linear.bias.dtype == dtype and linear.bias.is_contiguous())))


def _gemv_address(linear: Linear) -> int:
    return linear.packed._weight_ptr


def _address(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


