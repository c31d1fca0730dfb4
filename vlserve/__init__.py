"""vlserve: serving engine for vision-language models (Qwen2-VL, Qwen2.5-VL).

`import vlserve` stays light: `LLM` (and with it torch) is imported on first use.
"""

from vlserve.core.lora import LoRARequest
from vlserve.core.outputs import CompletionOutput, RequestOutput
from vlserve.core.sampling_params import SamplingParams
from vlserve.core.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        import sys

        if "torch" not in sys.modules:  # OpenMP reads how its threads wait when torch loads it: as the CLI does
            from vlserve.core.cpu_budget import short_spin_waits

            short_spin_waits()
        from vlserve.frontend.llm import LLM

        return LLM
    raise AttributeError(f"module 'vlserve' has no attribute {name!r}")
