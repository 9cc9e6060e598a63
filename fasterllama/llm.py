"""LLM: the offline Python API over LLMEngine (vLLM's spellings): prompts and chat messages
checked and rendered, sampling parameters per prompt, beam search, results as RequestOutputs."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from numbers import Number
from typing import Any

import numpy as np
import torch

from .conversation import chat_prompt_ids
from .engine.beam_search import BeamSearch
from .engine.llm_engine import LLMEngine, resolve_device
from .engine.sequence import Logprob, Sequence
from .errors import FasterLlamaError
from .sampling_params import BeamSearchParams, SamplingParams
from .tokenizer import Tokenizer
from .vllm_compat import BeamSearchOutput, BeamSearchSequence, check_engine_options, check_unused

Prompt = str | list[int]



def _kind(value: object) -> str:
    """A value's type for an error message ('None' rather than 'NoneType')."""
    return "None" if value is None else type(value).__name__


def _is_scalar(value: object) -> bool:
    """A number (Python, numpy or 0-d torch): an element of a token-id prompt, not a prompt."""
    return isinstance(value, (Number, np.generic)) or (isinstance(value, torch.Tensor) and value.ndim == 0)


def prompt_list(prompts: object) -> list[Prompt]:
    """One prompt or a list of prompts as a list of prompts, refusing anything else with one error.

    Without this a dict generated from its keys, None/int/bytes raised raw TypeErrors, and a list
    mixing strings and ids failed deep inside; token ids themselves are checked by the engine."""
    if isinstance(prompts, dict):  # vLLM's TextPrompt / TokensPrompt
        return [_prompt_of_dict(prompts, "the prompt")]
    if isinstance(prompts, str) or (isinstance(prompts, (torch.Tensor, np.ndarray)) and prompts.ndim == 1):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and any(isinstance(p, dict) for p in prompts):
        prompts = [_prompt_of_dict(p, f"prompt {i}") if isinstance(p, dict) else p for i, p in enumerate(prompts)]
    if not isinstance(prompts, (list, tuple)):
        hint = " (decode bytes to a string first)" if isinstance(prompts, (bytes, bytearray)) else ""
        raise FasterLlamaError(f"prompts must be a string, a list of token ids, or a list of those; got {_kind(prompts)}{hint}")
    has_text = any(isinstance(p, str) for p in prompts)
    if any(_is_scalar(p) for p in prompts):
        if has_text or any(isinstance(p, (list, tuple, torch.Tensor, np.ndarray)) and not _is_scalar(p) for p in prompts):
            raise FasterLlamaError("the prompts mix token ids with strings or lists: pass a string, a list of token ids, "
                                   "or a list of prompts that are each a string or a list of token ids")
        return [list(prompts)]  # one token-id prompt
    for i, p in enumerate(prompts):
        if not (isinstance(p, (str, list, tuple)) or (isinstance(p, (torch.Tensor, np.ndarray)) and p.ndim == 1)):
            hint = " (decode bytes to a string first)" if isinstance(p, (bytes, bytearray)) else ""
            raise FasterLlamaError(f"prompt {i} must be a string or a list of token ids, got {_kind(p)}{hint}")
    return list(prompts)


def _prompt_of_dict(prompt: dict, what: str) -> Prompt:
    """vLLM's {"prompt": text} or {"prompt_token_ids": ids} as a prompt (its other keys taken only
    unset, and cache_salt, which only keeps users' cached prefixes apart)."""
    prompt = {k: v for k, v in prompt.items() if v is not None and k != "cache_salt"}
    keys = set(prompt) & {"prompt", "prompt_token_ids"}
    if len(keys) != 1 or set(prompt) - {"prompt", "prompt_token_ids"}:
        raise FasterLlamaError(f"{what} as a dict must be {{'prompt': text}} or {{'prompt_token_ids': [ids]}} "
                               f"(no other keys), got the keys {sorted(map(str, prompt))}")
    return prompt[keys.pop()]


def _either(params: object, sampling_params: object) -> Any:
    """params, or vLLM's name for it, sampling_params (not both)."""
    if params is not None and sampling_params is not None:
        raise FasterLlamaError("give params or sampling_params, not both")
    return params if sampling_params is None else sampling_params


@dataclass
class CompletionOutput:
    """One generated continuation (one of `n` samples, or one beam)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None: EOS, length)

    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_sequence(cls, index: int, seq: Sequence) -> CompletionOutput:
        asked = seq.params.logprobs is not None
        return cls(index, seq.text, list(seq.output_token_ids), seq.cumulative_logprob if asked else None,
                   seq.logprobs if asked else None, seq.finish_reason, seq.stop_reason)


@dataclass
class RequestOutput:
    """All continuations of one prompt; `.text`, `.token_ids`, ... are those of the first (best)."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    request_id: str = ""
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache instead of being computed

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs

    @property
    def cumulative_logprob(self) -> float | None:
        return self.outputs[0].cumulative_logprob

    @classmethod
    def from_sequences(cls, prompt: Prompt, seqs: list[Sequence]) -> RequestOutput:
        return cls(
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=seqs[0].prompt_token_ids,
            outputs=[CompletionOutput.from_sequence(i, s) for i, s in enumerate(seqs)],
            prompt_logprobs=seqs[0].prompt_logprobs,
            request_id=str(seqs[0].seq_id),
            finished=all(s.is_finished for s in seqs),
            num_cached_tokens=seqs[0].num_prefix_cached,
        )


class TextStream:
    """One request's text deltas, produced by stepping the engine as they are read; `output`
    (a RequestOutput) is set when the iteration ends, or is abandoned (then finish_reason abort).
    Each delta is the text the sequence has settled since the last one, whoever stepped the engine
    meanwhile (another stream, generate, compute_logits)."""

    def __init__(self, engine: LLMEngine, prompt: Prompt, seq: Sequence, lock: threading.RLock | None = None) -> None:
        self.engine, self.prompt, self.seq = engine, prompt, seq
        self.lock = lock or threading.RLock()  # (the LLM's: threads take turns stepping its engine)
        self.output: RequestOutput | None = None
        self.shown = 0  # characters of the text yielded (a second iteration goes on from there)
        self.queued = False

    def __iter__(self) -> Iterator[str]:
        if not self.queued:  # queued when first read: a stream never read costs nothing
            with self.lock:
                self.engine.scheduler.add(self.seq)
            self.queued = True
        try:
            while True:
                settled = self.seq.num_emitted  # (the engine's end of the text that cannot change any more)
                if settled > self.shown:
                    yield self.seq.text[self.shown : settled]
                    self.shown = settled
                    continue  # (others may have stepped the engine meanwhile)
                if self.seq.is_finished:
                    break
                with self.lock:
                    self.engine.step()
        finally:
            with self.lock:
                self.engine.abort(self.seq)
            self.output = RequestOutput.from_sequences(self.prompt, [self.seq])
        if self.seq.error is not None:
            raise FasterLlamaError(self.seq.error)


class LLM:
    """`LLM(model=None)` loads the default model; `generate`, `chat`, `compute_logits`."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | None = None,
        quantization: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 2048,
        progress: bool = True,
        calibration_text: str | None = None,
        kv_cache_memory: float | str | None = None,
        block_size: int | None = None,
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        speculative_config: dict | str | None = None,
        seed: int | None = None,
        gpu_memory_utilization: float | None = None,
        enforce_eager: bool = False,
        trust_remote_code: bool = False,
        tokenizer: str | None = None,
        **vllm_options: Any,
    ) -> None:
        """quantization: None (the default: a GGUF file on the CPU in fp32 keeps its Q4_0..Q8_0 / Q2_K..Q6_K
        tensors as they are, "gguf", and every other checkpoint loads as float), "none" (float
        weights, dequantizing a GGUF file), "gguf", or a spec such as "w8", "w8-g32", "w4", "w4-g64",
        "w8a8", "w8a8-static-mse", "w8a8-static-percentile99.99-sq0.5" (see fasterllama.quant.config).
        "gguf" is exact: its kernels expand each block to the very floats "none" holds.
        "gguf-a8": "gguf", and every product rounds activations to int8 per chunk of 32 as
        llama.cpp's dot products do (on CUDA the decode GEMVs' integer dot products too): on the
        CPU prompts 2.2-2.7x the multiplies a second (AVX-512 VNNI),
        decode steps up to ~1.2x (AVX2: 4 and 6 bits; 5-bit lanes about even); logits a few % from
        exact (the default model: up to ~1.8 on a scale of ~30), decode log-probabilities up to ~0.2.
        kv_cache_memory: the paged KV cache's size, bytes (an int, "2GiB") or a fraction of free
        memory (0.5); by default up to 2 GiB on the CPU and 0.8 of the free memory of a GPU.
        tensor_parallel_size: split the model over this many processes (spawned: a script that
        makes such an LLM needs the `if __name__ == "__main__":` guard).
        speculative_config: speculative decoding, as vLLM's: {"method": "ngram",
        "num_speculative_tokens": 4} drafts from the prompt, {"method": "draft_model", "model": PATH,
        "num_speculative_tokens": 4} with a smaller model of the same tokenizer; outputs stay the
        model's (greedy ones identical), only faster when the drafts are right.
        seed: requests without a seed draw theirs from a generator of this seed (vLLM's), so a
        script's sampled outputs repeat from run to run.
        gpu_memory_utilization: vLLM's knob, on a GPU the share of its free memory (after the
        weights) the KV cache takes where kv_cache_memory is not given; a CPU has no GPU memory
        to share, and keeps its kv_cache_memory default.
        enforce_eager: vLLM's, no CUDA graphs (decode steps launch kernel by kernel; the CPU is unchanged).
        trust_remote_code: vLLM's, accepted for its scripts: fasterllama runs no code from a model folder.
        tokenizer: another tokenizer, a local HF folder (vLLM's; by default the model's own).
        vllm_options: vLLM's engine options with no effect here (vllm_compat.py: swap_space,
        disable_log_stats, kv_cache_dtype="auto"...); a value that would change anything is refused."""
        if not isinstance(trust_remote_code, bool):
            raise FasterLlamaError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
        check_engine_options(vllm_options)
        own_tokenizer = None
        if tokenizer is not None:
            if not isinstance(tokenizer, str) or not os.path.isdir(tokenizer):
                raise FasterLlamaError(f"tokenizer={tokenizer!r}: not a local folder (fasterllama never downloads; "
                                       "leave it out to use the model's own tokenizer)")
            own_tokenizer = Tokenizer.from_folder(tokenizer)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise FasterLlamaError(f"seed must be an integer or None, got {_kind(seed)}")
        if gpu_memory_utilization is not None:
            if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
                raise FasterLlamaError(f"gpu_memory_utilization must be a number in (0, 1], got {gpu_memory_utilization!r}")
            if kv_cache_memory is None and resolve_device(device).type == "cuda":
                kv_cache_memory = float(gpu_memory_utilization)
        self.engine = LLMEngine(
            model,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory=kv_cache_memory,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            progress=progress,
            quantization=quantization,
            calibration_text=calibration_text,
            tensor_parallel_size=tensor_parallel_size,
            speculative_config=speculative_config,
            enforce_eager=enforce_eager,
        )
        if own_tokenizer is not None:
            self.engine.use_tokenizer(own_tokenizer)
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config
        self._lock = threading.RLock()  # one caller steps the engine at a time (threads take turns)
        if seed is not None:
            self.engine.rng.seed(seed)

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name; also `llm.engine`)."""
        return self.engine

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        *,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: None = None,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or vLLM's {"prompt": ...} /
        {"prompt_token_ids": ...}); one output per prompt. sampling_params: vLLM's name for params;
        use_tqdm: a progress bar of the prompts done (a callable: what makes the bar, tqdm's
        arguments, as vLLM takes it). Calls from several threads take turns.
        (lora_request and priority: vLLM's, taken at their defaults.)"""
        check_unused("lora_request", lora_request)
        check_unused("priority", None if priority is None or not any(priority) else priority)
        with self._lock:
            return self._generate(prompts, _either(params, sampling_params), use_tqdm)

    def _generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None,
                  use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        prompts = prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or self.engine.default_params] * len(prompts)
        elif isinstance(params, (list, tuple)):
            params_list = list(params)
            bad = [_kind(p) for p in params_list if not isinstance(p, SamplingParams)]
            if bad:
                raise FasterLlamaError(f"params must be a SamplingParams or a list of them, got a list holding {bad[0]}")
            if len(params_list) != len(prompts):
                raise FasterLlamaError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        else:
            raise FasterLlamaError(f"params must be a SamplingParams, a list of them, or None; got {_kind(params)}")
        engine = self.engine
        prompt_ids = []  # every prompt checked before any work
        for i, p in enumerate(prompts):
            try:
                prompt_ids.append(engine.encode_prompt(p, params_list[i].truncate_prompt_tokens))
            except FasterLlamaError as e:  # (of several prompts, which one)
                raise e if len(prompts) == 1 else type(e)(f"prompt {i} of {len(prompts)}: {e}") from None
        results: dict[int, RequestOutput] = {}
        beam_groups: dict[int, list[int]] = {}  # prompts sharing one beam-search params object run batched
        for i, p in enumerate(params_list):
            if p.beam_width > 1:
                beam_groups.setdefault(id(p), []).append(i)
        for idx in beam_groups.values():
            outs = self._beam_search([prompts[i] for i in idx], [prompt_ids[i] for i in idx], params_list[idx[0]])
            for i, out in zip(idx, outs):
                results[i] = out
        groups: dict[int, list[Sequence]] = {}
        bar = None
        try:
            for i, (ids, p) in enumerate(zip(prompt_ids, params_list)):
                if p.beam_width == 1:
                    groups[i] = engine.add_group(ids, p)
            if use_tqdm:
                from tqdm import tqdm

                make_bar = use_tqdm if callable(use_tqdm) else tqdm
                bar = make_bar(total=len(prompts), initial=len(results), desc="Processed prompts", unit="prompt")
            while engine.has_unfinished():
                engine.step()
                if bar is not None:
                    bar.update(len(results) + sum(all(s.is_finished for s in g) for g in groups.values()) - bar.n)
        except BaseException:
            for seq in (s for g in groups.values() for s in g):
                engine.abort(seq)
            raise
        finally:
            if bar is not None:
                bar.close()
        failed = [(i, s.error) for i, g in groups.items() for s in g if s.error is not None]
        if failed:  # (a constraint that failed on the way: the others ran to their ends)
            i, error = failed[0]
            raise FasterLlamaError(error if len(prompts) == 1 else f"prompt {i} of {len(prompts)}: {error}")
        for i, g in groups.items():
            results[i] = RequestOutput.from_sequences(prompts[i], g)
        return [results[i] for i in range(len(prompts))]

    def _beam_search(self, prompts: list[Prompt], ids: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        outs = []
        for prompt, prompt_ids, beams in zip(prompts, ids, BeamSearch(self.engine).run(ids, params)):
            outputs = [CompletionOutput(k, b.text, b.token_ids, b.cumulative_logprob, None, b.finish_reason, b.stop_reason) for k, b in enumerate(beams)]
            outs.append(RequestOutput(prompt if isinstance(prompt, str) else None, prompt_ids, outputs, request_id=f"beam-{uuid.uuid4().hex[:16]}"))
        return outs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, sampling_params: SamplingParams | None = None) -> TextStream:
        """Generate for one prompt: iterate the result for text deltas as they become printable;
        its `output` is the RequestOutput once the iteration has ended."""
        params = _either(params, sampling_params)
        batch = prompt_list(prompt)
        if len(batch) != 1:
            raise FasterLlamaError(f"stream takes one prompt (a string or a list of token ids), got {len(batch)} prompts")
        if params is not None and isinstance(params, SamplingParams) and (params.n > 1 or params.beam_width > 1):
            raise FasterLlamaError("stream yields one sequence's text: n must be 1 and beam search does not stream (use generate)")
        return TextStream(self.engine, batch[0], self.engine.new_sequence(batch[0], params), self._lock)

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None,
                    *, chat_template: str | None = None, continue_final_message: bool = False, tools: list[Any] | None = None,
                    chat_template_content_format: str = "auto") -> list[int]:
        """Token ids of one conversation rendered by the model's chat template, or `chat_template`
        (conversation.py: as the server renders it). chat_template_content_format "openai" hands
        the template each content as a list of text parts, "string" as one string, "auto" as the
        template reads them (a loop over the content: parts)."""
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise FasterLlamaError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got {chat_template_content_format!r}")
        return chat_prompt_ids(self.tokenizer, messages, add_generation_prompt, chat_template_kwargs, chat_template=chat_template,
                               continue_final_message=continue_final_message, tools=tools,
                               content_format=chat_template_content_format)

    def chat(
        self,
        messages: list[dict[str, Any]] | Seq[list[dict[str, Any]]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        *,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tools: list[Any] | None = None,
        lora_request: None = None,
        chat_template_content_format: str = "auto",
        mm_processor_kwargs: None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (or `chat_template`) to one conversation (or a list of
        them) and generate (the keywords as vLLM's LLM.chat takes them; continue_final_message
        leaves the last turn open, and needs add_generation_prompt=False). Each output's prompt
        is the rendered text."""
        check_unused("lora_request", lora_request)
        check_unused("mm_processor_kwargs", mm_processor_kwargs)
        if not isinstance(messages, (list, tuple)):
            raise FasterLlamaError(f"messages must be a list of message dicts (or a list of such lists), got {_kind(messages)}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, add_generation_prompt, chat_template_kwargs, chat_template=chat_template,
                                    continue_final_message=continue_final_message, tools=tools,
                                    chat_template_content_format=chat_template_content_format) for c in conversations]
        outs = self.generate(prompts, _either(params, sampling_params), use_tqdm)
        for out in outs:
            out.prompt = self.tokenizer.decode(out.prompt_token_ids)
        return outs

    def beam_search(self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams, lora_request: Any = None, use_tqdm: bool | Callable[..., Any] = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam-search call: generate with params.beam_width beams, each prompt's best
        beams as BeamSearchSequences whose tokens and text include the prompt's, as vLLM's do
        (concurrency_limit: vLLM's bound on prompts searched at once; here they all are)."""
        check_unused("lora_request", lora_request)
        if not isinstance(params, BeamSearchParams):
            raise FasterLlamaError(f"params must be a BeamSearchParams, got {_kind(params)}")
        results = []
        for out in self.generate(prompts, params.sampling_params(), use_tqdm):
            beams = [BeamSearchSequence(tokens := out.prompt_token_ids + c.token_ids, cum_logprob=c.cumulative_logprob,
                                        text=self.tokenizer.decode(tokens), finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                     for c in out.outputs]
            results.append(BeamSearchOutput(beams))
        return results

    def get_default_sampling_params(self) -> SamplingParams:
        """The params of a call that gives none: the model's recommended sampling where its folder
        has a generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens as max_tokens), SamplingParams' defaults otherwise, as vLLM's."""
        return replace(self.engine.default_params)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prompt blocks (vLLM's call; True: done)."""
        with self._lock:
            self.engine.blocks.reset_prefix_cache()
        return True

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (vLLM's name; also `llm.tokenizer`)."""
        return self.tokenizer

    def compute_logits(self, token_ids: Seq[int]) -> torch.Tensor:
        """fp32 logits [len, vocab] at every position of one token sequence."""
        with self._lock:
            return self.engine.compute_logits(token_ids)
