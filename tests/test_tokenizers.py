"""Tokenizers from every source match HF: sentencepiece GGUF vocab, tokenizer.model, tokenizer.json;
and incremental detokenization never emits broken UTF-8."""

from __future__ import annotations

import glob
import json
import os

import gguf
import numpy as np
import pytest

from fasterllama.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

STRINGS = [
    "Hello world",
    " leading space",
    "  two  spaces   ",
    "emoji 🤖🎉 done",
    "中文字符 and 日本語",
    "def f(x):\n\treturn x ** 2\n",
    "<s>special</s> tokens",
    "café naïve",
    "numbers 1234567 3.14",
    "\n\nnewlines\r\n",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
LLAMA2_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'system' %}{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    """A LLaMA-style sentencepiece BPE model (byte fallback) trained on the license texts."""
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("sp")
    corpus = d / "corpus.txt"
    texts = [open(p, encoding="utf-8", errors="ignore").read() for p in sorted(glob.glob("/usr/share/common-licenses/*")) if os.path.isfile(p)]
    corpus.write_text("\n".join(texts) or "hello world " * 1000, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(d / "m"), vocab_size=1000, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", add_dummy_prefix=True, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
    )
    return str(d / "m.model")


def _assert_same(ours: Tokenizer, hf, strings: list[str] = STRINGS) -> None:
    for s in strings:
        ids = hf(s)["input_ids"]
        assert ours.encode(s) == ids, s
        assert ours.decode(ids) == hf.decode(ids), s
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), s


def test_output_text_is_read_after_the_prompt(sp_model, tmp_path):
    """An output's text follows its prompt, as vLLM reads it: a SentencePiece "▁yes" first token is
    " yes" (decoded alone, "yes"); a prompt ending inside a character (byte-fallback tokens) leaves
    that character's bytes out of the context, so the output's own characters stay whole."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(open(sp_model, "rb").read())
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    tok = Tokenizer.from_folder(str(folder))
    byte = lambda b: tok.token_to_id(f"<0x{b:02X}>")  # noqa: E731
    hello, yes = tok.encode("Hello", add_special_tokens=False), tok.encode(" yes", add_special_tokens=False)
    assert tok.backend.id_to_token(yes[0]).startswith("▁") and tok.decode(yes) == "yes"
    nihao = [byte(b) for b in "好".encode()]
    for prompt, output, want in (([1, *hello], yes, " yes"), ([1, *hello, byte(0xE4), byte(0xBD)], nihao + yes, "好 yes"),
                                 ([1, *hello, byte(0xE4)], nihao + nihao + yes, "好好 yes"), ([1], yes, "yes")):
        detok = IncrementalDetokenizer(tok, True, prompt)
        streamed = "".join(detok.add(t) for t in output) + detok.flush()
        assert streamed == detok.text == tok.decode_continuation(output, prompt, True) == want, (prompt, output)


def test_a_byte_run_streams_as_it_decodes(sp_model, tmp_path):
    """A run of byte-fallback tokens decodes as a whole: "A" then a lone 0xE2 is two replacement
    characters, so the stream holds the run's "A" until the run ends (it sent "A" at once, and the
    output's text was not the decode of its ids)."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(open(sp_model, "rb").read())
    tok = Tokenizer.from_folder(str(folder))
    byte = lambda b: tok.token_to_id(f"<0x{b:02X}>")  # noqa: E731
    word = tok.encode(" the", add_special_tokens=False)
    for run in ([0x41, 0xE2], [0x41, 0xE4, 0xBD, 0xA0], [0x0B, 0xE2, 0x0B], [0xF0, 0x9F, 0x41]):
        for tail in (word, []):
            ids = word + [byte(b) for b in run] + tail
            detok = IncrementalDetokenizer(tok, True)
            deltas = [detok.add(t) for t in ids] + [detok.flush()]
            assert "".join(deltas) == detok.text == tok.decode(ids, True), (run, deltas)
    assert len(tok.byte_token_ids) == 256


@pytest.mark.parametrize("where", ["added_tokens.json", "added_tokens_decoder"])
def test_tokenizer_model_folder_with_added_tokens(sp_model, tmp_path, where):
    """An OpenHermes-style folder: tokenizer.model and ChatML's tokens past its vocabulary, named in
    added_tokens.json or tokenizer_config.json's added_tokens_decoder. They were left out: the chat
    prompt fell apart into bytes, EOS was None, and decode dropped them."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(open(sp_model, "rb").read())
    chatml = ["<|im_start|>", "<|im_end|>"]
    cfg = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "add_bos_token": True, "tokenizer_class": "LlamaTokenizer",
           "additional_special_tokens": chatml,
           "chat_template": "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"}
    if where == "added_tokens.json":
        (folder / "added_tokens.json").write_text(json.dumps({t: 1000 + i for i, t in enumerate(chatml)}))
    else:
        entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        cfg["added_tokens_decoder"] = {str(1000 + i): {"content": t, **entry} for i, t in enumerate(chatml)}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = Tokenizer.from_folder(str(folder))
    assert (len(ours), ours.eos_token_id, ours.token_to_id("<|im_start|>")) == (len(hf), hf.eos_token_id, 1000) == (1002, 1001, 1000)
    _assert_same(ours, hf, [s for s in STRINGS if "</s>" not in s])  # (no longer EOS, "</s>" is special to transformers 4, text to 5)
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.apply_chat_template(CHAT[1:2]) == hf.apply_chat_template(CHAT[1:2], tokenize=True, return_dict=False)
    for skip in (False, True):
        assert ours.decode([1000, 263, 1001], skip) == hf.decode([1000, 263, 1001], skip_special_tokens=skip)


@pytest.mark.parametrize("form", ["tokenizer.model", "tokenizer.json"])
def test_no_prefix_space(sp_model, tmp_path, form):
    """"add_prefix_space": false puts no "▁" before the text ("Hello" is not "▁Hello"), as transformers
    builds the tokenizer from either file; it was ignored."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(open(sp_model, "rb").read())
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "tokenizer_class": "LlamaTokenizer"}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    if form == "tokenizer.json":  # (as transformers saves one: a Metaspace prepending "▁" first)
        transformers.AutoTokenizer.from_pretrained(str(folder)).save_pretrained(str(folder))
        os.remove(folder / "tokenizer.model")
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_prefix_space": False}))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = Tokenizer.from_folder(str(folder))
    _assert_same(ours, hf)
    assert ours.tokenize("Hello") == hf.tokenize("Hello") and not ours.tokenize("Hello")[0].startswith("▁")


@pytest.mark.parametrize("legacy", [None, True, False])
def test_tokenizer_model_folder(sp_model, tmp_path, legacy):
    """A tokenizer.model folder; "legacy": true puts "▁" before the text after each special token."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(open(sp_model, "rb").read())
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "tokenizer_class": "LlamaTokenizer", "chat_template": LLAMA2_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg if legacy is None else {**cfg, "legacy": legacy}))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = Tokenizer.from_folder(str(folder))
    _assert_same(ours, hf)
    for text in ("<s>[INST] Hello", "Hi</s>there", "a</s> b<s>c"):
        assert ours.encode(text) == hf(text)["input_ids"], text
    assert ours.encode("x")[0] == 1  # BOS
    ids = hf.apply_chat_template(CHAT, tokenize=True, return_dict=False)  # transformers' return forms (they went into the template)
    assert ours.apply_chat_template(CHAT) == ids and ours.vocab == hf.get_vocab()
    assert ours.apply_chat_template(CHAT, return_dict=True)["input_ids"] == ids
    assert ours.apply_chat_template(CHAT, return_tensors="pt").tolist() == [ids]
    assert ours.apply_chat_template(CHAT, return_dict=True, return_tensors="pt")["attention_mask"].shape == (1, len(ids))
    assert ours.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False) == hf.apply_chat_template(CHAT, tokenize=False)


def _sentencepiece_gguf(sp_model: str, path, space_prefix: bool | None = None, with_types: bool = True):
    """A GGUF file holding a sentencepiece model's vocabulary, as llama.cpp's converter writes it."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    w.add_token_list(tokens)
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    if with_types:
        w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(LLAMA2_TEMPLATE)
    w.add_tensor("token_embd.weight", np.zeros((n, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Tokenizer.from_gguf(dict(gguf.GGUFReader(str(path)).fields))


def test_sentencepiece_gguf_vocab(sp_model, tmp_path):
    ours = _sentencepiece_gguf(sp_model, tmp_path / "sp.gguf")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    _assert_same(ours, hf)
    assert ours.encode("x")[0] == 1  # llama.cpp adds BOS to sentencepiece vocabularies by default
    text = "a <unk> b</s><s>"  # the unknown token is special as the control ones (llama.cpp, HF): it was spelled out
    assert ours.encode(text) == hf.encode(text) and 0 in ours.encode(text)
    assert ours.decode(ours.encode(text), skip_special_tokens=True) == hf.decode(hf.encode(text), skip_special_tokens=True)
    assert ours.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False) == hf.apply_chat_template(CHAT, tokenize=False)


def test_gguf_vocab_without_token_types(sp_model, tmp_path):
    """A vocabulary without `tokenizer.ggml.token_type`: its bos, eos and unknown tokens are special
    still, as transformers makes them (decode(skip_special_tokens=True) kept "<s>")."""
    ours = _sentencepiece_gguf(sp_model, tmp_path / "sp.gguf", with_types=False)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    text = "a <unk> b</s><s> c"
    assert ours.encode(text) == hf.encode(text) and ours.encode(text)[:1] == [1]
    assert ours.decode(ours.encode(text), skip_special_tokens=True) == hf.decode(hf.encode(text), skip_special_tokens=True) == "a  b c"


def test_sentencepiece_gguf_without_space_prefix(sp_model, tmp_path):
    """`tokenizer.ggml.add_space_prefix = false` (as llama.cpp reads it): no "▁" before the text,
    which decodes back as it was, leading spaces included (the key was ignored: every prompt
    began with a "▁" the model never saw)."""
    plain = _sentencepiece_gguf(sp_model, tmp_path / "a.gguf", space_prefix=True)
    bare = _sentencepiece_gguf(sp_model, tmp_path / "b.gguf", space_prefix=False)
    pieces = [bare.backend.id_to_token(i) for i in bare.encode("Hello world", add_special_tokens=False)]
    assert "".join(pieces) == "Hello▁world"
    assert "".join(plain.backend.id_to_token(i) for i in plain.encode("Hello world", add_special_tokens=False)) == "▁Hello▁world"
    for text in STRINGS:
        assert bare.decode(bare.encode(text, add_special_tokens=False)) == text, text


def test_gguf_special_tokens_outside_the_byte_alphabet(tmp_path):
    """A byte-level vocabulary whose special tokens llama.cpp wrote as text outside GPT-2's byte
    alphabet (DeepSeek-R1-Distill-Llama's "<｜begin▁of▁sentence｜>", "<｜User｜>"): each keeps its
    own id, matched in text, BOS added where the file says (they were spelled in bytes and lost)."""
    import tiny_models as tm

    tokens, merges = tm.tiny_vocab(300)
    extra = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
    tokens = tokens + extra
    path = tmp_path / "ds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([1] * (len(tokens) - 4) + [3, 3, 4, 4])
    w.add_bos_token_id(len(tokens) - 4)
    w.add_eos_token_id(len(tokens) - 3)
    w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_gguf(dict(gguf.GGUFReader(str(path)).fields))
    bos, eos, user, assistant = range(len(tokens) - 4, len(tokens))
    assert (tok.bos_token_id, tok.eos_token_id) == (bos, eos)
    ids = tok.encode("<｜User｜>ab<｜Assistant｜>ba<｜end▁of▁sentence｜>")
    assert ids[:2] == [bos, user] and ids[-1] == eos and assistant in ids and len(ids) <= 9
    assert tok.decode(ids, skip_special_tokens=True) == "<｜User｜>ab<｜Assistant｜>ba"


def test_folder_templates_render_as_transformers_does(tmp_path):
    """Against transformers on tiny tokenizer folders: chat_template.jinja wins over
    tokenizer_config.json's template, special_tokens_map.json over tokenizer_config.json's tokens,
    tools/documents are None when not given, an unset token renders as "", and
    {% generation %} blocks render their body."""
    import shutil

    from tiny_models import add_chat_template, save_tokenizer

    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{% if tools is not none %}[T]{{ tools|tojson }}{% endif %}"
                "{% if documents is not none %}[D]{% endif %}[INST] {{ m.content }}[/INST]{% else %}{% generation %}{{ m.content }}"
                "{% endgeneration %}{{ eos_token }}{% endif %}{% endfor %}|pad={{ pad_token }}")
    cases = {}
    folder = str(tmp_path / "jinja")
    save_tokenizer(folder, 320)
    add_chat_template(folder, "OLD")
    with open(os.path.join(folder, "chat_template.jinja"), "w", encoding="utf-8") as fh:
        fh.write(template)
    cases["jinja"] = folder
    folder = str(tmp_path / "special_map")
    shutil.copytree(cases["jinja"], folder)
    for name, change in (("special_tokens_map.json", {"eos_token": "<unk>"}), ("tokenizer_config.json", {})):
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            cfg = json.load(fh)
        cfg.update(change)
        cfg.pop("pad_token", None)
        with open(os.path.join(folder, name), "w", encoding="utf-8") as fh:
            json.dump(cfg, fh)
    cases["special_map"] = folder
    for name, folder in cases.items():
        hf, ours = transformers.AutoTokenizer.from_pretrained(folder), Tokenizer.from_folder(folder)
        assert (ours.eos_token, ours.eos_token_id) == (hf.eos_token, hf.eos_token_id), name
        for kwargs in ({}, {"tools": [{"type": "function", "function": {"name": "f"}}]}):
            want = hf.apply_chat_template(msgs, tokenize=False, **kwargs)
            assert ours.apply_chat_template(msgs, tokenize=False, **kwargs) == want, name
            assert "[INST] Hi[/INST]Yo" in want and "[D]" not in want


def test_an_unset_add_flag_keeps_the_post_processors_token(tmp_path):
    """A tokenizer.json that adds BOS itself (LLaMA-3's) with a tokenizer_config.json setting only
    add_eos_token: BOS stays, as in transformers (the unset add_bos_token read as False dropped it
    from every prompt); a flag that is set still decides."""
    import tiny_models as tm
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    tm.save_tokenizer(str(tmp_path), 320)
    backend = Backend.from_file(str(tmp_path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tm.BOS_ID)])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    plain = Tokenizer.from_folder(str(tmp_path)).encode("hello", add_special_tokens=False)
    for flags, want in (({"add_eos_token": False}, [tm.BOS_ID] + plain), ({"add_eos_token": True}, [tm.BOS_ID] + plain + [tm.EOS_ID]),
                        ({"add_bos_token": False}, plain), ({}, [tm.BOS_ID] + plain)):
        rest = {k: v for k, v in config.items() if k not in ("add_bos_token", "add_eos_token")}
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**rest, **flags}))
        assert Tokenizer.from_folder(str(tmp_path)).encode("hello") == want, flags


def test_tool_conversations_render_as_transformers_does(tmp_path):
    """Messages as the OpenAI client sends them (keys set to None, an assistant's tool calls
    without content, a tool's JSON result, Llama 3.1's ipython role, "reasoning" for
    reasoning_content) render as transformers renders them (they were refused or raised a raw
    TypeError); continue_final_message and a chat_template argument too (both were ignored); a
    template that fails on a message is one clear error."""
    transformers = pytest.importorskip("transformers")
    import tiny_models as tm

    from fasterllama.conversation import check_messages
    from fasterllama.errors import FasterLlamaError

    template = ("{% for m in messages %}<|{{ m.role }}|>{% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}"
                "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
                "{% if m.content is defined %}{% if m.content is string %}{{ m.content }}{% else %}{{ m.content | tojson }}{% endif %}{% endif %}"
                "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tm.save_tokenizer(str(tmp_path), 320)
    tm.add_chat_template(str(tmp_path), template)
    ours, hf = Tokenizer.from_folder(str(tmp_path)), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    call = {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    messages = [{"role": "user", "content": "hi", "tool_calls": None, "name": None},
                {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "look it up"},
                {"role": "tool", "content": {"x": 1}}, {"role": "ipython", "content": "r"},
                {"role": "assistant", "content": "So"}]
    for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False, "continue_final_message": True}):
        want = hf.apply_chat_template(messages, tokenize=False, **kwargs)
        assert ours.apply_chat_template(check_messages(messages), tokenize=False, **kwargs) == want, kwargs
    assert want.endswith("<|assistant|>So")
    # the continued turn ends where its content does, also where that text comes again after it ("<" of "<|end|>",
    # "end"); an empty or newline-ended content too (transformers' tag: the last occurrence cut inside "<|end|>")
    for final in ("<", "end", "", "Roses\n", "|>"):
        turns = [messages[0], {"role": "assistant", "content": final}]
        want = hf.apply_chat_template(turns, tokenize=False, continue_final_message=True)
        assert ours.apply_chat_template(check_messages(turns), tokenize=False, continue_final_message=True) == want, final
        assert want.endswith("<|assistant|>" + final)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]}]
    assert check_messages(parts)[0]["content"] == "Part one.\nPart two."  # (joined as vLLM joins them)
    assert check_messages(parts, "openai")[0]["content"] == parts[0]["content"]  # (kept for templates that loop over parts)
    assert check_messages(messages[:1], "openai")[0]["content"] == [{"type": "text", "text": "hi"}]
    assert check_messages([{"role": "assistant", "content": "x", "thinking": "t"}])[0]["reasoning_content"] == "t"  # (and "thinking" kept)
    other = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    assert ours.apply_chat_template(check_messages(messages[:1]), chat_template=other, tokenize=False) == "[user]hi"
    with pytest.raises(FasterLlamaError, match="cannot render these messages: UndefinedError"):
        ours.apply_chat_template(check_messages(messages), chat_template="{% for m in messages %}{{ m.content + '!' }}{% endfor %}")
    # named templates: "tool_use" when tools are given (a list in tokenizer_config.json, or additional_chat_templates/),
    # and every special token the config sets is a template variable
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(chat_template=[{"name": "default", "template": "D{{ sep_token }}"}, {"name": "tool_use", "template": "T{{ tools | length }}"}],
                  sep_token="<s>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for folder_template in (False, True):
        if folder_template:  # (transformers' saved layout: chat_template.jinja, additional_chat_templates/NAME.jinja)
            (tmp_path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
            (tmp_path / "chat_template.jinja").write_text("J{{ sep_token }}")
            (tmp_path / "additional_chat_templates").mkdir()
            (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("F{{ tools | length }}")
        ours, hf = Tokenizer.from_folder(str(tmp_path)), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
        for tools in (None, [], [{"type": "function", "function": {"name": "f"}}]):  # ([]: not None, so "tool_use", as transformers picks)
            want = hf.apply_chat_template(messages[:1], tools=tools, tokenize=False)
            assert ours.apply_chat_template(check_messages(messages[:1]), tools=tools, tokenize=False) == want, (folder_template, tools, want)
        for name in ("default", "tool_use"):  # a template named, not written out (it rendered the name as the prompt)
            want = hf.apply_chat_template(messages[:1], chat_template=name, tools=[], tokenize=False)
            assert ours.apply_chat_template(check_messages(messages[:1]), chat_template=name, tools=[], tokenize=False) == want != name


def test_tokenizer_json_folder(default_llm, hf_tokenizer, tmp_path):
    """The default model's tokenizer saved as a HF folder (tokenizer.json + config) loads identically."""
    hf_tok = hf_tokenizer
    hf_tok.save_pretrained(str(tmp_path))
    assert os.path.isfile(tmp_path / "tokenizer.json")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_folder(str(tmp_path))
    _assert_same(ours, hf)
    msgs = CHAT[1:]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_incremental_detokenizer_never_breaks_utf8(default_llm):
    tok = default_llm.tokenizer
    text = "Emoji 🤖🎉👩‍👩‍👧, CJK 中文字符, accents café, math ∑∫√ and plain words."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert any(d == "" for d in deltas)  # some tokens were partial characters and were held back


def test_a_text_cut_inside_a_character_ends_as_decode_ends_it(default_llm):
    """Tokens held back as part of a character are given out when the sequence ends (they were
    lost): a generation cut by max_tokens mid-character, and one of byte tokens only, end with
    decode's replacement characters, so that .text == decode(token_ids); an end token's text
    stays out, what the tokens before it held comes out."""
    from fasterllama import SamplingParams

    tok = default_llm.tokenizer
    bytes_only = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"][:4]  # (tokens of a partial character)
    eos = default_llm.config.eos_token_ids[0]
    cases = [(["日本の首都は"], SamplingParams(temperature=0, max_tokens=2)),
             (["Hi"], SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=bytes_only)),
             (["Hi"], SamplingParams(temperature=1.0, seed=3, max_tokens=6, allowed_token_ids=bytes_only + [eos], min_tokens=2))]
    word = tok.encode("hello", add_special_tokens=False)[0]  # an ending token with text of its own, after a partial character
    cases += [(["Hi"], SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=[bytes_only[0], word], stop_token_ids=[word],
                                      min_tokens=1, logit_bias={word: 100}))]
    for prompts, params in cases:
        out = default_llm.generate(prompts, params)[0]
        shown = [t for t in out.token_ids if t not in (eos, *params.stop_token_ids)]
        assert out.text == tok.decode(shown, skip_special_tokens=True) and out.text, (out.token_ids, out.text)
        assert "".join(default_llm.stream(prompts[0], params)) == out.text  # (the stream's last delta carries it too)


@pytest.mark.parametrize("pre", ["tekken", "llama-bpe", "default", "smollm"])
def test_gguf_byte_level_splits_as_transformers(tmp_path, pre):
    """A byte-level GGUF vocabulary splits text as its `tokenizer.ggml.pre` says, as transformers
    reads the file: Mistral-Nemo's "tekken" one digit a piece and CamelCase apart (it was split
    as GPT-2 does: 6 of 22 texts gave other ids). "smollm" (the default model's) splits every digit
    off first, as SmolLM's tokenizer.json and llama.cpp do, where transformers' GGUF reader splits
    as GPT-2 does: the reference is its tokenizer with SmolLM's pre-tokenizer put back."""
    import tiny_models as tm
    from tokenizers import pre_tokenizers

    tokens, merges = tm.tiny_vocab(400)
    # (merges across the splits GPT-2's, tekken's and SmolLM's differ on)
    tokens, merges = tokens + ["Ġ2", "20", "lC", "ĠĠ"], merges + ["Ġ 2", "2 0", "l C", "Ġ Ġ"]
    path = tmp_path / "bpe.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in tm.SPECIAL_TOKENS else 1 for t in tokens])
    w.add_bos_token_id(tm.BOS_ID)
    w.add_eos_token_id(tm.EOS_ID)
    w.add_add_bos_token(False)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="bpe.gguf")
    if pre == "smollm":
        hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    ours = Tokenizer.from_gguf(dict(gguf.GGUFReader(str(path)).fields))
    texts = [*STRINGS, "CamelCaseWords and HTTPServer", "x=12345/67;\n\n\ny", "Ünïcödé ÀB", " 2024-11-30 ", "a  1\n 2   20"]
    for s in texts:
        assert ours.encode(s) == hf(s)["input_ids"], (pre, s)
        assert ours.decode(ours.encode(s)) == s
    if pre == "tekken":
        assert [ours.decode([i]) for i in ours.encode(" 2024")] == [" ", "2", "0", "2", "4"]
    if pre == "smollm":
        assert [ours.decode([i]) for i in ours.encode("a  1 20")] == ["a", "  ", "1", " ", "2", "0"]
