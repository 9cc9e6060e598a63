"""Chat conversations: checked and normalized as transformers hands messages to a chat template,
then rendered to prompt ids. One path for the Python API (LLM.chat) and the server."""

from __future__ import annotations

import json
import re
from typing import Any

from .engine.llm_engine import check_text
from .errors import FasterLlamaError
from .tokenizer import Tokenizer

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # (developer: OpenAI's newer name for system)


def _kind(value: object) -> str:
    return "None" if value is None else type(value).__name__


def check_messages(messages: object, content_format: str = "string") -> list[dict[str, Any]]:
    """One conversation: a non-empty list of {"role": ..., "content": ...} dicts, as transformers
    hands them to a chat template: keys set to None dropped (the OpenAI client sends
    "tool_calls": None), any of "reasoning_content", "thinking" and "reasoning" given under the
    first two too (transformers'); content a string, OpenAI's list of text parts (content_format
    "string": joined by newlines, as vLLM joins them; "openai": kept as parts, a string made one),
    or absent / None on an assistant's tool calls (a tool's result may be JSON; a call's arguments
    sent as JSON text are parsed); role "developer" is "system". Checked here so a missing content
    is one clear error, not a KeyError in the chat template."""
    if not isinstance(messages, (list, tuple)):
        raise FasterLlamaError(f"a conversation must be a list of message dicts, got {_kind(messages)}")
    if not messages:
        raise FasterLlamaError("a conversation must have at least one message, got an empty list")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise FasterLlamaError(f"message {i} must be a dict with 'role' and 'content', got {_kind(m)}")
        m = {k: v for k, v in m.items() if v is not None}
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise FasterLlamaError(f"message {i}: role must be a non-empty string ({', '.join(CHAT_ROLES)}, ...), got {role!r}")
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
        if reasoning is not None:
            m = {"reasoning_content": reasoning, "thinking": reasoning, **m}
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_call_with_parsed_arguments(c) for c in m["tool_calls"]]
        if "content" not in m:
            if role == "assistant" and m.get("tool_calls"):
                checked.append(m)
                continue
            raise FasterLlamaError(f"message {i} ({role}) has no 'content'")
        content = m["content"]
        parts = isinstance(content, list) and content and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                                               for p in content)
        if parts:
            content = "\n".join(p["text"] for p in content)  # OpenAI's content parts, text only
        if role in ("tool", "ipython") and isinstance(content, (dict, list)):
            checked.append({**m, "content": content})  # (a tool's JSON result: templates tojson it)
            continue
        if not isinstance(content, str):
            other = next((p.get("type") for p in content if isinstance(p, dict) and p.get("type") != "text"), None) if isinstance(content, list) else None
            if other is not None:  # (an image or audio part: say so, not just "a list")
                raise FasterLlamaError(f"message {i} ({role}): content parts of type {other!r} are not supported (text only)")
            raise FasterLlamaError(f"message {i} ({role}): content must be a string (or a list of text parts), got {_kind(m['content'])}")
        check_text(content, f"message {i} ({role})")
        if content_format == "openai":
            content = [{"type": "text", "text": p["text"]} for p in m["content"]] if parts else [{"type": "text", "text": content}]
        checked.append({**m, "role": "system" if role == "developer" else role, "content": content})
    return checked


def _call_with_parsed_arguments(call: Any) -> Any:
    """An earlier tool call with its arguments as an object: OpenAI's clients send them back as the
    JSON text the API returned, and templates write them with `tojson` (as text they rendered
    twice encoded, a form the model never saw); vLLM parses them likewise."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": parsed}} if isinstance(parsed, dict) else call


_LOOPS_OVER_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+\s*(\.\s*content|\[\s*['\"]content['\"]\s*\])\s*(\||-?%\})")


def content_format_of(template: str) -> str:
    """"openai" for a template that loops over a message's content (its list of parts), else
    "string": vLLM's "auto" choice (a template written for parts rendered a string as nothing)."""
    return "openai" if _LOOPS_OVER_CONTENT.search(template) else "string"


def chat_prompt_ids(tokenizer: Tokenizer | None, messages: object, add_generation_prompt: bool = True,
                    chat_template_kwargs: dict[str, Any] | None = None, *, chat_template: str | None = None,
                    continue_final_message: bool = False, tools: list[Any] | None = None, content_format: str = "auto",
                    add_special_tokens: bool = False) -> list[int]:
    """Token ids of one conversation rendered by the model's chat template, or `chat_template`
    (messages checked); chat_template_kwargs: more variables for the template (enable_thinking...);
    continue_final_message: the last message's turn left open (add_generation_prompt=False);
    tools: the functions the template describes to the model; content_format: check_messages',
    or "auto": the template's (content_format_of); add_special_tokens: the text encoded with the
    tokenizer's own BOS/EOS too (vLLM's option: a template writes its own)."""
    if tokenizer is None:
        raise FasterLlamaError("this model has no tokenizer, so it cannot chat")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise FasterLlamaError(f"chat_template_kwargs must be a dict, got {_kind(chat_template_kwargs)}")
    if chat_template is not None and not isinstance(chat_template, str):
        raise FasterLlamaError(f"chat_template must be the template's text, got {_kind(chat_template)}")
    extra = dict(chat_template_kwargs or {})
    Tokenizer.check_template_variables(extra, "chat_template_kwargs")
    if tools is not None:
        extra["tools"] = tools
    if content_format == "auto":
        content_format = content_format_of(tokenizer.resolve_template(chat_template, tools))
    rendered = tokenizer.apply_chat_template(check_messages(messages, content_format), add_generation_prompt=bool(add_generation_prompt),
                                             tokenize=not add_special_tokens, chat_template=chat_template,
                                             continue_final_message=bool(continue_final_message), **extra)
    return tokenizer.encode(rendered, add_special_tokens=True) if add_special_tokens else rendered
