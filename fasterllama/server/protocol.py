"""Request bodies of the OpenAI API (the fields we honour), validated strictly.

Strict mode: a string is not a number and 5.0 is not an integer, as in OpenAI's API; NaN and
infinities are refused; null is as if the field were not sent. Fields we cannot honour (suffix,
chat's echo, vLLM's use_beam_search, ...: REFUSED) are refused when set to anything but their
default rather than silently ignored, as are OpenAI's audio output and web search; other unknown
fields are ignored, as vLLM does (OpenAI's service settings: store, service_tier, metadata,
prediction, reasoning_effort). Tools and tool_choice: see tools.py.
Extensions beyond OpenAI (vLLM's names): top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, skip_special_tokens, allowed_token_ids, bad_words, include_stop_str_in_output,
truncate_prompt_tokens, return_tokens_as_token_ids, prompt_logprobs, and structured output: response_format (json_object,
json_schema), guided_json, guided_regex, guided_grammar (a Lark or GBNF grammar), guided_choice, and
structured_outputs (vLLM's newer name for them)."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..errors import FasterLlamaError
from ..sampling_params import SamplingParams, StructuredOutputsParams
from ..tokenizer import Tokenizer
from .tools import forced_call_schema

MAX_N = 128  # sequences per prompt
MAX_PROMPTS = 256  # prompts in one completions request
MAX_STOP = 16
MAX_LOGPROBS = 20
_INT64_MAX = 2**63 - 1


def _refuse(param: str, message: str) -> PydanticCustomError:
    """A validation error naming its parameter (for rules checked across fields)."""
    return PydanticCustomError("invalid_value", message, {"param": param})


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A field sent as null takes its default, as OpenAI reads it (some clients send every field)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


# vLLM's request fields whose effect we do not have, each with vLLM's default: a request that sets
# one to anything else is refused (ignoring it would answer another question than the one asked)
REFUSED: dict[str, Any] = {"use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
                           "logits_processors": None, "guided_whitespace_pattern": None, "priority": 0, "return_token_ids": False,
                           "mm_processor_kwargs": None, "documents": None, "prompt_embeds": None}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # (vLLM's: with include_usage, every chunk carries its choice's usage so far)


class JSONSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs (its newer name for the guided_* fields): one constraint."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)  # (an option we do not have is refused, not ignored)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # (JSON is compact here already)
    disable_additional_properties: bool = False  # (objects take their listed properties only already: SamplingParams.constraint)

    def sampling_fields(self) -> dict[str, Any]:
        """The SamplingParams fields of its constraint, as the Python API's StructuredOutputsParams gives them."""
        fields = StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar, json_object=self.json_object)
        return {k: v for k, v in fields.sampling_fields().items() if v not in (None, False)}


class GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=_INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # the prompt's last k tokens (-1: as many as the context holds)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each prompt token's logprob and the top N (vLLM's)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # structured output, vLLM's extension names
    guided_regex: str | None = None
    guided_grammar: str | None = None  # a Lark grammar (llguidance's syntax) or a GBNF one
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None

    refused: ClassVar[dict[str, Any]] = REFUSED
    max_tokens_name: ClassVar[str] = "max_tokens"  # (the field the client gave: chat's may be max_completion_tokens)

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        for name, default in cls.refused.items():
            value = data.get(name) if isinstance(data, dict) else None
            if value is not None and value != default and value not in ([], {}):  # (an empty list or dict asks nothing)
                raise _refuse(name, f"{name} is not supported")
        return data

    @model_validator(mode="after")
    def _rules(self) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise _refuse("stream_options", "stream_options can only be given with stream true")
        if self.truncate_prompt_tokens == 0:
            raise _refuse("truncate_prompt_tokens", "truncate_prompt_tokens must be at least 1 (or -1: as many as the context holds)")
        return self

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's: token ids (as strings) -> a bias from -100 to 100."""
        if not v:
            return None
        out: dict[int, float] = {}
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (integers >= 0 as strings), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be from -100 to 100, got {bias} for token {key}")
            out[int(key)] = bias
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(self, max_tokens: int, logprobs: int | None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams for one prompt (FasterLlamaError on a combination it refuses); the
        sampling fields it leaves out take the model's `defaults` (its generation_config.json's),
        else OpenAI's."""
        defaults = defaults or {}

        def given(name: str, default: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, default) if value is None else value

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=given("temperature", 1.0),
            top_p=given("top_p", 1.0),
            top_k=max(0, given("top_k", 0)),
            min_p=given("min_p", 0.0),
            repetition_penalty=given("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, max_tokens),  # (max_tokens cut to the context; a smaller one asked for: refused before)
            logprobs=logprobs,
            prompt_logprobs=self.num_prompt_logprobs,
            n=self.n,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            include_stop_str_in_output=self.include_stop_str_in_output,
            **self._constraint(),
        )

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The engine's prompt_logprobs count (None: none computed)."""
        return self.prompt_logprobs

    def param_of(self, message: str) -> str | None:
        """The request field an engine error is about, as OpenAI names `param`: the field its
        message starts with, or the one that gave a constraint that cannot compile."""
        words = re.findall(r"\w+", message)
        if words and words[0] in type(self).model_fields:
            return words[0]
        sources = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice", "structured_outputs")
        constraint = {"json_schema", "regex", "grammar", "choice", "json_object", "compile", "structured", *sources}
        if constraint & set(words):  # (SamplingParams' names for it, its compile error, or two of them given)
            return next((name for name in sources if getattr(self, name) is not None), None)
        return next((w for w in words[:4] if w in type(self).model_fields), None)

    def _constraint(self) -> dict[str, Any]:
        """The SamplingParams fields of the one constraint given by response_format, the guided_*
        fields or structured_outputs (two of them: an error)."""
        sources: dict[str, dict[str, Any]] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise FasterLlamaError("response_format of type json_schema needs a json_schema object")
            sources["response_format"] = {"json_schema": fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}}
        elif fmt is not None and fmt.type == "json_object":
            sources["response_format"] = {"json_object": True}
        guided = {k: v for k, v in (("json_schema", self.guided_json), ("regex", self.guided_regex), ("grammar", self.guided_grammar),
                                    ("choice", self.guided_choice)) if v is not None}
        if guided:
            sources["guided_*"] = guided
        so = self.structured_outputs
        if so is not None:
            given = so.sampling_fields()
            if given:
                sources["structured_outputs"] = given
        if len(sources) > 1:
            raise FasterLlamaError(f"give one of response_format, the guided_* fields and structured_outputs, got {' and '.join(sources)}")
        return next(iter(sources.values()), {})


Prompt = str | list[int]


class CompletionRequest(GenerationRequest):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked below for a clear message
    max_tokens: int | None = Field(None, ge=0)  # (0 only with echo: the prompt alone, scored)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> list[Prompt]:
        """Normalized to a list of prompts, each a string or a list of token ids."""

        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)

        if isinstance(v, str):
            prompts: list[Any] = [v]
        elif is_ids(v):
            prompts = [v]
        elif isinstance(v, list) and v and (all(isinstance(p, str) for p in v) or all(is_ids(p) for p in v)):
            prompts = v
        else:
            raise ValueError("prompt must be a string, a list of strings, a non-empty list of token ids, or a list of such lists")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return prompts

    refused: ClassVar[dict[str, Any]] = {**REFUSED, "add_special_tokens": True}

    @property
    def num_prompt_logprobs(self) -> int | None:
        """prompt_logprobs, or with echo the logprobs the echoed prompt shows (the larger)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _refuse("min_tokens", f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        if self.max_tokens == 0 and not self.echo:
            raise _refuse("max_tokens", "max_tokens must be at least 1 (0 only with echo: the prompt alone)")
        if self.suffix:
            raise _refuse("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise _refuse("best_of", "best_of other than n is not supported")
        return self


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object (absent: no arguments)
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(f"a function's parameters must be a JSON schema of type 'object', got type {v.get('type')!r}")
        return v


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(_Strict):
    """One message; fields beyond OpenAI's (name, tool_calls, tool_call_id, reasoning_content...)
    are kept for the template, which conversation.py checks and renders as LLM.chat does."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v: str | list[ContentPart] | None) -> str | list[dict[str, str]]:
        """Text parts as {"type": "text", "text"} (an assistant's refusal parts are text too),
        joined or kept as the template reads them (conversation.py); other part types (images,
        audio) are refused."""
        if v is None or isinstance(v, str):
            return v or ""
        texts = []
        for part in v:
            if part.type not in ("text", "refusal"):
                raise ValueError(f"content parts of type {part.type!r} are not supported (text only)")
            text = part.text if part.type == "text" else getattr(part, "refusal", None)
            if not isinstance(text, str):
                raise ValueError(f"a content part of type {part.type!r} needs its {part.type!r} string")
            texts.append(text)
        return [{"type": "text", "text": text} for text in texts]

    def template_dict(self) -> dict[str, Any]:
        """The message for conversation.py. An assistant's content sent as null or left out is
        empty (as transformers renders it, not "None": OpenAI makes it optional there); another
        role's is missing, which conversation.py refuses, as OpenAI does."""
        message = self.model_dump(exclude_none=True, exclude={"content"})
        if self.content is not None or self.role == "assistant":
            message["content"] = self.content or ""
        return message


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: Any = None  # (OpenAI's deprecated form of tools: refused, below)
    function_call: Any = None
    # vLLM's extras for the chat template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        """One message for every wrong shape (the union's own errors named the wrong member)."""
        if v in ("none", "auto", "required"):
            return v
        function = v.get("function") if isinstance(v, dict) else None
        if isinstance(v, dict) and v.get("type") == "function" and isinstance(function, dict) and isinstance(function.get("name"), str):
            return v
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            Tokenizer.check_template_variables(v or {}, "chat_template_kwargs")
        except FasterLlamaError as e:
            raise ValueError(str(e)) from None
        return v

    modalities: list[str] | None = None
    best_of: int | None = None

    # (OpenAI's audio output and web search: answered with plain text they would ask another question)
    refused: ClassVar[dict[str, Any]] = {**REFUSED, "add_special_tokens": False, "echo": False, "audio": None, "web_search_options": None}

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise _refuse("modalities", f"modalities other than text are not supported, got {self.modalities}")
        if self.best_of is not None and self.best_of != self.n:
            raise _refuse("best_of", "best_of other than n is not supported")
        if self.min_tokens and self.requested_max_tokens is not None and self.min_tokens > self.requested_max_tokens:
            raise _refuse("min_tokens", f"min_tokens ({self.min_tokens}) must be at most {self.max_tokens_name} ({self.requested_max_tokens})")
        if self.functions is not None or self.function_call is not None:
            raise _refuse("functions" if self.functions is not None else "function_call",
                          "functions and function_call (OpenAI's deprecated form) are not supported: use tools and tool_choice")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise _refuse("tools", f"tools name a function twice: {sorted({n for n in names if names.count(n) > 1})}")
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
            if not names:
                raise _refuse("tool_choice", "tool_choice \"required\" or a named function needs tools")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise _refuse("tool_choice", f"tool_choice names function {self.tool_choice.function.name!r}, which is not in tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise _refuse("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.stream and self.prompt_logprobs is not None:  # (as vLLM: they would come with no chunk)
            raise _refuse("prompt_logprobs", "prompt_logprobs are not available when stream is true")
        return self

    @property
    def tool_mode(self) -> str | None:
        """How tools are called: None (no tools, or tool_choice "none"), "auto", "required", or
        "named" (the function forced_function names: one may be called "auto")."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def forced_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def param_of(self, message: str) -> str | None:
        """As for any request; a forced call's constraint that cannot compile is the tools' fault."""
        param = super().param_of(message)
        if param is None and self.tool_mode not in (None, "auto") and "constraint" in message:
            return "tools"
        return param

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (OpenAI's shape, unset fields left out)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools is not None else None  # ([]: given, as vLLM passes it)

    def _constraint(self) -> dict[str, Any]:
        """A forced call ("required" or a named function) constrains the reply to the call's JSON
        (tools.py), which no other constraint may change."""
        given = super()._constraint()
        mode = self.tool_mode
        if mode is None or mode == "auto":
            return given
        if given:
            raise FasterLlamaError("tool_choice \"required\" or a named function does not combine with response_format, "
                                   "the guided_* fields or structured_outputs")
        parameters = {t.function.name: t.function.parameters for t in self.tools or []}
        return {"json_schema": forced_call_schema(parameters, mode, self.parallel_tool_calls, self.forced_function)}

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_name(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        """The engine's logprobs count: top_logprobs (0 when only logprobs is true) or None."""
        return (self.top_logprobs or 0) if self.logprobs else None
