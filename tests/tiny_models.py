"""Tiny random LLaMA-family checkpoints built inside the tests (no downloads).

`TinySpec` describes a model; `build_hf_model` makes the HF transformers model with a fixed seed
and weights scaled so logits are not degenerate; `save_hf_checkpoint` writes a HF folder
(config.json + safetensors, optionally sharded, + a small byte-level BPE tokenizer);
`write_gguf` exports the same weights to a GGUF file the way llama.cpp's converter does
(Q/K rows permuted, LLaMA-3 rope scaling as a `rope_freqs.weight` tensor, optional F16/BF16,
block-quantized or K-quantized tensors, or a Q4_K_M-style mix); `quantize_roundtrip_` sets a HF
model's weights to exactly the values a quantized GGUF file dequantizes to, so the HF model stays
an exact reference.

The GGUF export does not call fasterllama's loading or model code: it is an independent oracle.
The one exception is writing K-quant blocks (gguf-py cannot) and choosing each tensor's type in
a mixed file, done by fasterllama.quant.kquants; what those blocks mean is still decided by
gguf-py's own dequantizers (`_roundtrip`), which is also what HF transformers reads the file with.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# llama.cpp's type per tensor (fallbacks, the _K_M rule) lives in fasterllama.quant.kquants, which
# `fasterllama quantize --mode q4_k_m` (quant/gguf_export.py) uses too; test_kquant_gguf spells out the types it must give.
from fasterllama.quant.kquants import tensor_type
from fasterllama.quant.kquants import use_more_bits as _use_more_bits  # noqa: F401  (tests use it)
from fasterllama.tokenizer import bytes_to_unicode  # GPT-2's byte alphabet

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


@dataclass(frozen=True)
class TinySpec:
    name: str
    arch: str = "llama"  # "llama" | "mistral"
    vocab_size: int = 320
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int | None = None  # None: hidden_size // num_heads
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.1
    attention_bias: bool = False  # llama only
    mlp_bias: bool = False
    seed: int = 0

    @property
    def real_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# The configurations the parity tests cover (hidden 64, 2 layers, small vocab).
SPECS: dict[str, TinySpec] = {
    s.name: s
    for s in [
        TinySpec("mha", num_heads=4, num_kv_heads=4, seed=1),
        TinySpec("gqa", num_heads=8, num_kv_heads=2, seed=2),
        TinySpec("mqa", num_heads=4, num_kv_heads=1, seed=3),
        TinySpec("tied", num_heads=4, num_kv_heads=2, tie_word_embeddings=True, vocab_size=384, seed=4),
        TinySpec("head_dim", num_heads=4, num_kv_heads=2, head_dim=24, seed=5),
        TinySpec(
            "llama3_rope",  # head_dim 32 at theta 5e5: high, medium and low frequency bands all occur
            num_heads=2,
            num_kv_heads=1,
            rope_theta=500000.0,
            rope_scaling=LLAMA3_SCALING,
            tie_word_embeddings=True,
            seed=8,
        ),
        TinySpec("mistral", arch="mistral", num_heads=4, num_kv_heads=2, rope_theta=1e6, seed=7),
    ]
}

# K-quants need rows that are a multiple of 256 (super-blocks), so these are wider; 4 layers so
# the Q4_K_M rule gives some layers more bits and not others. Kept out of SPECS (not every
# parity test needs them). "kquant": every 2-D weight's rows are multiples of 256. "kquant_mix"
# (tied, ffn 288 wide): ffn_down falls back to Q5_0/Q8_0 as SmolLM2's 576-wide rows do in a
# llama.cpp Q4_K_M file, so its q4_k_m file mixes Q4_K, Q6_K, Q5_0 and Q8_0.
K_SPECS: dict[str, TinySpec] = {
    s.name: s
    for s in [
        TinySpec("kquant", hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2, seed=11),
        TinySpec(
            "kquant_mix",
            hidden_size=256,
            intermediate_size=288,
            num_layers=4,
            num_heads=4,
            num_kv_heads=1,
            tie_word_embeddings=True,
            seed=12,
        ),
    ]
}


# -- HF model ---------------------------------------------------------------------------------
def hf_config(spec: TinySpec):
    from transformers import LlamaConfig, MistralConfig

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.real_head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        attn_implementation="eager",
    )
    if spec.arch == "mistral":
        cfg = MistralConfig(sliding_window=None, **common)
        cfg.architectures = ["MistralForCausalLM"]
    else:
        if spec.rope_scaling is not None:
            common["rope_scaling"] = dict(spec.rope_scaling)
        cfg = LlamaConfig(attention_bias=spec.attention_bias, mlp_bias=spec.mlp_bias, **common)
        cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def build_hf_model(spec: TinySpec) -> torch.nn.Module:
    """The HF model with seeded random weights (fp32, eval mode, eager attention).

    RMSNorm weights are randomized too (around 1), so a loader that drops or mixes them up
    changes the logits."""
    from transformers import LlamaForCausalLM, MistralForCausalLM

    torch.manual_seed(spec.seed)
    cls = MistralForCausalLM if spec.arch == "mistral" else LlamaForCausalLM
    model = cls(hf_config(spec)).float().eval()
    gen = torch.Generator().manual_seed(spec.seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):  # HF initializes biases to zero
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    gc = model.generation_config
    gc.eos_token_id = None  # greedy references never stop early
    gc.pad_token_id = UNK_ID
    gc.bos_token_id = BOS_ID
    return model


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from HF generate, never stopping at EOS."""
    from transformers import GenerationConfig

    gc = GenerationConfig(
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=UNK_ID,
        bos_token_id=BOS_ID,
    )
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), generation_config=gc)
    new = out[0, len(ids) :].tolist()
    assert len(new) == n, f"HF generate stopped after {len(new)} of {n} tokens"
    return new


# -- tokenizer --------------------------------------------------------------------------------
def tiny_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """(tokens, merges): 3 special tokens, the 256 byte characters, then two-character merges.

    Every merged token's halves are in the vocabulary, so the BPE is well formed."""
    byte_chars = [bytes_to_unicode()[b] for b in range(256)]
    tokens = SPECIAL_TOKENS + byte_chars
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size must be >= {len(tokens)}")
    spell = bytes_to_unicode()
    letters = [spell[b] for b in b" etaoinshrdlcumwfgypbvk"]
    merges: list[str] = []
    for a in letters:
        for b in letters:
            if len(tokens) >= vocab_size:
                break
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    if len(tokens) < vocab_size:
        raise ValueError(f"vocab_size {vocab_size} too large for the tiny vocabulary")
    return tokens, merges


def save_tokenizer(folder: str, vocab_size: int) -> None:
    """tokenizer.json (byte-level BPE) + tokenizer_config.json + special_tokens_map.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = tiny_vocab(vocab_size)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump({**special, "add_bos_token": False, "add_eos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}, fh)
    with open(os.path.join(folder, "special_tokens_map.json"), "w", encoding="utf-8") as fh:
        json.dump(special, fh)


# -- HF folder --------------------------------------------------------------------------------
def add_chat_template(folder: str, template: str) -> None:
    """Give a saved checkpoint's tokenizer a chat template (tokenizer_config.json)."""
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({**cfg, "chat_template": template}, fh)


def save_hf_checkpoint(model: torch.nn.Module, folder: str, max_shard_size: str | int | None = None) -> str:
    """config.json + safetensors (sharded with an index when max_shard_size is small) + tokenizer."""
    kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    try:
        model.save_pretrained(folder, **kwargs)
    except TypeError:  # transformers versions without the safe_serialization switch
        kwargs.pop("safe_serialization")
        model.save_pretrained(folder, **kwargs)
    save_tokenizer(folder, model.config.vocab_size)
    return folder


# -- GGUF -------------------------------------------------------------------------------------
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotate-half -> interleaved RoPE rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(head_dim: int, rope_theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """What llama.cpp writes as `rope_freqs.weight` for LLaMA-3 rope scaling (divisors of freqs)."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    freqs = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    base, _, kind = hf_name.rpartition(".")
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    assert parts[:2] == ["model", "layers"], hf_name
    return f"blk.{parts[2]}.{_GGUF_LAYER_NAMES['.'.join(parts[3:])]}.{kind}"


# weight_type -> GGML type of the 2-D weights (norms and rope_freqs always stay F32). The K
# types need rows that are a multiple of 256 (see K_SPECS); "q4_k_m" mixes types per tensor.
BLOCK_WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
K_WEIGHT_TYPES = ("q3_k", "q4_k", "q5_k", "q6_k", "q4_k_m")
IQ4_WEIGHT_TYPES = ("iq4_nl", "iq4_xs")  # iq4_xs: rows that are not whole 256-element super-blocks take IQ4_NL
WEIGHT_TYPES = BLOCK_WEIGHT_TYPES + K_WEIGHT_TYPES + IQ4_WEIGHT_TYPES

def _qtype(type_name: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[type_name.upper()]


# K-quant (and IQ4) searches are not idempotent: re-quantizing dequantized Q5_K (or Q2_K, Q6_K) values
# can move a few sub-blocks by a step. So _roundtrip remembers which blocks each dequantized row
# came from, and _encode writes those blocks again when it meets that row (also after the Q/K row
# permutation): a file written from quantize_roundtrip_'s weights then holds exactly them.
_K_ROW_BLOCKS: dict[tuple[str, bytes], np.ndarray] = {}


def _row_key(type_name: str, row: np.ndarray) -> tuple[str, bytes]:
    return type_name, hashlib.blake2b(np.ascontiguousarray(row, dtype=np.float32).tobytes(), digest_size=16).digest()


def _encode(arr: np.ndarray, type_name: str) -> tuple[np.ndarray, Any]:
    """(array to write, raw_dtype) for a 2-D float32 weight of one resolved type (see tensor_type)."""
    from gguf import quants

    from fasterllama.quant import kquants

    if type_name == "f32":
        return arr, None
    if type_name == "f16":
        return arr.astype(np.float16), None
    if type_name.upper() in kquants.K_QUANT_TYPES + kquants.IQ4_TYPES:  # gguf-py has no K-quant or IQ4 quantizers
        known = [_K_ROW_BLOCKS.get(_row_key(type_name, row)) for row in arr]
        if all(b is not None for b in known):
            return np.stack(known), _qtype(type_name)
        return kquants.quantize(arr, type_name), _qtype(type_name)
    return quants.quantize(arr, _qtype(type_name)), _qtype(type_name)


def _roundtrip(arr: np.ndarray, type_name: str) -> np.ndarray:
    """The float32 values a weight of this (resolved) type reads back as, by gguf's dequantizers."""
    from gguf import quants

    from fasterllama.quant import kquants

    if type_name == "f32":
        return arr
    if type_name == "f16":
        return arr.astype(np.float16).astype(np.float32)
    data, qt = _encode(arr, type_name)
    out = quants.dequantize(data, qt).reshape(arr.shape).astype(np.float32)
    if type_name.upper() in kquants.K_QUANT_TYPES + kquants.IQ4_TYPES:
        for row, blocks in zip(out, data):
            _K_ROW_BLOCKS[_row_key(type_name, row)] = blocks
    return out


def _is_quantized_weight(name: str, arr: np.ndarray) -> bool:
    return arr.ndim == 2 and not name.endswith("norm.weight")


@torch.no_grad()
def quantize_roundtrip_(model: torch.nn.Module, weight_type: str) -> torch.nn.Module:
    """Set every 2-D weight of `model` to its value after a trip through `weight_type`.

    Block quantization works along rows, so it commutes with llama.cpp's Q/K row permutation:
    the GGUF written from these weights dequantizes to exactly these values. A tied embedding is
    one parameter here, and one tensor (token_embd) in the file, so it gets one type."""
    cfg = model.config
    for name, p in model.named_parameters():
        arr = p.detach().cpu().numpy()
        if _is_quantized_weight(name, arr):
            t = tensor_type(gguf_name(name), arr.shape[1], weight_type, cfg.num_hidden_layers, bool(cfg.tie_word_embeddings))
            p.copy_(torch.from_numpy(_roundtrip(arr, t)))
    return model


def write_gguf(model: torch.nn.Module, path: str, weight_type: str = "f32", metadata: dict[str, Any] | None = None) -> str:
    """Export a HF LLaMA/Mistral model to GGUF as llama.cpp's converter does (arch "llama");
    `metadata`: keys to set (ints as uint32, floats, strings, lists of one of those: int32) or, given None, to leave out."""
    import gguf

    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_theta = getattr(cfg, "rope_theta", None) or rope.get("rope_theta", 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    tokens, merges = tiny_vocab(cfg.vocab_size)

    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-test-model")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(False)

    if rope_type == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, float(rope_theta), rope))
    elif rope_type not in ("default", None):
        raise ValueError(f"write_gguf: rope type {rope_type!r} not supported by this helper")

    for key, value in (metadata or {}).items():
        w.kv_data[0].pop(key, None)
        if value is not None:
            kinds = {int: gguf.GGUFValueType.INT32, float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}
            if isinstance(value, list):  # (of one kind)
                w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=kinds[type(value[0])])
            else:
                w.add_key_value(key, value, gguf.GGUFValueType.UINT32 if isinstance(value, int) else kinds[type(value)])

    state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, arr in state.items():
        if "rotary_emb" in name:
            continue
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):  # the converter permutes biases too
            arr = llama_cpp_permute(arr, heads)
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            arr = llama_cpp_permute(arr, kv_heads)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if _is_quantized_weight(name, arr):
            t = tensor_type(gguf_name(name), arr.shape[1], weight_type, cfg.num_hidden_layers, bool(cfg.tie_word_embeddings))
            data, raw_dtype = _encode(arr, t)
        else:
            data, raw_dtype = arr, None
        w.add_tensor(gguf_name(name), data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
