"""vlserve: serving engine for vision-language models (Qwen2-VL, Qwen2.5-VL)."""

from vlserve.entrypoints.llm import LLM
from vlserve.outputs import CompletionOutput, RequestOutput
from vlserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
