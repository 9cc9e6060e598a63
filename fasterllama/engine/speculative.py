"""Speculative decoding: cheap guesses of a sequence's next tokens, checked by the model in one step.

A proposer drafts up to k tokens to follow each decoding sequence; the step computes the sequence's
last token and its drafts together (a verify step: k + 1 rows, one decode step of more rows), and
the rows' logits decide how many drafts were right. Every emitted token is one the target model
would have produced, so outputs keep its distribution exactly:

- greedy rows, and drafts that are one fixed guess (prompt lookup: q is one-hot): row i's token is
  what the sampler draws from the target's logits there, with the sequence's seed and step; the
  drafts are accepted while they equal those tokens, and the first that differs is replaced by
  the target's token. For a one-hot q this *is* the standard rule (accept x with probability
  p(x), else draw from p without x), and the output is token for token the one decoding without
  speculation gives, seeded samples included;
- a draft model's sampled drafts (q a distribution): the standard rejection rule (Leviathan et
  al. 2023): accept x with probability min(1, p(x) / q(x)); on the first rejection draw from
  max(0, p - q), normalized; if all k are accepted, a bonus token from the last row's p.

Rejected drafts' K/V were written to slots past the sequence's cached tokens: they are never
counted as cached (Scheduler.accept counts the accepted ones), so later tokens overwrite them and
no block holding them is ever offered to the prefix cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from ..errors import FasterLlamaError
from ..sampling_params import integer_value
from . import sampler
from .scheduler import ScheduledSeq
from .sequence import Sequence

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

_DRAFT_SALT = 0x5DEECE66D  # the draft model's draws: noise independent of the target's
_ACCEPT_SALT = 0x2545F4914F6CDD1D  # the rejection rule's uniforms


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
        return cls(method, k, lo, hi, model, quantization)


def _int(value: dict[str, Any], key: str, default: int | None, low: int, high: int) -> int:
    raw = value.get(key, default)
    number = integer_value(raw)
    if number is None or not low <= number <= high:
        raise FasterLlamaError(f"speculative_config {key} must be an integer in [{low}, {high}], got {raw!r}")
    return number


# -- proposers --------------------------------------------------------------------------------
class _NgramIndex:
    """A sequence's tokens and, for every n-gram of the lookup sizes, where its latest occurrence
    ends (the position its continuation starts at). Grown as the sequence grows: a step costs the
    new tokens' n-grams, not a search of the whole context."""

    __slots__ = ("tokens", "ends", "indexed")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before every position below this are in `ends`


class NgramProposer:
    """Prompt lookup decoding (Saxena 2023): find the sequence's last n tokens earlier in its
    prompt or output (longest n first, latest occurrence) and draft the tokens that followed."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seqs: list[Sequence], limits: list[int]) -> None:
        for seq, k in zip(seqs, limits):
            seq.draft_token_ids = self._lookup(seq, k) if k > 0 else []
            seq.draft_probs = None

    def _lookup(self, seq: Sequence, k: int) -> list[int]:
        index = seq.proposer_state
        if not isinstance(index, _NgramIndex):
            index = seq.proposer_state = _NgramIndex()
        tokens = index.tokens
        if len(tokens) < seq.num_tokens:
            tokens += seq.token_ids(len(tokens), seq.num_tokens)
        end = len(tokens)
        for e in range(max(index.indexed, self.min_n), end):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                index.ends[tuple(tokens[e - n : e])] = e
        index.indexed = end
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            e = index.ends.get(tuple(tokens[end - n :]))
            if e is not None:
                return tokens[e : e + k]
        return []


class _Shadow:
    """A target sequence's twin in the draft model's engine, and how much of it is known to be
    the target's tokens (the rest are drafts, rolled back when the target rejects them)."""

    __slots__ = ("seq", "synced")

    def __init__(self, target: Sequence) -> None:
        self.seq = Sequence(target.prompt_token_ids, target.params, None, target.seed)
        self.synced = len(target.prompt_token_ids)


class DraftModelProposer:
    """A smaller model with the same tokenizer (or the same model, cheaper) drafts k tokens by
    decoding them, each sequence in its own paged cache of the draft engine: first what it has not
    seen of the target's tokens (the prompt, then the tokens the last step emitted), then one
    token at a time. Greedy sequences draft the argmax; sampled ones draw from the draft's
    distribution q (kept for the rejection rule)."""

    def __init__(self, draft: LLMEngine) -> None:
        self.draft = draft
        self.shadows: dict[int, tuple[Sequence, _Shadow]] = {}

    def release(self, seq: Sequence) -> None:
        """seq finished: its twin's blocks go back to the draft engine's cache."""
        entry = self.shadows.pop(seq.seq_id, None)
        if entry is not None:
            self.draft.blocks.free(entry[1].seq)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> None:
        engine = self.draft
        active: list[tuple[Sequence, _Shadow, int]] = []
        for seq, k in zip(seqs, limits):
            seq.draft_token_ids, seq.draft_probs = [], None
            if k <= 0:
                continue
            if seq.seq_id not in self.shadows:
                self.shadows[seq.seq_id] = (seq, _Shadow(seq))
            shadow = self.shadows[seq.seq_id][1]
            self._sync(seq, shadow)
            # K/V for the tokens it has not seen and k - 1 drafts (the last draft is never fed)
            if engine.blocks.reserve(shadow.seq, shadow.seq.num_tokens + k - 1):
                active.append((seq, shadow, k))
        if not active:
            return
        self._catch_up([shadow.seq for _, shadow, _ in active])
        drafts: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        batch = [ScheduledSeq(shadow.seq, shadow.seq.num_tokens - shadow.seq.num_cached) for _, shadow, _ in active]
        live = list(range(len(active)))
        while live:
            logits = engine.runner.execute(batch, self._last_rows(batch))
            engine.scheduler.advance(batch)
            rows = [(active[i][0], drafts[i]) for i in live]
            tokens, q = self._draw(logits, rows)
            for j, i in enumerate(live):
                drafts[i].append(tokens[j])
                if q is not None:
                    probs[i].append(q[j])
            live = [i for i in live if len(drafts[i]) < active[i][2]]
            for i in live:
                active[i][1].seq.output_token_ids.append(drafts[i][-1])
            batch = [ScheduledSeq(active[i][1].seq, 1) for i in live]
        for (seq, _, _), tokens, q in zip(active, drafts, probs):
            seq.draft_token_ids = tokens
            seq.draft_probs = torch.stack(q) if q else None

    def _sync(self, target: Sequence, shadow: _Shadow) -> None:
        """Make the shadow's tokens the target's: keep the drafts the target accepted, roll back
        the K/V of the rest, add the tokens the target emitted after them."""
        seq = shadow.seq
        mine = seq.token_ids(shadow.synced, seq.num_tokens)
        theirs = target.token_ids(shadow.synced, target.num_tokens)
        same = 0
        while same < min(len(mine), len(theirs)) and mine[same] == theirs[same]:
            same += 1
        keep = shadow.synced + same
        del seq.output_token_ids[keep - len(seq.prompt_token_ids) :]
        self.draft.blocks.rollback(seq, keep)
        seq.output_token_ids += theirs[same:]
        shadow.synced = target.num_tokens

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Compute all but the last unseen token of long catch-ups (new prompts) in chunks of the
        draft engine's token budget, so the first draft step's batch stays within it."""
        engine = self.draft
        share = max(1, engine.scheduler.max_num_batched_tokens // len(seqs))
        for seq in seqs:
            while seq.num_tokens - seq.num_cached > share:
                chunk = [ScheduledSeq(seq, min(seq.num_tokens - seq.num_cached - 1, engine.scheduler.max_num_batched_tokens))]
                engine.runner.execute(chunk, [])
                engine.scheduler.advance(chunk)

    @staticmethod
    def _last_rows(batch: list[ScheduledSeq]) -> list[int]:
        rows, offset = [], 0
        for item in batch:
            offset += item.num_tokens
            rows.append(offset - 1)
        return rows

    def _draw(self, logits: torch.Tensor, rows: list[tuple[Sequence, list[int]]]) -> tuple[list[int], torch.Tensor | None]:
        """The draft tokens of these rows, and q (the distributions drawn from) if any row samples."""
        if all(seq.params.greedy for seq, _ in rows):
            return sampler.penalized(logits, self._batch(logits, rows)).argmax(dim=-1).tolist(), None
        b = self._batch(logits, rows)
        q = sampler.probabilities(logits, b)
        drawn = sampler.draw(q, b.seeds ^ _DRAFT_SALT, b.steps)
        greedy = b.temperature == 0
        tokens = torch.where(greedy, sampler.penalized(logits, b).argmax(dim=-1), drawn)
        return tokens.tolist(), q

    def _batch(self, logits: torch.Tensor, rows: list[tuple[Sequence, list[int]]]) -> sampler.SamplingBatch:
        return sampler.sampling_batch(rows, logits.shape[-1], self.draft.eos_token_ids, logits.device)


def load_draft_model(config: SpeculativeConfig, target: LLMEngine, progress: bool) -> LLMEngine:
    """The draft model's engine: on the target's device, as many sequences and as long a context."""
    from ..loading.model_loader import load_model
    from .llm_engine import LLMEngine

    loaded = load_model(config.model, target.dtype, target.device, None if config.quantization is None else "none",
                        target.backend.keeps_gguf_quantized(target.dtype), progress)
    max_num_seqs, max_num_batched_tokens, _, block_size, _ = target._limits
    if loaded.config.vocab_size != target.config.vocab_size:
        raise FasterLlamaError(f"the draft model's vocabulary has {loaded.config.vocab_size} tokens, the model's {target.config.vocab_size}: "
                               "a draft model must share the model's tokenizer")
    if loaded.tokenizer is not None and target.tokenizer is not None and loaded.tokenizer.backend.get_vocab() != target.tokenizer.backend.get_vocab():
        raise FasterLlamaError("the draft model's tokenizer differs from the model's: a draft model must share its tokenizer")
    if loaded.config.max_position_embeddings < target.max_model_len:
        raise FasterLlamaError(f"the draft model's context ({loaded.config.max_position_embeddings} tokens) is shorter than max_model_len "
                               f"{target.max_model_len}; lower max_model_len")
    draft = LLMEngine.from_model(loaded.model, loaded.tokenizer, max_model_len=target.max_model_len, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, block_size=block_size)
    if config.quantization is not None:
        draft.quantize(config.quantization)
    return draft


def make_speculator(config: SpeculativeConfig, target: LLMEngine, progress: bool) -> Speculator:
    """The speculator of an engine whose model and cache are ready."""
    proposer = NgramProposer(config) if config.method == "ngram" else DraftModelProposer(load_draft_model(config, target, progress))
    max_rows = target.runner.max_verify_rows
    return Speculator(proposer, config.num_speculative_tokens, measure_row_cost(target, min(9, max_rows)), max_rows)


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
    multiply-adds bound the step, near 0 on a GPU, where streaming the weights does). A draft pays
    off the chance that it and every draft before it hold (_Acceptance's rates). Drafts are added
    one at a time to the sequence whose next one pays most, while that raises the step's tokens
    per unit of time, up to k per sequence and `max_rows` rows a step (the whole-step decode's
    limit). So a sequence copying its prompt drafts many, free text few or none: the rate of a
    sequence that drafts nothing drifts back toward the prior, so it tries again later."""

    DECAY = 0.85  # per verify step
    IDLE_DECAY = 0.9  # per step without drafts

    def __init__(self, proposer: NgramProposer | DraftModelProposer, k: int, row_cost: float, max_rows: int) -> None:
        self.proposer, self.k, self.row_cost, self.max_rows = proposer, k, row_cost, max_rows
        self.num_draft_tokens = self.num_accepted_tokens = 0  # over the engine's life

    def propose(self, seqs: list[Sequence], caps: list[int]) -> None:
        """Set each sequence's draft_token_ids (at most its cap: tokens it may still emit)."""
        stats = [self._acceptance(seq) for seq in seqs]
        limits = self._lengths([s.rates() for s in stats], [min(self.k, cap) for cap in caps])
        for st, n in zip(stats, limits):
            if n == 0:
                st.decay(self.IDLE_DECAY)
        self.proposer.propose(seqs, limits)

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
                if best is None or (tokens + (rates[best][2] if probing else gains[best])) / (cost + self.row_cost) <= tokens / cost:
                    break
                lengths[best] += 1
                tokens += gains[best]
                cost += self.row_cost
                gains[best] *= rates[best][1]
                rows += 1
        return lengths

    def release(self, seq: Sequence) -> None:
        """seq finished: drop what was kept for it (its n-gram index, its twin in the draft model)."""
        seq.proposer_state = seq.acceptance = None
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release(seq)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verify step's outcome for seq."""
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


def measure_row_cost(engine: LLMEngine, rows: int = 9, repeats: int = 3) -> float:
    """c: what a verify row beyond the first adds to a decode step, as a share of a one-row step,
    timed on this engine's model runner (best of `repeats`; the K/V it writes go to a block it
    takes from the cache and gives back)."""
    import time

    from ..sampling_params import SamplingParams

    seq = Sequence([0], SamplingParams(max_tokens=1), None, 0)
    if rows < 2 or not engine.blocks.reserve(seq, rows):
        return 0.0
    one, many = [ScheduledSeq(seq, 1)], [ScheduledSeq(seq, rows, [0] * (rows - 1))]
    best = {1: float("inf"), rows: float("inf")}
    try:
        for _ in range(repeats + 1):  # the first of each warms up
            for batch in (one, many):
                start = time.perf_counter()
                engine.runner.execute(batch)
                best[batch[0].num_tokens] = min(best[batch[0].num_tokens], time.perf_counter() - start)
    finally:
        engine.blocks.free(seq)
    return max(0.0, (best[rows] / best[1] - 1) / (rows - 1))


# -- verification -----------------------------------------------------------------------------
def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int], seed: int, step: int,
                     draw: Callable[[torch.Tensor, int], int]) -> list[int]:
    """The tokens a sampled sequence emits from drafts drawn from q [k, V], given the target's
    distributions p [k + 1, V] at the draft positions and after: the standard rule. `draw(probs,
    i)` draws from a distribution with the sequence's noise of step + i."""
    steps = torch.arange(step, step + len(drafts), dtype=torch.int64)
    u = sampler.hashed_uniform(torch.full_like(steps, seed ^ _ACCEPT_SALT), steps, 1)[:, 0]
    out = []
    for i, x in enumerate(drafts):
        if float(u[i]) * float(q[i, x]) < float(p[i, x]):
            out.append(x)
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        out.append(draw(residual if float(residual.sum()) > 0 else p[i], i))
        return out
    out.append(draw(p[len(drafts)], len(drafts)))
    return out
