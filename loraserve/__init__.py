"""loraserve: one base LLM, many LoRA adapters in one batch, outputs equal to Hugging Face PEFT."""

from loraserve.llm import LLM
from loraserve.lora.request import LoRARequest
from loraserve.outputs import CompletionOutput, Logprob, RequestOutput
from loraserve.sampling import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
