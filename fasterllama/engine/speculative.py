"""Speculative decoding: cheap guesses of a sequence's next tokens, checked by the model in one step.

A proposer drafts up to k tokens to follow each decoding sequence; the step computes the sequence's
last token and its drafts together (a verify step: k + 1 rows, one decode step of more rows), and
the rows' logits decide how many drafts were right. Each row draws the token the sampler draws
there without speculation (the target's logits, the sequence's seed and step), and the drafts are
accepted while they equal those draws; the first that differs is replaced by the row's draw. So
every output is token for token the one decoding without speculation gives, greedy and seeded
samples alike, however many tokens were drafted (the choice follows timings and the batch).

Drafts only decide the speed. Prompt lookup's are fixed guesses. A draft model's, for a sampled
sequence, are drawn from its own distribution q with the noise the target's sampler uses at that
position (an exponential race: Gumbel-max); where q is close to the target's p the two draws
mostly agree (a Gumbel coupling: 86-96% of the acceptance of the standard rejection rule in
benchmarks/speculative_coupling.py's simulation; that rule keeps the target's distribution but
not its seeded tokens, which then change with the number drafted).

Rejected drafts' K/V were written to slots past the sequence's cached tokens: they are never
counted as cached (Scheduler.accept counts the accepted ones), so later tokens overwrite them and
no block holding them is ever offered to the prefix cache.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ..errors import FasterLlamaError
from ..sampling_params import SamplingParams, integer_value
from .proposers import DraftModelProposer, NgramProposer, load_draft_model
from .scheduler import ScheduledSeq
from .sequence import Sequence

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

@dataclass(frozen=True)
class SpeculativeConfig:
    """What vLLM's speculative_config holds: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": 3, "prompt_lookup_max": 6} or {"method": "draft_model", "model": PATH,
    "num_speculative_tokens": k, "quantization": "w4"}."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 3  # (3-6 drafted 1.5% more than 2-4 on benchmarks/speculative.py's copy prompts)
    prompt_lookup_max: int = 6
    model: str | None = None
    quantization: str | None = None

    METHODS = ("ngram", "draft_model")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from a dict or its JSON text (the CLI's --speculative-config); None: off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise FasterLlamaError(f"speculative config is not valid JSON ({e.msg} at character {e.pos}): {value!r}") from None
        if not isinstance(value, dict):
            raise FasterLlamaError(f"speculative_config must be a dict such as {{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise FasterLlamaError(f"unknown speculative_config key(s) {', '.join(map(repr, unknown))} (known: {', '.join(sorted(known))})")
        method = value.get("method")
        if method not in cls.METHODS:
            raise FasterLlamaError(f"speculative_config method must be one of {', '.join(cls.METHODS)}, got {method!r}")
        k = _int(value, "num_speculative_tokens", None, 1, 15)
        given_hi = integer_value(value.get("prompt_lookup_max"))
        lo = _int(value, "prompt_lookup_min", 3 if given_hi is None else max(1, min(3, given_hi)), 1, 64)
        hi = _int(value, "prompt_lookup_max", max(6, lo), lo, 64)
        model, quantization = value.get("model"), value.get("quantization")
        if method == "draft_model" and not isinstance(model, str):
            raise FasterLlamaError("speculative_config with method 'draft_model' needs \"model\": the path of the draft model")
        if method == "ngram" and (model is not None or quantization is not None):
            raise FasterLlamaError("speculative_config method 'ngram' drafts from the prompt: it takes no model or quantization")
        if quantization is not None and not isinstance(quantization, str):
            raise FasterLlamaError(f"speculative_config quantization must be a string such as 'w4', got {quantization!r}")
        if quantization is not None:  # (a bad mode is an error now, not after both models have loaded)
            from ..quant.config import QuantConfig

            try:
                QuantConfig.parse(quantization)
            except FasterLlamaError as e:
                raise FasterLlamaError(f"speculative_config quantization: {e}") from None
        return cls(method, k, lo, hi, model, quantization)


def _int(value: dict[str, Any], key: str, default: int | None, low: int, high: int) -> int:
    raw = value.get(key, default)
    number = integer_value(raw)
    if number is None or not low <= number <= high:
        raise FasterLlamaError(f"speculative_config {key} must be an integer in [{low}, {high}], got {raw!r}")
    return number


def make_speculator(config: SpeculativeConfig, target: LLMEngine, progress: bool) -> Speculator:
    """The speculator of an engine whose model and cache are ready."""
    max_rows = target.runner.max_verify_rows
    row_cost, step_seconds = measure_row_cost(target, min(9, max_rows))
    if config.method == "ngram":
        return Speculator(NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max), config.num_speculative_tokens, row_cost, max_rows)
    draft = load_draft_model(config.model, config.quantization, target, progress)
    draft_cost = measure_row_cost(draft, 1)[1] / step_seconds if step_seconds > 0 else 1.0
    return Speculator(DraftModelProposer(draft), config.num_speculative_tokens, row_cost, max_rows, draft_cost, step_seconds)


# -- how many to draft -------------------------------------------------------------------------
class _Acceptance:
    """How a sequence's drafts fared lately. Acceptance runs in streaks (while a copy of the
    prompt goes on, every draft holds), so it is two rates: of a verify's first draft after a
    rejection (`fresh`: a new guess), and of a draft after an accepted one (`streak`: the guess
    going on). Each is (accepted, rejected) counts, decayed toward its prior so it follows the text."""

    __slots__ = ("fresh", "streak", "on_streak")

    PRIORS = ((1.2, 0.8), (1.6, 0.4))  # a new sequence: as if 2 trials of each were seen, 60% and 80% accepted

    def __init__(self) -> None:
        self.fresh, self.streak = list(self.PRIORS[0]), list(self.PRIORS[1])
        self.on_streak = False  # the last verify accepted all its drafts

    EXPLORE = 0.5  # optimism for little-tried first drafts: rate + EXPLORE / sqrt(trials)

    def rates(self) -> tuple[float, float, float]:
        """The chance that the next verify's first draft holds, that each later one holds if the
        one before did, and an optimistic first chance where it has been tried little (a probe:
        in a batch a draft must beat a higher bar, and a sequence never tried would never be)."""
        first = self.streak if self.on_streak else self.fresh
        rate = first[0] / sum(first)
        return rate, self.streak[0] / sum(self.streak), min(1.0, rate + self.EXPLORE / sum(first) ** 0.5)

    def decay(self, keep: float) -> None:
        """Forget a share of the history, drifting toward the priors."""
        for counts, prior in zip((self.fresh, self.streak), self.PRIORS):
            counts[0] = prior[0] + (counts[0] - prior[0]) * keep
            counts[1] = prior[1] + (counts[1] - prior[1]) * keep

    def add(self, drafted: int, accepted: int) -> None:
        """A verify's outcome: the first `accepted` drafts held, the next (if any) did not."""
        trials = [self.streak if self.on_streak else self.fresh] + [self.streak] * (min(accepted + 1, drafted) - 1)
        for i, counts in enumerate(trials):
            counts[0 if i < accepted else 1] += 1
        self.on_streak = accepted == drafted


class Speculator:
    """Chooses how many tokens to draft for each decoding sequence, has the proposer draft them,
    and learns from the verify steps.

    A verify step of R rows costs about 1 + c (R - 1) plain decode steps (c, the cost of a row
    beyond the first, measured on the engine at start: about 0.35 on a 2-core CPU, where a row's
    multiply-adds bound the step, near 0 on a GPU, where streaming the weights does), and a draft
    model's drafts d a step of its own (d: its step as a share of the target's one-row step,
    measured at start and then followed in the steps it drafts: a draft step's sampling and
    bookkeeping cost as much as its forward pass for a small model on a CPU; in steps without drafts
    it drifts back toward the start's measure, so a stall that priced drafts out is tried again;
    0 for prompt lookup), c d for a row in a step it takes anyway. A draft pays off the
    chance that it and every draft before it hold (_Acceptance's rates). Drafts are added
    one at a time to the sequence whose next one pays most, while that raises the step's tokens
    per unit of time, up to k per sequence and `max_rows` rows a step (the whole-step decode's
    limit). So a sequence copying its prompt drafts many, free text few or none: the rate of a
    sequence that drafts nothing drifts back toward the prior, so it tries again later."""

    DECAY = 0.85  # per verify step
    IDLE_DECAY = 0.9  # per step without drafts

    COST_KEEP = 0.8  # of the draft cost's estimate, per draft step timed
    COST_IDLE_KEEP = 0.98  # of its excess over the cost measured at start, per step without drafts

    def __init__(self, proposer: NgramProposer | DraftModelProposer, k: int, row_cost: float, max_rows: int, draft_cost: float = 0.0,
                 step_seconds: float = 0.0) -> None:
        self.proposer, self.k, self.row_cost, self.max_rows, self.draft_cost = proposer, k, row_cost, max_rows, draft_cost
        self.step_seconds = step_seconds  # the target's one-row step: the unit of the costs
        self.measured_cost = draft_cost  # d as measured at start (the forward pass alone: a floor)
        self.num_draft_tokens = self.num_accepted_tokens = 0  # over the engine's life

    def propose(self, seqs: list[Sequence], caps: list[int]) -> None:
        """Set each sequence's draft_token_ids (at most its cap: tokens it may still emit)."""
        stats = [self._acceptance(seq) for seq in seqs]
        limits = self._lengths([s.rates() for s in stats], [min(self.k, cap) for cap in caps])
        for st, n in zip(stats, limits):
            if n == 0:
                st.decay(self.IDLE_DECAY)
        seconds = self.proposer.propose(seqs, limits)
        if seconds is not None and self.step_seconds > 0:  # (each timing moves it at most 2x: a stall is not a price)
            drafting = sum(n > 0 for n in limits)  # the rows of a draft step: one at the cost d, the others c d each
            seen = seconds / self.step_seconds / (1 + self.row_cost * (drafting - 1))
            seen = min(max(seen, self.draft_cost / 2), self.draft_cost * 2)
            self.draft_cost = self.COST_KEEP * self.draft_cost + (1 - self.COST_KEEP) * seen
        elif self.draft_cost > self.measured_cost:  # nothing drafted, nothing timed: drift back, so that drafts are tried again
            self.draft_cost = self.measured_cost + (self.draft_cost - self.measured_cost) * self.COST_IDLE_KEEP

    def _lengths(self, rates: list[tuple[float, float, float]], caps: list[int]) -> list[int]:
        """Drafts per sequence: the ones that raise the step's expected tokens per unit of time,
        best first; then a one-draft probe for sequences with none whose optimistic chance would."""
        rows = len(rates)
        tokens, cost = float(rows), 1 + self.row_cost * (rows - 1)
        lengths, gains = [0] * rows, [first for first, _, _ in rates]  # gains[i]: expected tokens of seq i's next draft
        for probing in (False, True):
            while rows < self.max_rows:
                open_ = [i for i in range(len(rates)) if lengths[i] < caps[i] and not (probing and lengths[i])]
                best = max(open_, key=(lambda i: rates[i][2]) if probing else gains.__getitem__, default=None)
                if best is None:
                    break
                # the draft's verify row, and its row in the draft model's step (a step of its own past the deepest draft)
                more = self.row_cost + self.draft_cost * (1.0 if lengths[best] == max(lengths) else self.row_cost)
                if (tokens + (rates[best][2] if probing else gains[best])) / (cost + more) <= tokens / cost:
                    break
                lengths[best] += 1
                tokens += gains[best]
                cost += more
                gains[best] *= rates[best][1]
                rows += 1
        return lengths

    def release(self, seq: Sequence) -> None:
        """seq finished: drop what was kept for it (its n-gram index, its twin in the draft model)."""
        seq.acceptance = None
        self.proposer.release(seq)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verify step's outcome for seq (a finished seq's own rate is released already)."""
        if not seq.is_finished:
            st = self._acceptance(seq)
            st.decay(self.DECAY)
            st.add(drafted, accepted)
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted

    @staticmethod
    def _acceptance(seq: Sequence) -> _Acceptance:
        if seq.acceptance is None:
            seq.acceptance = _Acceptance()
        return seq.acceptance


def measure_row_cost(engine: LLMEngine, rows: int = 9, repeats: int = 3, context: int = 256) -> tuple[float, float]:
    """(c, t): what a verify row beyond the first adds to a decode step, as a share of a one-row
    step, and the one-row step's seconds, timed on this engine's model runner at a typical context
    (`context` cached positions, whose K/V are whatever the cache holds: only the time counts),
    best of `repeats`. The blocks it writes to are taken from the cache and given back."""
    context = max(1, min(context, engine.max_model_len - rows, (engine.blocks.num_free - 1) * engine.blocks.block_size - rows))
    seq = Sequence([0] * context, SamplingParams(max_tokens=1), None, 0)
    if not engine.blocks.reserve(seq, context + rows - 1):
        return 0.5, 0.0  # a cache too small to time in: a CPU's cost, roughly
    seq.num_cached = context - 1  # (never committed: nothing reaches the prefix cache)
    batches = [[ScheduledSeq(seq, 1)]] + ([[ScheduledSeq(seq, rows, [0] * (rows - 1))]] if rows > 1 else [])
    best = {1: float("inf"), rows: float("inf")}
    try:
        for _ in range(repeats + 1):  # the first of each warms up
            for batch in batches:
                start = time.perf_counter()
                engine.runner.execute(batch)
                best[batch[0].num_tokens] = min(best[batch[0].num_tokens], time.perf_counter() - start)
    finally:
        engine.blocks.free(seq)
    return (max(0.0, (best[rows] / best[1] - 1) / (rows - 1)) if rows > 1 else 0.0), best[1]


# -- verification -----------------------------------------------------------------------------
def verify(drafts: list[int], drawn: list[int]) -> list[int]:
    """The tokens a sequence emits from its drafts, given the tokens its verify rows drew (the
    sampler's draws, one before the drafts and one after each): the drafts while they are the
    model's own draws, then its draw where the first one is not."""
    n = 0
    while n < len(drafts) and drafts[n] == drawn[n]:
        n += 1
    return drawn[: n + 1]
