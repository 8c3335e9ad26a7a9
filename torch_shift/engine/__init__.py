from torch_shift.engine.args import EngineArgs
from torch_shift.engine.llm import LLM
from torch_shift.engine.llm_engine import LLMEngine
from torch_shift.engine.outputs import CompletionOutput, Logprob, RequestOutput
from torch_shift.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "Logprob", "RequestOutput", "SamplingParams"]
