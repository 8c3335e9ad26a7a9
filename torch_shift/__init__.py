"""torch_shift: PyTorch-native LLM inference that changes its parallel layout while it serves."""

from torch_shift.engine import LLM, CompletionOutput, EngineArgs, LLMEngine, Logprob, RequestOutput, SamplingParams
from torch_shift.handoff import handoff, handoff_from_dcp
from torch_shift.parallel import ShiftModule, parallelize

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "Logprob", "RequestOutput", "SamplingParams",
           "ShiftModule", "handoff", "handoff_from_dcp", "parallelize"]
