"""Structured output: text that follows a JSON schema, a regular expression or a Lark grammar.

llguidance (the Rust library behind guidance and vLLM's `guidance` backend) compiles a constraint
against the tokenizer's vocabulary and keeps, per sequence, a matcher that says which tokens may
come next. Each step the engine turns the constrained sequences' matchers into one bitmask and
sets the disallowed logits to -inf before the sampler, so a constraint composes with every
sampling setting (penalties, temperature, top-k/p, min-p, n > 1, seeds); the sampled token then
advances the matcher. A constraint that cannot compile is a FasterLlamaError (a 400 in the server),
raised when the request is added."""

from __future__ import annotations

import functools
import re
import threading
import time
from typing import TYPE_CHECKING

import torch

from ..errors import FasterLlamaError

if TYPE_CHECKING:
    import llguidance

    from ..sampling_params import SamplingParams
    from ..tokenizer import Tokenizer


def _compile_error(kind: str, error: object) -> FasterLlamaError:
    """llguidance's compile error on one line: its first line and, where it has one, the reason
    on its "error:" line (its caret diagrams of the internal grammar are left out)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    head = re.sub(r"^at \d+\(\d+\): ", "", lines[0].rstrip(":")) if lines else "unknown error"
    reason = next((line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")), None)
    return FasterLlamaError(f"cannot compile the {kind} constraint: {head}{f': {reason}' if reason else ''}")


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, text: str) -> str:
    """llguidance's grammar for a constraint (cached: a server sees the same schemas again and again)."""
    import llguidance

    try:
        if kind == "json":  # compact JSON (no free whitespace: fewer tokens, no runs of blanks), unless the schema's x-guidance says otherwise
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        return llguidance.LLMatcher.grammar_from_lark(text)
    except (ValueError, RuntimeError, TypeError) as e:
        raise _compile_error(kind, e) from None


class StructuredOutput:
    """One engine's constraint compiler and masker (the tokenizer's llguidance view is built once)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self.mask_seconds = 0.0  # time spent computing and applying masks (benchmarks/structured.py)
        self.mask_steps = 0

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                if self.tokenizer is None:
                    raise FasterLlamaError("structured output needs the model's tokenizer")
                import llguidance

                self._ll = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            return self._ll

    def matcher(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """A fresh matcher for one sequence of a request (None: unconstrained). Safe from any thread."""
        constraint = params.constraint
        if constraint is None:
            return None
        import llguidance

        grammar = _grammar(*constraint)
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar)
        if matcher.is_error():
            raise _compile_error(constraint[0], matcher.get_error())
        return matcher

    @torch.inference_mode()  # the logits are the model runner's inference tensors
    def mask(self, logits: torch.Tensor, rows: list[tuple[llguidance.LLMatcher | None, list[int]]]) -> None:
        """Set the logits of tokens a row's matcher does not allow to -inf, in place. A row is a
        matcher (None: unconstrained) and the drafts before it in a speculative step: its mask is
        the matcher's after them (consumed, then rolled back). Rows after a draft the constraint
        refuses are left alone: verification stops at that draft."""
        import llguidance.torch as ll_torch

        start = time.perf_counter()
        masked = [(row, m, extra) for row, (m, extra) in enumerate(rows) if m is not None]
        bitmask = ll_torch.allocate_token_bitmask(len(masked), self.vocab_size)
        consumed: dict[int, list] = {}  # id(matcher) -> [matcher, drafts it took, whether it refused one]
        filled = []
        for i, (row, matcher, extra) in enumerate(masked):
            state = consumed.setdefault(id(matcher), [matcher, 0, False])
            if not state[2] and state[1] < len(extra):
                state[1] += matcher.try_consume_tokens(extra[state[1] :])
                state[2] = state[1] < len(extra)
            if not state[2]:
                ll_torch.fill_next_token_bitmask(matcher, bitmask, i)
                filled.append((i, row))
        for matcher, n, _ in consumed.values():
            if n:
                matcher.rollback(n)
        if filled:
            # bit t % 32 of word t // 32: token t allowed (unpacked here: llguidance's own
            # apply_token_bitmask_inplace took 11 ms for 8 rows of SmolLM2's 49,152 tokens on this CPU, this 0.6)
            words = bitmask[[i for i, _ in filled]].to(logits.device)
            bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=logits.device)) & 1
            refused = bits.view(len(filled), -1)[:, : logits.shape[-1]] == 0
            index = torch.tensor([row for _, row in filled], device=logits.device)
            logits[index] = logits[index].masked_fill(refused, float("-inf"))
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1

    @staticmethod
    def valid_drafts(matcher: llguidance.LLMatcher, drafts: list[int]) -> int:
        """How many of the drafts the constraint allows in a row."""
        return matcher.validate_tokens(drafts)

    @staticmethod
    def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
        """Feed the sampled token; True once the constraint is complete (the sequence stops)."""
        if not matcher.consume_token(token):
            raise FasterLlamaError(f"structured output: token {token} is not allowed here ({matcher.get_error()})")
        return matcher.is_stopped()
