"""torch.compile for the model forward, with attention as one opaque custom op.

The step's attention (paged, and in the base layout wrapped in the Ulysses all-to-alls) depends
on per-step metadata: block tables, chunk boundaries, token counts. Passed into a compiled
function, every step would guard-fail and recompile. Instead the compiled graph calls the custom
op `torch_shift::attention(q, k, v, layer_idx, sinks, sliding_window)`, which runs the attention
object installed for the current step: the graph sees only tensors with a dynamic token dimension,
so changing batch sizes reuse one graph, one-token steps included. On the CPU the op's implementation is C++
where the step's attention is the paged kernel's, so a compiled decode step runs no Python from its first kernel
to its last (a forward of the 106M peer model 4-6% faster, docs/performance.md).
"""

from __future__ import annotations

import itertools
import logging
import types
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch

from torch_shift.custom_ops import custom_op
from torch_shift.kernels import native_attention, register_native_attention
from torch_shift.models.decoder import AttentionFn
from torch_shift.models.fused import register_native_operators

logger = logging.getLogger(__name__)
_current: list[AttentionFn] = []


def _run_step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                        sinks: torch.Tensor | None, sliding_window: int | None) -> torch.Tensor:
    extras = () if sinks is None and sliding_window is None else (sinks, sliding_window)
    return _current[-1](layer_idx, q, k, v, *extras)  # models without either: any 4-argument attention


# On the CPU its C++ implementation (kernels/cpu_ops.cpp, registered by the first compiled CPU forward) runs a step's
# paged attention kernel without Python, and calls the Python one under the name below for any other attention
# (the Ulysses all-to-alls around it, SDPA, a warm-up's zeros).
_attention_op = custom_op("torch_shift::attention")(_run_step_attention)
custom_op("torch_shift::attention_python")(_run_step_attention)


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, sinks: torch.Tensor | None,
      sliding_window: int | None) -> torch.Tensor:
    return torch.empty_like(q)  # every attention path returns q's shape (heads and tokens as given)


def attention_op(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """The `attention` argument a compiled forward receives."""
    return _attention_op(q, k, v, layer_idx, sinks, sliding_window)


_native_installed = False  # a step's paged attention is installed in the C++ implementation


def _install(attention: AttentionFn | None) -> bool:
    """Give the C++ implementation `attention` where it is the paged kernel's (CpuPagedAttention), else none; whether
    it was given."""
    global _native_installed
    install = getattr(attention, "install_native", None)
    if install is not None and install():
        _native_installed = True
        return True
    if _native_installed:
        native_attention().uninstall()
        _native_installed = False
    return False


def enter_step_attention(attention: AttentionFn) -> bool:
    """`attention` runs the step's attention op calls (the C++ implementation's where it is the paged kernel's)
    until the matching `exit_step_attention`; pairs nest. Whether the C++ implementation runs them."""
    _current.append(attention)
    return _install(attention)


def exit_step_attention() -> None:
    _current.pop()
    _install(_current[-1] if _current else None)


@contextmanager
def step_attention(attention: AttentionFn):
    enter_step_attention(attention)
    try:
        yield
    finally:
        exit_step_attention()


# The wrapper's checks of every tensor's size, stride and alignment: ~4% of a batch-1 decode step of an 8-layer model
# whose weights read in microseconds (docs/performance.md); the shapes are the engine's own.
_INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
# On the CPU the wrapper that calls the graph's kernels and operators is C++, not Python: a bf16 batch-1 decode step of
# the 106M peer model took 0.90x the time (14 alternating pairs in one process; docs/performance.md), for about 5 s
# more compile at start-up; at two ranks TP-2 was level and SP-2 faster (engines one after another). Not on GPUs,
# where CUDA graphs replay the decode steps (not measured there).
_CPU_INDUCTOR_OPTIONS = {**_INDUCTOR_OPTIONS, "cpp_wrapper": True}
# dynamo's settings while a forward compiles:
# - the model's float attributes (each RMSNorm's eps) as constants: unspecialised, each was a graph input made into a
#   float64 tensor at every call (17 in an 8-layer model);
# - no limit on a forward's compiled entries (one for each thread count it runs at): when every compiled forward of
#   a process added its own to the model class's code (engines built one after another in a notebook, a sweep or a
#   test suite; Flying's views), past dynamo's recompile_limit (8) a forward's warm-up ran eagerly, so that the ninth
#   engine of a process raised "Recompilation triggered" at its first sealed step (measured)
_DYNAMO_CONFIG = {"specialize_float": True, "recompile_limit": 1 << 30, "accumulated_recompile_limit": 1 << 30}


_forward_codes = itertools.count()


def _own_code(model: torch.nn.Module) -> Callable:
    """`model`'s call through a code object of its own, so that dynamo keeps this forward's graphs apart from every
    other's: it keeps a code object's graphs together and, sealed (`skip_guard_eval_unsafe`), tells them apart only
    by the guards that failed when one of them compiled. Through the model class's shared `forward`, a sealed call at
    a thread count this module never compiled for ran a graph another module compiled at it
    (tests/test_compile.py)."""
    def forward(*args):
        return model(*args)

    code = forward.__code__.replace(co_name=f"compiled_forward_{next(_forward_codes)}")
    return types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)


class CompiledForward:
    """`forward(input_ids, positions, attention[, logits_indices])` compiled with a dynamic token dimension; call it
    with the step's attention callable. Until `seal()` every call checks dynamo's guards (and compiles where they
    fail); after it, only the guards that tell this code's compiled graphs apart run (`skip_guard_eval_unsafe`), as
    vLLM's compiled forwards skip them: the full check of every parameter's shape and stride cost 0.2-0.35 ms a step
    (10% of a batch-1 decode step where the weights read in microseconds; docs/performance.md). The engine seals
    its forwards once its start-up warm-up has compiled them; tests/test_compile.py checks that serving never
    needs a graph the warm-up did not make."""

    def __init__(self, model: torch.nn.Module):
        tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
        on_cpu = tensor is None or tensor.device.type == "cpu"
        options = _CPU_INDUCTOR_OPTIONS if on_cpu else _INDUCTOR_OPTIONS
        if on_cpu:
            register_native_attention()
            register_native_operators()
        self._compiled = torch.compile(_own_code(model), dynamic=True, options=options)
        self.sealed = False
        self.guarded = False  # sealed, then a call matched none of its graphs: every guard runs, eager where none holds
        self._ran = False

    def seal(self) -> None:
        # a forward the warm-up never ran keeps its guards: sealed, it would have no graph to run
        self.sealed = self._ran

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                 logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        args = (input_ids, positions, attention_op) if logits_indices is None else (
            input_ids, positions, attention_op, logits_indices)
        with step_attention(attention):
            if self.sealed:
                try:
                    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                        return self._compiled(*args)
                except RuntimeError as e:  # raised as the frame starts, before any of it runs
                    if "skip_guard_eval_unsafe" not in str(e):
                        raise
                    self._unseal()
            if self.guarded:
                with torch.compiler.set_stance("eager_on_recompile"):
                    return self._compiled(*args)
            # an unbacked token count (and count of rows for the LM head): a one-token step reuses the graph
            # instead of specialising on size 1
            for tensor in args[:2] + args[3:]:
                torch._dynamo.decorators.mark_unbacked(tensor, 0)
            with torch._dynamo.config.patch(_DYNAMO_CONFIG):
                hidden = self._compiled(*args)
            self._ran = True
            return hidden

    def _unseal(self) -> None:
        """A sealed call matched none of its graphs: the user reset dynamo (`torch.compiler.reset()`) or changed
        what its guards read beyond what the engine sets for its steps (a default device, a torch function mode).
        From now on every guard runs (0.2-0.35 ms a step) and a step that no graph fits runs the forward eagerly,
        with the same results on the CPU, instead of compiling while serving."""
        logger.warning("a compiled forward's graphs no longer fit its calls (torch.compiler.reset(), or torch's "
                       "default device or function modes changed since the engine was built): such steps run the "
                       "forward eagerly from now on")
        self.sealed = False
        self.guarded = True


def seal(forwards: Iterable[Callable | None]) -> None:
    """Seal the CompiledForwards among `forwards` (a layout model's compiled and eager forwards)."""
    for forward in forwards:
        if isinstance(forward, CompiledForward):
            forward.seal()
