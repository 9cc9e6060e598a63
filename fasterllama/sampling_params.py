"""SamplingParams: how one request decodes. Validated on construction with clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import FasterLlamaError


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N log-probabilities per generated token
    prompt_logprobs: int | None = None  # top-N log-probabilities per prompt token
    n: int = 1  # independent samples per prompt (with beam search: beams returned)
    beam_width: int = 1  # > 1: beam search (deterministic; sampling knobs are ignored)
    length_penalty: float = 1.0  # beams ranked by cumulative logprob / length ** length_penalty
    early_stopping: bool | str = False  # True, False or "never", as in HF generate
    diversity_rate: float = 0.0  # FasterTransformer: r-th best continuation of a beam loses rate * r
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), f"logprobs must be an integer in [0, 20], got {self.logprobs!r}"),
            (self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20), f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}"),
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (isinstance(self.beam_width, int) and self.beam_width >= 1, f"beam_width must be an integer >= 1, got {self.beam_width!r}"),
            (self.beam_width == 1 or self.n <= self.beam_width, f"n ({self.n}) cannot exceed beam_width ({self.beam_width})"),
            (self.early_stopping in (True, False, "never"), f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"),
            (self.diversity_rate >= 0, f"diversity_rate must be >= 0, got {self.diversity_rate}"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise FasterLlamaError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
