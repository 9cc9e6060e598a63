"""Read a GGUF file of the `llama` architecture into canonical tensors + ModelConfig + tokenizer fields."""

from __future__ import annotations

import mmap
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import ModelConfig, per_head
from ..errors import ModelLoadError

SUPPORTED_ARCHS = ("llama", "mistral")

# GGUF tensor name -> canonical (HF) tensor name.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def canonical_name(gguf_name: str) -> str | None:
    """Canonical name of a GGUF tensor, or None for tensors the model does not use."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in _LAYER_NAMES:
            return None
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    return None


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of q/k weights (interleaved RoPE -> rotate-half RoPE)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of q/k rows (what its converter writes); inverse of unpermute_rope_rows."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, dim, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class GGUFCheckpoint:
    path: str
    config: ModelConfig
    metadata: dict[str, Any]
    reader: Any
    released_from: int = 0  # where the last tensor whose pages were dropped starts (release_pages)

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors if canonical_name(t.name)]

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (canonical name, float32 tensor) one at a time, so only one is expanded at once."""
        cfg = self.config
        for t in self.reader.tensors:
            name = canonical_name(t.name)
            if name is None:
                continue
            shape = tuple(int(d) for d in reversed(t.shape))
            arr = _dequantize(t.data, t.tensor_type).reshape(shape)
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                arr = unpermute_rope_rows(arr, cfg.num_heads)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                arr = unpermute_rope_rows(arr, cfg.num_kv_heads)
            yield name, torch.from_numpy(arr)
            self.release_pages(t.data_offset, t.n_bytes)
        self.release_all_pages()

    def release_pages(self, offset: int, length: int) -> None:
        """Drop the file pages of a tensor already copied, so they do not add to peak memory, and
        the previous tensor's again: reading this one mapped the pages around each fault (the
        kernel's fault-around), the end of the previous one among them."""
        mm = getattr(self.reader, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        start = min(offset, self.released_from)
        start -= start % mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, offset + length - start)
            self.released_from = offset
        except (OSError, ValueError):
            pass

    def release_all_pages(self) -> None:
        """Drop every page of the file this process maps (loading is done: what fault-around mapped
        past the last tensor released, tensors the model does not use)."""
        mm = getattr(self.reader, "_mmap", None)
        if mm is not None:
            self.release_pages(0, len(mm))

    def drop_metadata(self) -> None:
        """Free the parsed metadata (the vocabulary alone is ~100 MB of small arrays) once the
        config and tokenizer are built."""
        self.reader.fields.clear()
        self.metadata = {}
        if self.reader.tensors:  # and the pages they were read from
            self.release_pages(0, min(t.data_offset for t in self.reader.tensors))


def _dequantize(data: np.ndarray, qtype: Any, rows_per_chunk: int = 2048) -> np.ndarray:
    """float32 copy of a GGUF tensor, expanded a block of rows at a time so the only large
    allocation is the result (dequantizing a whole embedding at once needs several copies)."""
    if qtype.name == "F32":
        return np.array(data, dtype=np.float32)  # a writable copy of the memory map
    from gguf import quants

    if data.ndim == 1:
        return np.asarray(quants.dequantize(data, qtype), dtype=np.float32)
    first = quants.dequantize(data[:1], qtype)
    out = np.empty((data.shape[0], first.shape[-1]), dtype=np.float32)
    for lo in range(0, data.shape[0], rows_per_chunk):
        out[lo : lo + rows_per_chunk] = quants.dequantize(data[lo : lo + rows_per_chunk], qtype)
    return out


def stored_16bit(data: np.ndarray, qtype: Any) -> torch.Tensor | None:
    """A copy of an F16 or BF16 tensor in its own type (None for other types): kept as stored it
    takes half an fp32 copy's memory, and widening it as the kernels compute is exact."""
    if qtype.name == "F16":
        return torch.from_numpy(np.array(data, dtype=np.float16))
    if qtype.name == "BF16":  # (gguf gives its raw bytes: numpy has no bf16)
        return torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
    return None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                          "IQ4_XS")


def open_gguf(path: str) -> GGUFCheckpoint:
    """Open and validate a GGUF file; tensors are read lazily (memory-mapped)."""
    from .gguf_reader import GGUFFile, GGUFFormatError

    with open(path, "rb") as fh:
        head = fh.read(8)
    if head[:4] != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic)")
    if len(head) == 8 and (version := int.from_bytes(head[4:], "little")) not in (2, 3):
        if int.from_bytes(head[4:], "big") in (2, 3):
            raise ModelLoadError(f"{path}: a big-endian GGUF file (for s390x and the like): convert it to little-endian")
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (versions 2 and 3 are; version 1 files predate "
                             "llama.cpp's 2023 format: convert the model again)")
    try:
        reader = GGUFFile(path)
    except GGUFFormatError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    except Exception as e:  # the gguf package raises ValueError/IndexError/etc. on corrupt files
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(f"{path}: unsupported GGUF tensor type {t.tensor_type.name} ({t.name})")

    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    shards = _field(reader, "split.count")
    if shards is not None and int(shards) > 1:
        raise ModelLoadError(f"{path}: shard {int(_field(reader, 'split.no', 0)) + 1} of a GGUF split into {int(shards)} files; "
                             "merge them into one first (llama.cpp's `llama-gguf-split --merge FIRST-SHARD OUT.gguf`)")
    if int(_field(reader, f"{arch}.expert_count", 0) or 0) > 0:
        raise ModelLoadError(f"{path}: a mixture-of-experts model ({arch}.expert_count = {_field(reader, f'{arch}.expert_count')}); "
                             "only dense models are supported")
    metadata = dict(reader.fields.items())
    config = _config_from_gguf(reader, arch, path)
    for t in reader.tensors:  # (the kernels trust the config's sizes: a feed_forward_length off by half ran past the weights)
        name = canonical_name(t.name)
        shape, expected = tuple(int(d) for d in reversed(t.shape)), None if name is None else config.tensor_shape(name)
        if expected is not None and shape != expected:
            raise ModelLoadError(f"{path}: tensor {t.name} has shape {list(shape)}, but the file's metadata makes it {list(expected)}")
    return GGUFCheckpoint(path=path, config=config, metadata=metadata, reader=reader)


def _config_from_gguf(reader: Any, arch: str, path: str) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    required = ("embedding_length", "attention.head_count", "block_count", "feed_forward_length")
    if missing := [f"{arch}.{key}" for key in required if get(key) is None]:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {', '.join(missing)}")
    try:
        hidden, heads, n_layers, ffn = (int(get(key)) for key in required)
        kv_heads = int(get("attention.head_count_kv", heads))
    except (TypeError, ValueError):
        raise ModelLoadError(f"{path}: GGUF metadata has non-integer {arch} hyperparameters") from None
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    if vocab is None:
        vocab = int(next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight"))
    rope_scaling = None
    scaling_type = get("rope.scaling.type", "linear")  # (llama.cpp's default: a factor alone is linear scaling)
    if scaling_type == "linear":
        factor = get("rope.scaling.factor", get("rope.scale_linear"))  # (llama.cpp: absent or 0 is no scaling)
        rope_scaling = {"rope_type": "linear", "factor": float(factor)} if factor else None
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{path}: unsupported rope scaling {scaling_type!r}")
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:  # llama.cpp writes llama3 scaling as per-frequency divisors
        rope_scaling = {"rope_type": "freq_factors", "factors": [float(x) for x in np.asarray(rope_freqs.data)]}
    head_dim = int(get("attention.key_length", per_head(hidden, heads)))
    rotary = get("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:  # (llama.cpp refuses these llama files too)
        raise ModelLoadError(f"{path}: rotary embedding over {int(rotary)} of {head_dim} head dimensions is not supported")
    eps = get("attention.layer_norm_rms_epsilon")
    if eps is None:  # (llama.cpp requires it; HF and we would each guess a different default)
        raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.attention.layer_norm_rms_epsilon")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(eps),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_end_of_generation_ids(reader, int(vocab)),
    )


# Control tokens llama.cpp ends a generation at by their text, whatever the file's eos says (an
# early Llama-3-Instruct file's eos is <|end_of_text|>, its turns end with <|eot_id|>).
_END_OF_GENERATION_TEXTS = {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                            "<|endoftext|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>"}


def _end_of_generation_ids(reader: Any, vocab: int) -> list[int]:
    """The tokens that end a generation, as llama.cpp's end-of-generation set: eos, eot and eom
    (Llama-3.1's tool-call end), then the control tokens spelled as one of the above (ids past
    the vocabulary left out: the sampler's masks index by them)."""
    ids = [int(x) for key in ("eos", "eot", "eom") if (x := _field(reader, f"tokenizer.ggml.{key}_token_id")) is not None]
    tokens, types = _field(reader, "tokenizer.ggml.tokens") or [], _field(reader, "tokenizer.ggml.token_type") or []
    ids += [i for i, (text, kind) in enumerate(zip(tokens, types)) if kind == 3 and text in _END_OF_GENERATION_TEXTS]
    return [i for i in dict.fromkeys(ids) if 0 <= i < vocab]
