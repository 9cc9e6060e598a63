"""fasterllama: a fast, hackable inference engine for LLaMA-family models.

The API names load on first use, so `fasterllama --help` answers without importing torch."""

from .errors import FasterLlamaError

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "FasterLlamaError", "StructuredOutputsParams",
           "GuidedDecodingParams", "BeamSearchParams", "TextPrompt", "TokensPrompt"]
__version__ = "0.1.0"

_LAZY = {"LLM": "llm", "RequestOutput": "llm", "CompletionOutput": "llm", "Logprob": "engine.sequence", "SamplingParams": "sampling_params",
         "StructuredOutputsParams": "sampling_params", "GuidedDecodingParams": "sampling_params", "BeamSearchParams": "sampling_params",
         "TextPrompt": "vllm_compat", "TokensPrompt": "vllm_compat"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
