"""Sequence: one request's tokens, sampling params, status and blocks of the paged KV cache."""

from __future__ import annotations

import itertools
from enum import Enum, auto

import torch

from ..sampling_params import SamplingParams
from ..tokenizer import IncrementalDetokenizer, Tokenizer


class Logprob(float):
    """A token's log-probability: a float, with vLLM's Logprob fields besides (.logprob, .rank:
    1 for the most likely token of the vocabulary, .decoded_token)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple:
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank}, decoded_token={self.decoded_token!r})"


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_ids = itertools.count()


class Sequence:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Tokenizer | None, seed: int) -> None:
        self.seq_id = next(_ids)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []  # KV cache blocks (BlockManager); key position p in block_table[p // block_size]
        self.block_hashes: list[int] = []  # prefix-cache hashes of the full blocks
        self.num_cached = 0  # tokens whose K/V are in the cache
        self.num_prefix_cached = 0  # prompt tokens found in the prefix cache at its first admission instead of computed
        self.admitted = False  # scheduled once (a preempted sequence coming back finds blocks it computed itself)
        self.forks: list[Sequence] = []  # the other samples of its request: they share its prompt once prefilled
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it ended with finish_reason "error" (its constraint failed)
        self.error_is_request = True  # the error is the request's own (a server answers 400), not the model's (500)
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's)
        self.bad_words_ids: list[list[int]] = []  # params.bad_words as token ids (each with and without a leading space)
        self.logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0  # sum of chosen tokens' logprobs (when logprobs are asked)
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_logits: list[torch.Tensor] | None = None  # when a list: every prompt row's fp32 logits, step by step
        self.uncached_prompt = False  # True: every prompt position computed, nothing taken from the prefix cache
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, self.prompt_token_ids) if tokenizer else None
        self.text = ""  # output text so far (truncated before a stop string)
        self.num_emitted = 0  # chars of text already streamed
        self.num_checked = 0  # chars of text already searched for stop strings
        self.matcher = None  # structured output: the llguidance matcher of its constraint (engine/structured.py)
        self.draft_token_ids: list[int] = []  # speculative decoding: tokens proposed to follow it, verified in its next step
        self.proposer_state: object = None  # what the speculative proposer keeps of it (engine/speculative.py)
        self.acceptance: object = None  # how often its drafts were accepted lately (speculative.Speculator)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, without joining the two lists (a decode step
        would otherwise copy the whole context for one token)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def needs_prompt_rows(self) -> bool:
        """Whether every prompt position is computed and its logits kept (prompt logprobs,
        compute_logits), rather than only the last one's sampled and nothing taken from the prefix cache."""
        return self.params.prompt_logprobs is not None or self.prompt_logits is not None

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
