"""Structured output: text that follows a JSON schema, a regular expression or a Lark grammar.

llguidance (the Rust library behind guidance and vLLM's `guidance` backend) compiles a constraint
against the tokenizer's vocabulary and keeps, per sequence, a matcher that says which tokens may
come next. Each step the engine turns the constrained sequences' matchers into one bitmask and
sets the disallowed logits to -inf before the sampler, so a constraint composes with every
sampling setting (penalties, temperature, top-k/p, min-p, n > 1, seeds); the sampled token then
advances the matcher. A constraint that cannot compile is a FasterLlamaError (a 400 in the server),
raised when the request is added; one that fails later (llguidance's parser limits, such as 2,000
items a row, or allowed_token_ids the constraint never allows) ends its own sequence with
finish_reason "error", never the step of the others."""

from __future__ import annotations

import collections
import json
import re
import threading
import time
from typing import TYPE_CHECKING, Any

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


def _grammar(kind: str, text: str) -> str:
    """llguidance's grammar for a constraint: a JSON schema, a regex, or a Lark grammar (GBNF, as
    llama.cpp writes grammars, converted to Lark)."""
    import llguidance
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    try:
        if kind == "json":  # compact JSON (no free whitespace: fewer tokens, no runs of blanks), unless the schema's x-guidance says otherwise
            if text.strip() == "true":  # (the boolean schema of any value, as {}: a boolean schema takes no options)
                text = "{}"
            options = {} if text.strip() == "false" else {"defaults": {"whitespace_flexible": False}}
            return llguidance.LLMatcher.grammar_from_json_schema(text, **options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
    except (ValueError, RuntimeError, TypeError, GbnfToLarkError) as e:
        raise _compile_error(kind, e) from None


# compiled matchers kept (a server sees the same schemas again and again), bounded in number and in
# constraint text (a compiled matcher holds several times its text)
COMPILED_CACHE_ENTRIES = 64
COMPILED_CACHE_CHARS = 4 << 20


class _TextTokenizer:
    """llguidance's view of the tokenizer (its TokenizerWrapper protocol): the tokens' bytes and
    which are special, as llguidance reads them from the tokenizer's JSON, but text tokenized with
    special-token strings split as plain text. llguidance tokenizes the text a constraint forces
    (a choice, a const, a regex's literal) with the tokenizer; the JSON's own tokenizer turned a
    forced "<|im_end|>" into the special token, which the grammar then refused: every constraint
    whose text holds a special token's string failed at that token."""

    is_tokenizer_wrapper = True

    def __init__(self, from_json: llguidance.LLTokenizer, tokenizer: Tokenizer) -> None:
        from tokenizers import Tokenizer as BackendTokenizer

        ids = range(from_json.vocab_size)
        self.tokens = [from_json.decode_bytes([i]) for i in ids]
        self.special_token_ids = [i for i in ids if from_json.is_special_token(i)]
        self.eos_token_id, self.bos_token_id = from_json.eos_token, tokenizer.bos_token_id
        # a fragment of text, not the start of a prompt: no SentencePiece "▁" or byte-level space before
        # it (llguidance's own reading of the JSON drops it too; with it every forced fragment began with a space)
        spec = json.loads(tokenizer.backend.to_str())
        spec["normalizer"] = _without_prepend(spec.get("normalizer"))
        spec["pre_tokenizer"] = _without_prefix_space(spec.get("pre_tokenizer"))
        self._backend = BackendTokenizer.from_str(json.dumps(spec))
        self._backend.encode_special_tokens = True
        self._greedy = from_json.greedy_tokenize

    def __call__(self, text: str | bytes) -> list[int]:
        raw = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = self._backend.encode(raw.decode("utf-8"), add_special_tokens=False).ids
        if b"".join(self.tokens[i] for i in ids) != raw:  # (a normalizer changed it: NFC, lowercase; llguidance needs its bytes)
            ids = self._greedy(raw.decode("utf-8"))
        return ids


def _without_prepend(normalizer: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tokenizer.json normalizer less its Prepend("▁") steps (Llama-2's HF form of the dummy prefix)."""
    if normalizer is None or normalizer.get("type") == "Prepend":
        return None
    if normalizer.get("type") == "Sequence":
        normalizer["normalizers"] = [n for n in map(_without_prepend, normalizer["normalizers"]) if n is not None]
    return normalizer


def _without_prefix_space(pre: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tokenizer.json pre-tokenizer that adds no space before the text (Metaspace's prepend, ByteLevel's)."""
    if pre is None:
        return None
    if pre.get("type") == "Metaspace":
        pre["prepend_scheme"], pre["add_prefix_space"] = "never", False
    elif pre.get("type") == "ByteLevel":
        pre["add_prefix_space"] = False
    elif pre.get("type") == "Sequence":
        pre["pretokenizers"] = [_without_prefix_space(p) for p in pre["pretokenizers"]]
    return pre


class StructuredOutput:
    """One engine's constraint compiler and masker (the tokenizer's llguidance view is built once)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[tuple[str, str], llguidance.LLMatcher] = collections.OrderedDict()  # LRU
        self._compiled_chars = 0
        self.mask_seconds = 0.0  # time spent computing and applying masks (benchmarks/structured.py)
        self.mask_steps = 0

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                if self.tokenizer is None:
                    raise FasterLlamaError("structured output needs the model's tokenizer")
                import llguidance

                from_json = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                self._ll = llguidance.LLTokenizer(_TextTokenizer(from_json, self.tokenizer), n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            return self._ll

    def matcher(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """A fresh matcher for one sequence of a request (None: unconstrained): a copy of the
        constraint's compiled matcher, which is compiled once (seconds for a 50,000-item enum)
        and kept while the cache holds it. Safe from any thread."""
        constraint = params.constraint
        if constraint is None:
            return None
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is not None:
                self._compiled.move_to_end(constraint)
                return compiled.deep_copy()
        compiled = self._compile(*constraint)  # (outside the lock: other requests go on meanwhile)
        with self._lock:
            if constraint not in self._compiled:  # (another thread may have compiled it meanwhile)
                self._compiled[constraint] = compiled
                self._compiled_chars += len(constraint[1])
            while len(self._compiled) > 1 and (self._compiled_chars > COMPILED_CACHE_CHARS or len(self._compiled) > COMPILED_CACHE_ENTRIES):
                (_, text), _ = self._compiled.popitem(last=False)
                self._compiled_chars -= len(text)
            return compiled.deep_copy()

    def _compile(self, kind: str, text: str) -> llguidance.LLMatcher:
        """The matcher of a constraint at its start. Its first mask is computed here too: a
        constraint past llguidance's parser limits fails there, as a compile error of the request
        rather than in a step."""
        import llguidance
        import llguidance.torch as ll_torch

        matcher = llguidance.LLMatcher(self._ll_tokenizer(), _grammar(kind, text), log_level=0)
        if not matcher.is_error():
            ll_torch.fill_next_token_bitmask(matcher, ll_torch.allocate_token_bitmask(1, self.vocab_size), 0)
        if matcher.is_error():
            raise _compile_error(kind, matcher.get_error())
        return matcher

    @torch.inference_mode()  # the logits are the model runner's inference tensors
    def mask(self, logits: torch.Tensor, rows: list[tuple[llguidance.LLMatcher | None, list[int], bool]]) -> None:
        """Set the logits of tokens a row's matcher does not allow to -inf, in place. A row is a
        matcher (None: unconstrained), the drafts before it in a speculative step (its mask is the
        matcher's after them: consumed, then rolled back) and whether EOS is refused where the
        constraint allows more (ignore_eos: EOS would complete it and end the output). Rows after
        a draft the constraint refuses are left alone: verification stops at that draft."""
        import llguidance.torch as ll_torch

        start = time.perf_counter()
        masked = [(row, m, extra) for row, (m, extra, _) in enumerate(rows) if m is not None]
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
            eos = [t for t in self.eos_token_ids if 0 <= t < refused.shape[1]]
            going = [k for k, (_, row) in enumerate(filled) if rows[row][2]]
            if going and eos:
                part = refused[going]
                more = (~part).sum(dim=1) > (~part[:, eos]).sum(dim=1)  # (a token besides EOS is allowed)
                part[:, eos] |= more[:, None]
                refused[going] = part
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
            why = matcher.get_error().strip().splitlines()[0] if matcher.is_error() else "the constraint allows no token the sampler may draw"
            raise FasterLlamaError(f"token {token} is not allowed ({why})")
        return matcher.is_stopped()
