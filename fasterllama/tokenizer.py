"""Tokenizer: HF-identical encode/decode built with the `tokenizers` library, chat templates
rendered with jinja2 the way transformers renders them, and incremental detokenization."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from numbers import Integral
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from .config import read_json_object
from .errors import FasterLlamaError, ModelLoadError

# GGUF token types (llama.cpp's llama_token_type).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# Pre-tokenizer splits named by a GGUF's `tokenizer.ggml.pre`, as llama.cpp applies them: each
# pattern splits the pieces the one before it made. Any other name splits as GPT-2 does.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (  # Mistral-Nemo's: CamelCase words apart, one digit a piece
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), (_LLAMA3_SPLIT,)),
    "tekken": (_TEKKEN_SPLIT,),
    # StarCoder's family (SmolLM's tokenizer.json: Digits(individual) then ByteLevel): every digit
    # a piece first, so "a  1" is "a", "  ", "1" (GPT-2's split alone: "a", " ", " 1")
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), (r"\p{N}", _GPT2_SPLIT)),
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a sentencepiece vocabulary: every split of a token into two known
    tokens is a merge, ranked by the merged token's score (higher merges first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], pre: str | None, raw: Sequence[int] = ()) -> BackendTokenizer:
    """GPT-2 style byte-level BPE (LLaMA-3, SmolLM, ...). A token outside the byte alphabet is
    spelled in it, except those in `raw` (special tokens written as text, which match as added
    tokens: DeepSeek's "<｜User｜>")."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    raw = set(raw)
    vocab = {
        t if set(t) <= alphabet or i in raw else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    merge_pairs = [tuple(m.split(" ")) for m in merges]
    tok = BackendTokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False))
    splits = _PRE_TOKENIZER_SPLITS.get(pre or "", (_GPT2_SPLIT,))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_bpe(tokens: Sequence[str], scores: Sequence[float], merges: Sequence[str] | None = None, legacy: bool = False,
                      space_prefix: bool = True) -> BackendTokenizer:
    """LLaMA-1/2 style sentencepiece BPE with byte fallback, as HF's LlamaTokenizer builds it
    (legacy: as its "legacy": true builds it, with "▁" before the text after each special token;
    space_prefix false: no "▁" before the text at all, as a GGUF's add_space_prefix = false says)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merge_pairs = [tuple(m.split(" ")) for m in merges] if merges else merges_from_scores(tokens, scores)
    tok = BackendTokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=True, byte_fallback=True, unk_token=tokens[0] if tokens else None))
    scheme = ("always" if legacy else "first") if space_prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    strip = [decoders.Strip(content=" ", left=1)] if space_prefix else []  # (the prefix's space, taken off again)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """encode/decode/apply_chat_template with the same results as the HF tokenizer of the model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        add_bos_token: bool | None,
        add_eos_token: bool | None,
        extra_tokens: dict[str, str | None] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token, **(extra_tokens or {})}
        self.named_templates: dict[str, str] = {}  # a folder's other chat templates by name ("tool_use")
        if add_bos_token is not None or add_eos_token is not None or backend.post_processor is None:
            adds_bos, adds_eos = self._post_processor_adds()  # (a flag left unset keeps what the file's post-processor does)
            self._set_template(adds_bos if add_bos_token is None else bool(add_bos_token),
                               adds_eos if add_eos_token is None else bool(add_eos_token))

    @property
    def adds_bos(self) -> bool:
        """Whether encode(add_special_tokens=True) puts BOS first."""
        return self._post_processor_adds()[0]

    def _post_processor_adds(self) -> tuple[bool, bool]:
        """Whether the backend's own post-processor puts BOS first / EOS last (False, False without one)."""
        if self.backend.post_processor is None:
            return False, False
        plain, special = (self.backend.encode("a", add_special_tokens=flag).ids for flag in (False, True))
        bos, eos = (None if t is None else self.backend.token_to_id(t) for t in (self.bos_token, self.eos_token))
        return (bos is not None and special[:1] == [bos] != plain[:1]), (eos is not None and special[-1:] == [eos] != plain[-1:])

    def _set_template(self, add_bos: bool, add_eos: bool) -> None:
        """Make encode(add_special_tokens=True) add BOS/EOS exactly as the model's settings say."""
        if add_bos and self.bos_token is None:
            add_bos = False
        if add_eos and self.eos_token is None:
            add_eos = False
        single = " ".join(([f"{self.bos_token}:0"] if add_bos else []) + ["$A:0"] + ([f"{self.eos_token}:0"] if add_eos else []))
        pair = single + " " + " ".join(([f"{self.bos_token}:1"] if add_bos else []) + ["$B:1"] + ([f"{self.eos_token}:1"] if add_eos else []))
        special = []
        for use, token in ((add_bos, self.bos_token), (add_eos, self.eos_token)):
            if use and token is not None:
                if self.backend.token_to_id(token) is None:
                    raise ModelLoadError(f"the tokenizer adds {token!r} to every prompt, but its vocabulary has no such token")
                special.append((token, self.backend.token_to_id(token)))
        self.backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
        self.add_bos_token = add_bos

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, fields: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata fields (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""

        def get(key: str, default: Any = None) -> Any:
            f = fields.get(key)
            return default if f is None else f.contents()

        kind = get("tokenizer.ggml.model")
        tokens = get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError("GGUF file has no tokenizer vocabulary")
        token_types = list(get("tokenizer.ggml.token_type") or [])
        if not token_types:  # (a file without them: its bos, eos and unknown tokens are special still, as HF makes them)
            token_types = [1] * len(tokens)
            for key in ("bos_token_id", "eos_token_id", "unknown_token_id"):
                if isinstance(idx := get(f"tokenizer.ggml.{key}"), int) and 0 <= idx < len(tokens):
                    token_types[idx] = _UNKNOWN if key == "unknown_token_id" else _CONTROL
        merges = get("tokenizer.ggml.merges")
        added = [i for i, ty in enumerate(token_types) if ty in (_UNKNOWN, _CONTROL, _USER_DEFINED)]  # (llama.cpp writes them as text)
        if kind == "gpt2":
            if not merges:  # (without them every word falls apart into bytes: llama.cpp refuses such a file too)
                raise ModelLoadError("GGUF file's gpt2 (BPE) tokenizer has no merges (tokenizer.ggml.merges)")
            backend = byte_level_bpe(tokens, merges, get("tokenizer.ggml.pre"), raw=added)
            add_bos_default = False
        elif kind == "llama":
            backend = sentencepiece_bpe(tokens, get("tokenizer.ggml.scores") or [0.0] * len(tokens), merges,
                                        space_prefix=bool(get("tokenizer.ggml.add_space_prefix", True)))
            add_bos_default = True
        else:
            raise ModelLoadError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
        # special, as in llama.cpp (and as HF's GGUF reader makes unk, bos and eos): control tokens and the unknown token
        backend.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in added if token_types[i] != _USER_DEFINED])
        vocab = backend.get_vocab()
        backend.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in added if token_types[i] == _USER_DEFINED and tokens[i] in vocab])

        def token(key: str) -> str | None:
            idx = get(f"tokenizer.ggml.{key}")
            return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

        add_bos = get("tokenizer.ggml.add_bos_token")
        return cls(
            backend,
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            chat_template=get("tokenizer.chat_template"),
            add_bos_token=add_bos_default if add_bos is None else bool(add_bos),
            add_eos_token=bool(get("tokenizer.ggml.add_eos_token", False)),
            extra_tokens={"unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")},
        )

    @classmethod
    def from_folder(cls, path: str) -> Tokenizer:
        """Build from a HF folder: tokenizer.json or tokenizer.model, plus tokenizer_config.json."""
        cfg = _json_object(os.path.join(path, "tokenizer_config.json"))
        cfg.update(_json_object(os.path.join(path, "special_tokens_map.json")))  # (its tokens win, as transformers reads them)
        json_path = os.path.join(path, "tokenizer.json")
        sp_path = os.path.join(path, "tokenizer.model")
        if os.path.isfile(json_path):
            try:
                backend = BackendTokenizer.from_file(json_path)
            except Exception as e:
                raise ModelLoadError(f"{json_path}: cannot read tokenizer ({e})") from None
            if cfg.get("add_prefix_space") is False and str(cfg.get("tokenizer_class") or "Llama").startswith("Llama"):  # (the class that reads it)
                backend = _without_space_prefix(backend)
            add_bos_default = None
        elif os.path.isfile(sp_path):
            backend = _sentencepiece_file_backend(sp_path, legacy=cfg.get("legacy") is True, space_prefix=cfg.get("add_prefix_space") is not False)
            _add_folder_tokens(backend, path, cfg)
            add_bos_default = True
        else:
            raise ModelLoadError(f"{path}: no tokenizer.json or tokenizer.model")
        template = cfg.get("chat_template")
        named: dict[str, str] = {}
        if isinstance(template, list):  # named templates ("default", "tool_use", ...)
            named = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t and "template" in t}
            template = named.get("default", template[0]["template"])
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_path):  # (the newer place: it wins, as in transformers)
            with open(jinja_path, encoding="utf-8") as fh:
                template = fh.read()
        more = os.path.join(path, "additional_chat_templates")  # (transformers' folder of named ones: NAME.jinja)
        if os.path.isdir(more):
            for name in sorted(os.listdir(more)):
                if name.endswith(".jinja"):
                    with open(os.path.join(more, name), encoding="utf-8") as fh:
                        named[name.removesuffix(".jinja")] = fh.read()
        if template is not None:
            named["default"] = template  # (the one in use, named as transformers names it)
        add_bos = cfg.get("add_bos_token", add_bos_default)
        tok = cls(
            backend,
            bos_token=_token_str(cfg.get("bos_token")),
            eos_token=_token_str(cfg.get("eos_token")),
            chat_template=template,
            add_bos_token=add_bos,
            add_eos_token=cfg.get("add_eos_token"),
            extra_tokens={k: _token_str(cfg.get(k)) for k in ("unk_token", "pad_token", "sep_token", "cls_token", "mask_token")},
        )
        tok.named_templates = named
        return tok

    # -- encode / decode --------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int] | int, skip_special_tokens: bool = False) -> str:
        ids = [int(ids)] if isinstance(ids, Integral) else [int(i) for i in ids]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- transformers' spellings (what scripts call on vLLM's get_tokenizer()) ----------------
    def __call__(self, text: str | list[str], add_special_tokens: bool = True, return_tensors: str | None = None) -> Encoding:
        """{"input_ids", "attention_mask"} of a text (or of each of a list of texts, of one length
        where return_tensors="pt": [batch, length] tensors, as transformers gives them unpadded)."""
        if return_tensors not in (None, "pt"):
            raise FasterLlamaError(f"return_tensors must be None or 'pt', got {return_tensors!r}")
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            enc = Encoding(input_ids=ids, attention_mask=[1] * len(ids))
            return enc if return_tensors is None else _as_tensors(Encoding(input_ids=[ids], attention_mask=[enc["attention_mask"]]))
        ids_list = [self.encode(t, add_special_tokens) for t in text]
        enc = Encoding(input_ids=ids_list, attention_mask=[[1] * len(ids) for ids in ids_list])
        return enc if return_tensors is None else _as_tensors(enc)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        return self.get_vocab()

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).tokens

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        return self.backend.id_to_token(int(ids)) if isinstance(ids, Integral) else [self.backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """Ids of tokens; an unknown one is the unk token's id, as in transformers (None without one)."""

        def one(t: str) -> int | None:
            found = self.token_to_id(t)
            return self.unk_token_id if found is None else found

        return one(tokens) if isinstance(tokens, str) else [one(t) for t in tokens]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        return self.backend.decoder.decode(list(tokens)) if self.backend.decoder is not None else "".join(tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens.get("unk_token")

    @property
    def unk_token_id(self) -> int | None:
        return self.token_to_id(self.unk_token)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {k: v for k, v in self.special_tokens.items() if v is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for t in self.all_special_tokens if (i := self.token_to_id(t)) is not None]

    def output_context(self, prompt: Sequence[int], skip_special_tokens: bool = False) -> list[int]:
        """The prompt's last tokens an output is read after (at most IncrementalDetokenizer.CONTEXT),
        whole characters only: tokens ending inside a character (a byte-fallback or byte-level
        token's part) are left out, else the output's first bytes would complete them."""
        context = list(prompt[-IncrementalDetokenizer.CONTEXT :])
        while context and self.decode(context, skip_special_tokens).startswith("\ufffd"):
            context.pop(0)
        while context and (context[-1] in self.byte_token_ids or self.decode(context, skip_special_tokens).endswith("\ufffd")):
            context.pop()
        return context

    @cached_property
    def byte_token_ids(self) -> frozenset[int]:
        """The byte-fallback tokens (<0x41>) of a SentencePiece vocabulary: a run of them decodes as
        a whole (one replacement character a byte where the run is not UTF-8), so text read
        before a run ends may change after it."""
        if not getattr(self.backend.model, "byte_fallback", False):
            return frozenset()
        return frozenset(i for t, i in self.backend.get_vocab(with_added_tokens=False).items() if len(t) == 6 and t.startswith("<0x") and t.endswith(">"))

    def decode_continuation(self, ids: Sequence[int], prompt: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ids as they follow the prompt, as the incremental detokenizer shows an
        output: a SentencePiece "▁yes" is " yes" there, "yes" decoded alone."""
        before = self.output_context(prompt, skip_special_tokens)
        head = self.decode(before, skip_special_tokens)
        whole = self.decode(before + list(ids), skip_special_tokens)
        return whole[len(head) :] if whole.startswith(head) else self.decode(ids, skip_special_tokens)

    # -- chat templates ---------------------------------------------------------------------
    @staticmethod
    def check_template_variables(variables: dict[str, Any], what: str) -> None:
        """Extra template variables (chat_template_kwargs) that would name an argument of
        apply_chat_template are refused: passed on, they raised a TypeError."""
        taken = sorted(set(variables) & {"messages", "add_generation_prompt", "tokenize", "chat_template", "continue_final_message"})
        if taken:
            raise FasterLlamaError(f"{what}: {', '.join(taken)} are arguments of the chat call, not template variables")

    def resolve_template(self, chat_template: str | None = None, tools: object = None) -> str:
        """The template's text: `chat_template` (or a folder's template of that name, as
        transformers takes it), else "tool_use" where tools are given and the model has one, else
        the model's own."""
        template = self.named_templates.get(chat_template, chat_template)
        if template is None:
            template = (self.named_templates.get("tool_use") if tools is not None else None) or self.chat_template
        if not template:
            raise FasterLlamaError("this model has no chat template; use plain generation instead")
        return template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        return_dict: bool = False,
        return_tensors: str | None = None,
        **kwargs: Any,
    ) -> str | list[int] | Encoding:
        """Render messages with the model's template, or `chat_template` (as transformers does,
        with its defaults); ids if tokenize (as transformers gives them: return_dict, an Encoding;
        return_tensors="pt", [1, length] tensors). continue_final_message: the text ends where the
        last message's content does, its turn left open for the model to go on (transformers' rule)."""
        if return_tensors not in (None, "pt"):
            raise FasterLlamaError(f"return_tensors must be None or 'pt', got {return_tensors!r}")
        template = self.resolve_template(chat_template, kwargs.get("tools"))
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise FasterLlamaError("each chat message must be a dict with 'role' and 'content'")
        if continue_final_message and add_generation_prompt:
            raise FasterLlamaError("continue_final_message and add_generation_prompt do not combine (the last turn is the one continued)")
        special = {k: v for k, v in self.special_tokens.items() if v is not None}  # (an unset token is undefined: renders as "")
        variables = {"tools": None, "documents": None, **special, **kwargs}  # (transformers passes tools and documents, None if not given)
        if continue_final_message:
            messages = _tag_final_message(messages)
        try:
            text = _compiled_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except FasterLlamaError:
            raise
        except Exception as e:  # (jinja2's UndefinedError, a TypeError on a value the template does not expect...)
            raise FasterLlamaError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None
        if continue_final_message:  # the text ends where the tag after the last message's content starts
            at = text.rfind(CONTINUE_TAG.strip())
            if at < 0:
                raise FasterLlamaError("continue_final_message needs a last message whose text content the template renders")
            text = text[:at] if text.startswith(CONTINUE_TAG, at) else text[:at].rstrip()  # (a template that trims took the space)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        if not return_dict and return_tensors is None:
            return ids
        enc = Encoding(input_ids=[ids], attention_mask=[[1] * len(ids)]) if return_tensors else Encoding(input_ids=ids, attention_mask=[1] * len(ids))
        enc = _as_tensors(enc) if return_tensors else enc
        return enc if return_dict else enc["input_ids"]


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # (transformers' own)


def _tag_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with a tag after the last message's text (its last text part), found again in
    the rendered text: where the content itself ends ("<" also ends "<|eot_id|>")."""
    final = dict(messages[-1]) if messages else {}
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + CONTINUE_TAG
    elif isinstance(content, list) and any(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        last = max(i for i, p in enumerate(content) if isinstance(p, dict) and isinstance(p.get("text"), str))
        final["content"] = [*content[:last], {**content[last], "text": content[last]["text"] + CONTINUE_TAG}, *content[last + 1 :]]
    else:
        raise FasterLlamaError("continue_final_message needs a last message with text content to continue")
    return [*messages[:-1], final]


class Encoding(dict):
    """What calling a tokenizer returns, as transformers' BatchEncoding: a dict, also read as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _as_tensors(enc: Encoding) -> Encoding:
    """A batch's lists as int64 torch tensors (return_tensors="pt"); rows of different lengths
    are an error, as in transformers without padding."""
    import torch

    if len({len(row) for row in enc["input_ids"]}) > 1:
        raise FasterLlamaError("return_tensors='pt' needs texts of one length in tokens (this tokenizer does not pad)")
    return Encoding({k: torch.tensor(v, dtype=torch.int64) for k, v in enc.items()})


def _json_object(path: str) -> dict[str, Any]:
    """A folder's JSON settings file ({} where there is none)."""
    return read_json_object(path) if os.path.isfile(path) else {}


def _without_space_prefix(backend: BackendTokenizer) -> BackendTokenizer:
    """A SentencePiece-style tokenizer.json under the folder's "add_prefix_space": false, as
    transformers rebuilds it: no "▁" put before the text (the Metaspace pre-tokenizer's or a
    Prepend normalizer's), and none stripped off again when decoding."""
    spec = json.loads(backend.to_str())

    def keep(node: dict[str, Any] | None, drop: dict[str, Any] | None = None) -> dict[str, Any] | None:
        if node is None or (drop is not None and all(node.get(k) == v for k, v in drop.items())):
            return None
        if node.get("type") == "Metaspace":
            node["prepend_scheme"] = "never"
            if "add_prefix_space" in node:  # (older files' form of it)
                node["add_prefix_space"] = False
        for key in ("normalizers", "pretokenizers", "decoders"):
            if key in node:
                node[key] = [n for n in (keep(n, drop) for n in node[key]) if n is not None]
        return node

    spec["normalizer"] = keep(spec.get("normalizer"), {"type": "Prepend", "prepend": "▁"})
    spec["pre_tokenizer"] = keep(spec.get("pre_tokenizer"))
    spec["decoder"] = keep(spec.get("decoder"), {"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return BackendTokenizer.from_str(json.dumps(spec))


def _add_folder_tokens(backend: BackendTokenizer, path: str, cfg: dict[str, Any]) -> None:
    """The tokens a tokenizer.model folder adds beyond the sentencepiece vocabulary (added_tokens.json,
    tokenizer_config.json's added_tokens_decoder: ChatML's <|im_start|> in an OpenHermes-style
    folder), at the ids they name, special where the folder says so, as transformers adds them."""
    specials = {_token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    specials |= {_token_str(t) for t in cfg.get("additional_special_tokens") or []}
    by_id: dict[int, AddedToken] = {}
    try:
        for content, idx in _json_object(os.path.join(path, "added_tokens.json")).items():
            by_id[int(idx)] = AddedToken(content, normalized=False, special=content in specials)
        for idx, entry in (cfg.get("added_tokens_decoder") or {}).items():
            if isinstance(entry, dict) and isinstance(entry.get("content"), str):
                by_id[int(idx)] = AddedToken(entry["content"], single_word=bool(entry.get("single_word")), lstrip=bool(entry.get("lstrip")),
                                             rstrip=bool(entry.get("rstrip")), normalized=bool(entry.get("normalized")),
                                             special=bool(entry.get("special", entry["content"] in specials)))
    except (TypeError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"{path}: bad added tokens ({e})") from None
    pieces = backend.get_vocab_size(with_added_tokens=False)
    for idx in sorted(by_id):
        token = by_id[idx]
        if backend.token_to_id(token.content) is not None:  # a piece the model has: only marked special (at its own id)
            if token.special:
                backend.add_special_tokens([token])
            continue
        if idx < pieces:
            raise ModelLoadError(f"{path}: added token {token.content!r} at id {idx}, which the vocabulary's {backend.id_to_token(idx)!r} holds")
        if idx != backend.get_vocab_size(with_added_tokens=True):
            raise ModelLoadError(f"{path}: added token {token.content!r} at id {idx} leaves a gap after the vocabulary's "
                                 f"{backend.get_vocab_size(with_added_tokens=True)} tokens")
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
    for content in specials - {None}:  # named special pieces of the vocabulary itself
        if backend.token_to_id(content) is not None:
            backend.add_special_tokens([AddedToken(content, normalized=False, special=True)])


def _sentencepiece_file_backend(path: str, legacy: bool, space_prefix: bool = True) -> BackendTokenizer:
    """tokenizer.model (sentencepiece BPE) -> the same BPE + byte fallback HF converts it to
    (space_prefix false: the folder's "add_prefix_space": false, no "▁" before the text)."""
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=path)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot read sentencepiece model ({e})") from None
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [sp.get_score(i) for i in range(sp.get_piece_size())]
    backend = sentencepiece_bpe(tokens, scores, legacy=legacy, space_prefix=space_prefix)
    backend.add_special_tokens(
        [AddedToken(tokens[i], normalized=False, special=True) for i in range(len(tokens)) if sp.is_control(i) or sp.is_unknown(i)]
    )
    return backend


def _generation_tag() -> type:
    """`{% generation %}...{% endgeneration %}` (transformers' marker of the assistant's tokens, for
    training masks): rendered as its body."""
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return GenerationTag


@lru_cache(maxsize=8)
def _compiled_template(source: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise FasterLlamaError(f"chat template: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_tag()])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ModelLoadError(f"invalid chat template: {e}") from None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never end in a broken UTF-8 character.

    Decodes a small window (prefix..end) and emits what it adds beyond (prefix..read), so each
    step costs O(window) and multi-byte tokens are held until complete, a run of byte-fallback
    tokens until it ends (a later byte can make the whole run replacement characters). The window
    starts with the prompt's last tokens (`Tokenizer.output_context`, as vLLM's does): the first output token is
    read as it follows them, so a SentencePiece "▁yes" is " yes", not the "yes" of a text's start."""

    CONTEXT = 5  # prompt tokens before the output (vLLM's initial offset)

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = tokenizer.output_context(prompt, skip_special_tokens) if prompt else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._before_last = (0, 0, 0)  # (prefix_offset, read_offset, len(text)) before the last add: drop_last

    def add(self, token_id: int) -> str:
        self._before_last = (self.prefix_offset, self.read_offset, len(self.text))
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        new_text = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd") and token_id not in self.tokenizer.byte_token_ids:
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def drop_last(self) -> None:
        """Undo the last add (an ending token whose text is not the output's)."""
        self.prefix_offset, self.read_offset, kept = self._before_last
        self.ids.pop()
        self.text = self.text[:kept]

    def flush(self) -> str:
        """The text held back at the end (tokens that end inside a character: as decode shows them,
        replacement characters), so that the text is the decode of all the ids."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        new_text = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
