"""What scripts written for vLLM pass that has no effect here, and vLLM's beam-search results.

vLLM's engine options for memory, scheduling, logging or downloads are accepted where their value
asks for nothing fasterllama does differently (swap_space, disable_log_stats, kv_cache_dtype="auto"
...), and refused in one line where it would (kv_cache_dtype="fp8", enable_lora=True): a script
runs as it is, or says why it cannot."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from .errors import FasterLlamaError


def _any(_: Any) -> bool:
    return True


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


# option -> (the values taken, said in the error)
ENGINE_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "swap_space": (_any, "any"),  # (preempted sequences are recomputed here)
    "cpu_offload_gb": (_one_of(0, None), "0"),
    "disable_log_stats": (_any, "any"),
    "disable_custom_all_reduce": (_any, "any"),
    "enable_chunked_prefill": (_any, "any"),  # (prompts are chunked past max_num_batched_tokens: the same tokens)
    "max_seq_len_to_capture": (_any, "any"),
    "max_logprobs": (lambda v: v is None or (isinstance(v, int) and v <= 20), "at most 20 (logprobs are capped at 20 here)"),
    "kv_cache_dtype": (_one_of("auto", None), "'auto' (the model's dtype)"),
    "tokenizer_mode": (_one_of("auto", "hf", None), "'auto'"),
    "load_format": (_one_of("auto", "gguf", "safetensors", None), "'auto', 'gguf' or 'safetensors'"),
    "revision": (_one_of(None), "None (no hub: models are local files)"),
    "tokenizer_revision": (_one_of(None), "None"),
    "code_revision": (_one_of(None), "None"),
    "download_dir": (_one_of(None), "None (no hub: models are local files)"),
    "pipeline_parallel_size": (_one_of(1), "1 (tensor_parallel_size splits the model)"),
    "distributed_executor_backend": (_any, "any"),
    "enable_lora": (_one_of(False, None), "False"),
    "skip_tokenizer_init": (_one_of(False, None), "False"),
    "task": (_one_of("auto", "generate", None), "'auto' or 'generate'"),
    "runner": (_one_of("auto", "generate", None), "'auto' or 'generate'"),
    "served_model_name": (_any, "any"),
    "compilation_config": (_any, "any"),
}


def check_engine_options(options: dict[str, Any]) -> None:
    """vLLM's LLM(...) keywords with no effect here: taken, or one error naming what is not."""
    for name, value in options.items():
        if name not in ENGINE_OPTIONS:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        takes, allowed = ENGINE_OPTIONS[name]
        if not takes(value):
            raise FasterLlamaError(f"{name}={value!r} is not supported here (takes {allowed})")


def check_unused(name: str, value: Any, default: Any = None) -> None:
    """A vLLM call keyword fasterllama has no use for (lora_request...): only its default is taken."""
    if value != default:
        raise FasterLlamaError(f"{name}={value!r} is not supported (only {default!r})")


class TextPrompt(TypedDict):
    """vLLM's prompt dict of text (a plain dict does as well)."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's prompt dict of token ids (a plain dict does as well)."""

    prompt_token_ids: list[int]


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM returns it: tokens and text include the prompt's."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)  # (per-token logprobs are not kept by beam search here)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
