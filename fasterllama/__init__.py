"""fasterllama: a fast, hackable inference engine for LLaMA-family models."""

from .errors import FasterLlamaError
from .llm import LLM, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "FasterLlamaError"]
__version__ = "0.1.0"
