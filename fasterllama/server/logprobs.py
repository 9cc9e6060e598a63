"""Token log-probabilities in the two OpenAI shapes.

The engine gives one {token id: logprob} dict per generated token (the chosen token plus the
top N). /v1/completions wants `{tokens, token_logprobs, top_logprobs, text_offset}` lists (with
echo, the prompt's tokens first: null for the first); /v1/chat/completions wants
`content: [{token, logprob, bytes, top_logprobs: [...]}]`; vLLM's prompt_logprobs are one
{token id: {logprob, rank, decoded_token}} a prompt token (null for the first)."""

from __future__ import annotations

import codecs
import re
from typing import Any

from ..tokenizer import Tokenizer, bytes_to_unicode

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_FLOOR = -9999.0  # JSON has no -inf


def _finite(logprob: float) -> float:
    return max(_FLOOR, logprob)


class TokenTexts:
    """Each token's text and exact bytes (cached). A token holding part of a UTF-8 character
    decodes to U+FFFD as text, but its bytes are the real ones."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer.backend, "decoder", None) if tokenizer else None
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._unicode_to_byte = {c: b for b, c in bytes_to_unicode().items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        if self.tokenizer is None:
            return f"<{token_id}>", b""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self.tokenizer.backend.id_to_token(token_id) or ""
        if self._byte_level and piece and all(c in self._unicode_to_byte for c in piece):
            return text, bytes(self._unicode_to_byte[c] for c in piece)
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return text, bytes([int(m.group(1), 16)])
        return text, text.encode("utf-8")

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


class CompletionLogprobs:
    """Accumulates /v1/completions logprobs for one choice (text_offset runs across chunks).

    A token holding part of a UTF-8 character is named by its bytes, as OpenAI names it
    ("bytes:\\xf0\\x9f"): its text alone would be U+FFFD, the same key for every such token in
    top_logprobs. text_offset counts the characters of the text before each token, a character
    counted where its last byte comes."""

    def __init__(self, tokens: TokenTexts, as_ids: bool = False) -> None:
        self.tokens = tokens
        self.as_ids = as_ids
        self.offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.all: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _name(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        text, raw = self.tokens.get(token_id)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text

    def add(self, token_ids: list[int], logprobs: list[dict[int, float] | None], top_n: int | None = None,
            zero_width: int = 0) -> dict[str, list[Any]]:
        """The entries of these tokens (also kept for the whole response); a token without logprobs
        (a prompt's first) has null ones. top_n: the alternatives shown, where the dicts hold more;
        zero_width: leading tokens whose text the text does not hold (a BOS the tokenizer added to
        an echoed prompt)."""
        part: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, (tok, top) in enumerate(zip(token_ids, logprobs)):
            part["tokens"].append(self._name(tok))
            part["token_logprobs"].append(None if top is None else _finite(top[tok]))
            if top is not None and top_n is not None:
                top = dict(sorted(top.items(), key=lambda kv: -kv[1])[:top_n]) | {tok: top[tok]}
            part["top_logprobs"].append(None if top is None else {self._name(t): _finite(lp) for t, lp in top.items()})
            part["text_offset"].append(self.offset)
            if i >= zero_width:
                self.offset += len(self._utf8.decode(self.tokens.get(tok)[1]))
        for key, values in part.items():
            self.all[key].extend(values)
        return part


def chat_logprobs(tokens: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]], top_n: int,
                  as_ids: bool = False) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` entries of these tokens, each with its top_n alternatives
    (as_ids: each token named "token_id:<id>", vLLM's return_tokens_as_token_ids)."""

    def entry(tok: int, lp: float) -> dict[str, Any]:
        text, raw = tokens.get(tok)
        return {"token": f"token_id:{tok}" if as_ids else text, "logprob": _finite(lp), "bytes": list(raw)}

    out = []
    for tok, top in zip(token_ids, logprobs):
        best = sorted(top.items(), key=lambda kv: -kv[1])[:top_n]  # top holds the true top N plus the chosen token
        out.append({**entry(tok, top[tok]), "top_logprobs": [entry(t, lp) for t, lp in best]})
    return out


def prompt_logprobs(tokens: TokenTexts, entries: list[dict[int, Any] | None]) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token, null (the first) or {token id: {logprob, rank,
    decoded_token}} of the token and the top N (keyed by id: decoded_token is the text, also
    under return_tokens_as_token_ids, as vLLM's)."""
    return [None if e is None else {str(t): {"logprob": _finite(lp), "rank": getattr(lp, "rank", None), "decoded_token": tokens.text(t)}
                                    for t, lp in e.items()} for e in entries]
