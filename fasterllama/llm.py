"""LLM: the offline Python API, a thin layer over LLMEngine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence as Seq

import torch

from .engine.beam_search import BeamSearch
from .engine.llm_engine import LLMEngine
from .engine.sequence import Sequence
from .errors import FasterLlamaError
from .sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    """One generated continuation (one of `n` samples, or one beam)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    @classmethod
    def from_sequence(cls, index: int, seq: Sequence) -> "CompletionOutput":
        asked = seq.params.logprobs is not None
        return cls(index, seq.text, list(seq.output_token_ids), seq.finish_reason,
                   seq.logprobs if asked else None, seq.cumulative_logprob if asked else None)


@dataclass
class RequestOutput:
    """All continuations of one prompt; `.text`, `.token_ids`, ... are those of the first (best)."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, float] | None] | None = None

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
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs

    @property
    def cumulative_logprob(self) -> float | None:
        return self.outputs[0].cumulative_logprob

    @classmethod
    def from_sequences(cls, prompt: Prompt, seqs: list[Sequence]) -> "RequestOutput":
        return cls(
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=seqs[0].prompt_token_ids,
            outputs=[CompletionOutput.from_sequence(i, s) for i, s in enumerate(seqs)],
            prompt_logprobs=seqs[0].prompt_logprobs,
        )


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
    ) -> None:
        """quantization: None (the default: a GGUF file on the CPU in fp32 keeps its Q8_0/Q4_0/Q4_1
        tensors as they are, "gguf", and every other checkpoint loads as float), "none" (float
        weights, dequantizing a GGUF file), "gguf", or a spec such as "w8", "w8-g32", "w4", "w4-g64",
        "w8a8", "w8a8-static-mse", "w8a8-static-percentile99.99-sq0.5" (see fasterllama.quant.config).
        "gguf" is exact: its kernels expand each block to the very floats "none" holds."""
        self.engine = LLMEngine(
            model,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            progress=progress,
            quantization=quantization,
            calibration_text=calibration_text,
        )
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); one output per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise FasterLlamaError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        results: dict[int, RequestOutput] = {}
        beam_groups: dict[int, list[int]] = {}  # prompts sharing one beam-search params object run batched
        for i, p in enumerate(params_list):
            if p.beam_width > 1:
                beam_groups.setdefault(id(p), []).append(i)
        for idx in beam_groups.values():
            for i, out in zip(idx, self._beam_search([prompts[i] for i in idx], params_list[idx[0]])):
                results[i] = out
        groups: dict[int, list[Sequence]] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list)):
                if p.beam_width == 1:
                    groups[i] = [engine.add_request(prompt, p, sample_index=k) for k in range(p.n)]
            while engine.has_unfinished():
                engine.step()
        except BaseException:
            for seq in (s for g in groups.values() for s in g):
                engine.abort(seq)
            raise
        for i, g in groups.items():
            results[i] = RequestOutput.from_sequences(prompts[i], g)
        return [results[i] for i in range(len(prompts))]

    def _beam_search(self, prompts: list[Prompt], params: SamplingParams) -> list[RequestOutput]:
        ids = [self.engine.encode_prompt(p) for p in prompts]
        outs = []
        for prompt, prompt_ids, beams in zip(prompts, ids, BeamSearch(self.engine).run(ids, params)):
            outputs = [CompletionOutput(k, b.text, b.token_ids, b.finish_reason, None, b.cumulative_logprob) for k, b in enumerate(beams)]
            outs.append(RequestOutput(prompt if isinstance(prompt, str) else None, prompt_ids, outputs))
        return outs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text deltas as they become printable."""
        engine = self.engine
        seq = engine.add_request(prompt, params)
        try:
            while not seq.is_finished:
                for update in engine.step():
                    if update.seq is seq and update.text_delta:
                        yield update.text_delta
        finally:
            engine.abort(seq)
        self.last_output = RequestOutput.from_sequences(prompt, [seq])

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    def chat(
        self,
        messages: list[dict[str, Any]] | Seq[list[dict[str, Any]]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.chat_prompt(c) for c in conversations], params)

    def compute_logits(self, token_ids: Seq[int]) -> torch.Tensor:
        """fp32 logits [len, vocab] at every position of one token sequence."""
        return self.engine.compute_logits(token_ids)
