"""SamplingParams: how one request decodes. Validated on construction with clear errors.

Every field's type and range is checked here, once, so that the Python API, the CLI and a
server all reject the same bad values with the same one-line FasterLlamaError (instead of a
TypeError deep in the sampler, or a silently wrong result such as temperature="0.5")."""

from __future__ import annotations

import copy
import json
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from .errors import FasterLlamaError

_INT64_MAX = 2**63 - 1
_INT32_MAX = 2**31 - 1


def _show(value: Any) -> str:
    """repr of a bad value, with its type when the repr alone would hide it ('0.5' vs 0.5)."""
    return repr(value) if type(value) in (int, float, type(None)) else f"{value!r} ({type(value).__name__})"


def _is_bool(value: Any) -> bool:
    """Python, numpy and torch booleans: integers to Python, but never a count or a token id."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def integer_value(value: Any) -> int | None:
    """value as an int if it is an integer (int, numpy or torch integer scalar); None for bools,
    floats, strings and the rest: 1.5 must not be truncated to 1, nor True taken for 1."""
    if _is_bool(value):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check_int(name: str, value: Any, low: int, high: int | None = None, note: str = "") -> int:
    """An integer in [low, high] (normalized to a Python int), or one error naming the range."""
    number = integer_value(value)
    if number is None or number < low or (high is not None and number > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise FasterLlamaError(f"{name} must be {allowed}{note}, got {_show(value)}")
    return number


def _check_real(name: str, value: Any, allowed: str, ok: Callable[[float], bool] = lambda x: True) -> float:
    """A finite real number (int or float, not bool or str) for which ok(x) holds, as a float."""
    if isinstance(value, Real) and not _is_bool(value):
        number = float(value)
        if math.isfinite(number) and ok(number):
            return number
    raise FasterLlamaError(f"{name} must be {allowed}, got {_show(value)}")


def _check_bool(name: str, value: Any) -> bool:
    """A real bool: a server's "false" string or a 0/1 must not pass as a flag by truthiness."""
    if not isinstance(value, bool):
        raise FasterLlamaError(f"{name} must be True or False, got {_show(value)}")
    return value


def _check_list(name: str, value: Any, single: type | None, allowed: str) -> list[Any]:
    """None -> [], a lone `single` value -> [value], a list/tuple -> a list; anything else fails."""
    if value is None:
        return []
    if single is not None and isinstance(value, single):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise FasterLlamaError(f"{name} must be {allowed}, got {_show(value)}")
    return list(value)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


GREEDY_BELOW = 1e-5  # temperatures under it are greedy
_FLOAT32_MAX = 3.4028234663852886e38  # (biases are added to fp32 logits: past it, +-inf)


@dataclass
class StructuredOutputsParams:
    """vLLM's way to ask for structured output, `SamplingParams(structured_outputs=...)` (and, as
    GuidedDecodingParams, `guided_decoding=...`): one of json (a schema as a dict, its JSON text
    or a pydantic model class), regex, choice, grammar, json_object. Compact JSON and objects
    closed to their listed properties are ours already (disable_any_whitespace,
    disable_additional_properties: accepted, as vLLM's default backend behaves)."""

    json: dict | str | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    backend: str | None = None  # (vLLM's per-request backend: there is one here, llguidance)

    def sampling_fields(self) -> dict[str, Any]:
        """The SamplingParams fields it stands for."""
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise FasterLlamaError(f"structured outputs: {name} is not supported (json, regex, choice, grammar or json_object)")
        return {"json_schema": _schema_of(self.json), "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                "json_object": bool(self.json_object)}


GuidedDecodingParams = StructuredOutputsParams  # (vLLM's older name)


def _schema_of(value: Any) -> Any:
    """A JSON schema, or a pydantic model class's (vLLM takes both)."""
    return value.model_json_schema() if isinstance(value, type) and hasattr(value, "model_json_schema") else value


@dataclass
class BeamSearchParams:
    """vLLM's parameters of `LLM.beam_search`: beam_width beams for max_tokens tokens, ranked by
    cumulative log-probability / length ** length_penalty (temperature 0: the model's own)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def sampling_params(self) -> SamplingParams:
        if self.temperature != 0:
            raise FasterLlamaError(f"beam search ranks beams by the model's log-probabilities: temperature must be 0, got {_show(self.temperature)}")
        return SamplingParams(beam_width=self.beam_width, n=self.beam_width, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos, temperature=0,
                              length_penalty=self.length_penalty, include_stop_str_in_output=self.include_stop_str_in_output)


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # vLLM's default (and OpenAI's); None: until the context is full
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 (or -1) = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)  # a string, a list of strings, or None (no stop strings)
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) at the end of the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N log-probabilities per generated token
    prompt_logprobs: int | None = None  # top-N log-probabilities per prompt token
    n: int = 1  # independent samples per prompt (with beam search: beams returned)
    beam_width: int = 1  # > 1: beam search (deterministic: temperature, top_k/p and min_p are ignored; penalties refused)
    length_penalty: float = 1.0  # beams ranked by cumulative logprob / length ** length_penalty
    early_stopping: bool | str = False  # True, False or "never", as in HF generate
    diversity_rate: float = 0.0  # FasterTransformer: r-th best continuation of a beam loses rate * r
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # (vLLM's; HF's fast tokenizers, whose decoding this is, have no such choice)
    detokenize: bool = True  # False: token ids only, text ""
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: as many as the context holds)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's; -100 / 100 ban / force)
    allowed_token_ids: list[int] | None = None  # only these tokens may be drawn (vLLM's)
    bad_words: list[str] | None = None  # words never generated (vLLM's: a word's last token is banned after its others)
    # structured output (at most one; engine/structured.py): the text follows a JSON schema (a dict
    # or its JSON text), a regular expression, a Lark grammar (llguidance's syntax) or a GBNF one
    # (llama.cpp's), is one of the choices, or is any JSON object
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's spelling of the five above
    guided_decoding: StructuredOutputsParams | None = None  # (vLLM's older name)
    # vLLM's keywords that ask nothing of their own here: taken at values that change nothing
    best_of: int | None = None  # (n or None: the n samples are all returned)
    logits_processors: list | None = None  # (none: a custom processor is refused)
    output_kind: Any = None  # (LLM.generate returns finished outputs whatever the kind)
    extra_args: dict[str, Any] | None = None  # (for custom processors, which there are none of)

    def __post_init__(self) -> None:
        """Check every field's type and range, normalizing numbers (numpy ints -> int, 0 -> 0.0)."""
        self._take_structured_outputs()
        self.max_tokens = _INT32_MAX if self.max_tokens is None else _check_int("max_tokens", self.max_tokens, 1, note=" or None")
        self.temperature = _check_real("temperature", self.temperature, "a finite number >= 0 (0 = greedy)", lambda x: x >= 0)
        if self.temperature < GREEDY_BELOW:  # (vLLM's rule: below it logits / temperature overflow to inf, and the draw is noise)
            self.temperature = 0.0
        self.top_k = _check_int("top_k", self.top_k, -1, _INT32_MAX, " (0 or -1 = off)")
        self.top_k = max(self.top_k, 0)  # (-1: vLLM's off)
        self.top_p = _check_real("top_p", self.top_p, "a number in (0, 1]", lambda x: 0 < x <= 1)
        self.min_p = _check_real("min_p", self.min_p, "a number in [0, 1]", lambda x: 0 <= x <= 1)
        self.repetition_penalty = _check_real("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 = off)", lambda x: x > 0)
        self.presence_penalty = _check_real("presence_penalty", self.presence_penalty, "a number in [-2, 2]", lambda x: -2 <= x <= 2)
        self.frequency_penalty = _check_real("frequency_penalty", self.frequency_penalty, "a number in [-2, 2]", lambda x: -2 <= x <= 2)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, " (at most max_tokens)")
        self.stop = _check_list("stop", self.stop, str, "a string, a list of strings or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise FasterLlamaError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        ids = _check_list("stop_token_ids", self.stop_token_ids, None, "a list of integers >= 0 or None")
        self.stop_token_ids = [_check_int("each of stop_token_ids", t, 0, _INT64_MAX) for t in ids]
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.include_stop_str_in_output = _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, 0, 20, " or None")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs, 0, 20, " or None")
        self.n = _check_int("n", self.n, 1)
        self.beam_width = _check_int("beam_width", self.beam_width, 1, note=" (1 = no beam search)")
        if self.beam_width > 1 and self.n > self.beam_width:
            raise FasterLlamaError(f"n ({self.n}) cannot exceed beam_width ({self.beam_width})")
        if self.beam_width > 1 and (self.logprobs is not None or self.prompt_logprobs is not None):
            raise FasterLlamaError("logprobs and prompt_logprobs do not combine with beam search (beams carry their cumulative_logprob)")
        self.length_penalty = _check_real("length_penalty", self.length_penalty, "a finite number")
        if not (self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never"):
            raise FasterLlamaError(f"early_stopping must be True, False or 'never', got {_show(self.early_stopping)}")
        self.diversity_rate = _check_real("diversity_rate", self.diversity_rate, "a finite number >= 0", lambda x: x >= 0)
        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)
        self.spaces_between_special_tokens = _check_bool("spaces_between_special_tokens", self.spaces_between_special_tokens)
        self.detokenize = _check_bool("detokenize", self.detokenize)
        if not self.detokenize and self.stop:
            raise FasterLlamaError("stop strings need detokenize=True (they are searched for in the text)")
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1,
                                                     note=", not 0 (-1: as many as the context holds), or None")
            if self.truncate_prompt_tokens == 0:
                raise FasterLlamaError("truncate_prompt_tokens must be -1 (as many as the context holds), an integer >= 1 or None, got 0")
        if self.best_of is not None and self.best_of != self.n:
            raise FasterLlamaError(f"best_of other than n is not supported (n={self.n}, best_of={_show(self.best_of)})")
        if self.logits_processors:
            raise FasterLlamaError("logits_processors are not supported (logit_bias, allowed_token_ids, bad_words and structured output are)")
        self._check_token_biases()
        self._check_constraint()
        if self.seed == -1 and not isinstance(self.seed, bool):  # (vLLM's: -1 is no seed)
            self.seed = None
        if self.seed is not None:  # sample k draws with seed + k, wrapped into int64
            self.seed = _check_int("seed", self.seed, -(2**63), _INT64_MAX, " (a 64-bit integer)")

    def _take_structured_outputs(self) -> None:
        """vLLM's structured_outputs / guided_decoding, written into the constraint fields."""
        self.json_schema = _schema_of(self.json_schema)
        for name in ("structured_outputs", "guided_decoding"):
            given = getattr(self, name)
            if given is None:
                continue
            if not isinstance(given, StructuredOutputsParams):
                raise FasterLlamaError(f"{name} must be a StructuredOutputsParams, got {_show(given)}")
            for key, value in given.sampling_fields().items():
                if value is None or value is False:
                    continue
                if getattr(self, key) not in (None, False, value):  # (the same value: this check run again, on a copy)
                    raise FasterLlamaError(f"give the constraint once: {name} and {key} both set it")
                setattr(self, key, value)

    def _check_token_biases(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise FasterLlamaError(f"logit_bias must be a dict of token id -> bias, got {_show(self.logit_bias)}")
            self.logit_bias = {_check_int("each logit_bias token id", int(t) if isinstance(t, str) and t.isdigit() else t, 0, _INT64_MAX):
                               _check_real(f"logit_bias[{t}]", b, "a finite number (within float32's range)", lambda x: abs(x) <= _FLOAT32_MAX)
                               for t, b in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            ids = _check_list("allowed_token_ids", self.allowed_token_ids, None, "a non-empty list of token ids or None")
            if not ids:
                raise FasterLlamaError("allowed_token_ids must not be empty (None: every token)")
            self.allowed_token_ids = [_check_int("each of allowed_token_ids", t, 0, _INT64_MAX) for t in ids]
        if self.bad_words is not None:
            words = _check_list("bad_words", self.bad_words, str, "a list of non-empty strings or None")
            if not all(isinstance(w, str) and w for w in words):
                raise FasterLlamaError(f"bad_words must be a list of non-empty strings, got {_show(self.bad_words)}")
            self.bad_words = words or None
        if self.beam_width > 1 and (self.logit_bias or self.allowed_token_ids or self.bad_words):
            raise FasterLlamaError("logit_bias, allowed_token_ids and bad_words do not combine with beam search")
        if self.beam_width > 1 and (self.repetition_penalty != 1 or self.presence_penalty or self.frequency_penalty):
            raise FasterLlamaError("repetition_penalty, presence_penalty and frequency_penalty do not combine with beam search "
                                   "(beams are ranked by the model's own log-probabilities)")

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's)."""
        return copy.deepcopy(self)

    @property
    def biases_tokens(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words change the logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    def _check_constraint(self) -> None:
        if isinstance(self.json_schema, str):
            try:
                schema = json.loads(self.json_schema, parse_constant=_refuse_constant)
            except ValueError as e:
                raise FasterLlamaError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise FasterLlamaError(f"json_schema must be a JSON object, got {_show(self.json_schema)}")
        elif isinstance(self.json_schema, dict):
            try:
                json.dumps(self.json_schema, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise FasterLlamaError(f"json_schema must hold JSON values only: {e}") from None
        elif self.json_schema is not None:
            raise FasterLlamaError(f"json_schema must be a dict or its JSON text, got {_show(self.json_schema)}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise FasterLlamaError(f"{name} must be a non-empty string, got {_show(value)}")
        if self.choice is not None:
            choices = _check_list("choice", self.choice, None, "a non-empty list of strings or None")
            if not choices or not all(isinstance(c, str) for c in choices):
                raise FasterLlamaError(f"choice must be a non-empty list of strings, got {_show(self.choice)}")
            self.choice = choices
        self.json_object = _check_bool("json_object", self.json_object)
        given = [n for n in ("json_schema", "regex", "grammar", "choice") if getattr(self, n) is not None] + (["json_object"] if self.json_object else [])
        if len(given) > 1:
            raise FasterLlamaError(f"give at most one of json_schema, regex, grammar, choice and json_object, got {', '.join(given)}")
        if given and self.beam_width > 1:
            raise FasterLlamaError("structured output does not combine with beam search")

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the structured-output constraint: ("json", schema text), ("regex", ...),
        ("lark", grammar), or None. A schema's objects that list their properties take no others
        unless it says so (additionalProperties), as vLLM's default backend (xgrammar), llama.cpp
        and OpenAI's strict mode read them: left open, a small model went on inventing keys."""
        if self.json_schema is not None:
            from .json_schemas import closed_objects

            schema = json.loads(self.json_schema) if isinstance(self.json_schema, str) else self.json_schema
            return "json", json.dumps(closed_objects(schema))  # (its property order is the output's)
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "lark", self.grammar
        if self.choice is not None:  # a regex alternation (a Lark rule of 2,000 alternatives passes llguidance's parser limits)
            return "regex", "|".join(re.sub(r"([\\.+*?()|\[\]{}^$#&~-])", r"\\\1", c) for c in self.choice)
        return ("json", '{"type": "object"}') if self.json_object else None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
