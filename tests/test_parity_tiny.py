"""Parity of fasterllama with HF transformers on tiny random LLaMA-family models.

Every model is built here (tests/tiny_models.py), saved as a HF safetensors folder and exported
to GGUF, then fasterllama's fp32 logits and greedy tokens are compared with the HF model's:
MHA / GQA / MQA, tied and untied embeddings, head_dim != hidden/heads, LLaMA-3 rope scaling,
Mistral (no sliding window), a sharded checkpoint, quantized GGUF tensors and chunked prefill.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import tiny_models as tm  # noqa: E402  (tests/ is on sys.path under pytest's default import mode)

from fasterllama import LLM, SamplingParams  # noqa: E402

FORMATS = ("safetensors", "gguf")
LOGITS_ATOL = 1e-4
N_GREEDY = 32


def _prompt(length: int, seed: int, vocab: int = 320) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(len(tm.SPECIAL_TOKENS), vocab, (length,), generator=g).tolist()


PROMPT = _prompt(20, seed=100)  # the main prompt (logits and greedy)
LONG_PROMPT = _prompt(64, seed=101)  # positions well past llama3's original context of 32
BATCH_PROMPTS = [_prompt(5, seed=102), _prompt(20, seed=103), _prompt(11, seed=104)]


class Zoo:
    """Builds each tiny model, its checkpoints, LLMs and HF greedy references once per module."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._hf: dict[str, torch.nn.Module] = {}
        self._paths: dict[tuple[str, str], str] = {}
        self._llms: dict[tuple[str, str], LLM] = {}
        self._greedy: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def hf(self, name: str) -> torch.nn.Module:
        if name not in self._hf:
            self._hf[name] = tm.build_hf_model(tm.SPECS[name])
        return self._hf[name]

    def path(self, name: str, fmt: str) -> str:
        key = (name, fmt)
        if key not in self._paths:
            model = self.hf(name)
            if fmt == "safetensors":
                self._paths[key] = tm.save_hf_checkpoint(model, os.path.join(self.root, name))
            else:
                self._paths[key] = tm.write_gguf(model, os.path.join(self.root, f"{name}.gguf"))
        return self._paths[key]

    def llm(self, name: str, fmt: str) -> LLM:
        key = (name, fmt)
        if key not in self._llms:
            self._llms[key] = LLM(model=self.path(name, fmt), progress=False)
        return self._llms[key]

    def hf_greedy(self, name: str, prompt: list[int]) -> list[int]:
        key = (name, tuple(prompt))
        if key not in self._greedy:
            self._greedy[key] = tm.hf_greedy(self.hf(name), prompt, N_GREEDY)
        return self._greedy[key]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and spinning OpenMP workers make them
    many times slower on a busy 2-core machine; restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Zoo:
    return Zoo(str(tmp_path_factory.mktemp("tiny_models")))


def greedy(llm: LLM, prompts: list[list[int]], n: int = N_GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert len(outs) == len(prompts)
    for out in outs:
        assert out.finish_reason == "length"
        assert len(out.token_ids) == n
    return [out.token_ids for out in outs]


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor, atol: float = LOGITS_ATOL) -> None:
    assert got.dtype == torch.float32
    assert got.shape == ref.shape, (got.shape, ref.shape)
    diff = (got - ref).abs().max().item()
    assert diff < atol, f"max |logits - HF| = {diff:.3g} (tolerance {atol})"
    # the positions' argmax agree too (the logits are far from degenerate, see test_references_are_informative)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


SPEC_FMT = [pytest.param(name, fmt, id=f"{name}-{fmt}") for name in tm.SPECS for fmt in FORMATS]


# -- the fixtures themselves are meaningful -----------------------------------------------------
@pytest.mark.parametrize("name", list(tm.SPECS))
def test_references_are_informative(zoo: Zoo, name: str) -> None:
    """The HF references vary: logits spread out and greedy decoding does not collapse to a loop
    of one or two tokens, so token-exact comparisons really test the model."""
    model = zoo.hf(name)
    logits = tm.hf_logits(model, PROMPT)
    assert logits.std().item() > 0.3
    assert len(set(logits.argmax(-1).tolist())) >= 8
    for prompt in [PROMPT, *BATCH_PROMPTS]:
        assert len(set(zoo.hf_greedy(name, prompt))) >= 4, f"{name}: HF greedy output is degenerate"


def test_llama3_rope_scaling_matters(zoo: Zoo) -> None:
    """The llama3 config's scaling changes the logits a lot, so its parity test would catch a
    loader that ignored rope scaling (or rope_freqs.weight in the GGUF)."""
    name = "llama3_rope"
    scaled = zoo.hf(name)
    spec = dataclasses.replace(tm.SPECS[name], rope_scaling=None)
    plain = tm.build_hf_model(spec)
    plain.load_state_dict(scaled.state_dict())
    diff = (tm.hf_logits(scaled, LONG_PROMPT) - tm.hf_logits(plain, LONG_PROMPT)).abs()
    assert diff[32:].max().item() > 0.1
    # the GGUF's rope_freqs.weight (llama.cpp's per-frequency divisors) reproduces HF's scaled
    # inverse frequencies, and covers the high (1), medium and low (factor 8) frequency bands
    spec = tm.SPECS[name]
    reader = gguf.GGUFReader(zoo.path(name, "gguf"))
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    factors = np.array(freqs.data, dtype=np.float32)
    dim = spec.real_head_dim
    assert factors.shape == (dim // 2,)
    assert factors.min() == 1.0 and factors.max() == 8.0
    assert ((factors > 1.0) & (factors < 8.0)).any()
    base = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    hf_inv_freq = scaled.model.rotary_emb.inv_freq.float()
    torch.testing.assert_close(base / torch.from_numpy(factors), hf_inv_freq, rtol=1e-6, atol=0)


def test_gguf_permutation_matches_fasterllama() -> None:
    """fasterllama's unpermute inverts llama.cpp's permutation (and its permute equals it)."""
    from fasterllama.loading.gguf_file import permute_rope_rows, unpermute_rope_rows

    w = np.arange(2 * 3 * 8 * 5, dtype=np.float32).reshape(2 * 3 * 8, 5)
    for n_head in (1, 2, 3, 6):
        p = tm.llama_cpp_permute(w, n_head)
        assert not np.array_equal(p, w)
        np.testing.assert_array_equal(permute_rope_rows(w, n_head), p)
        np.testing.assert_array_equal(unpermute_rope_rows(p, n_head), w)


# -- parity: configs x formats ------------------------------------------------------------------
@pytest.mark.parametrize("name,fmt", SPEC_FMT)
def test_config_read(zoo: Zoo, name: str, fmt: str) -> None:
    spec = tm.SPECS[name]
    cfg = zoo.llm(name, fmt).config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        spec.vocab_size, spec.hidden_size, spec.intermediate_size, spec.num_layers
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (spec.num_heads, spec.num_kv_heads, spec.real_head_dim)
    assert cfg.tie_word_embeddings == spec.tie_word_embeddings
    assert cfg.rms_norm_eps == pytest.approx(spec.rms_norm_eps)
    assert cfg.rope_theta == pytest.approx(spec.rope_theta)


@pytest.mark.parametrize("length", [20, 64])
@pytest.mark.parametrize("name,fmt", SPEC_FMT)
def test_logits_match_hf(zoo: Zoo, name: str, fmt: str, length: int) -> None:
    prompt = PROMPT if length == 20 else LONG_PROMPT
    got = zoo.llm(name, fmt).compute_logits(prompt)
    assert_logits_close(got, tm.hf_logits(zoo.hf(name), prompt))


@pytest.mark.parametrize("name,fmt", SPEC_FMT)
def test_greedy_matches_hf(zoo: Zoo, name: str, fmt: str) -> None:
    [tokens] = greedy(zoo.llm(name, fmt), [PROMPT])
    assert tokens == zoo.hf_greedy(name, PROMPT)


@pytest.mark.parametrize("name,fmt", SPEC_FMT)
def test_batch_matches_single(zoo: Zoo, name: str, fmt: str) -> None:
    llm = zoo.llm(name, fmt)
    batched = greedy(llm, BATCH_PROMPTS)
    alone = [greedy(llm, [p])[0] for p in BATCH_PROMPTS]
    assert batched == alone
    assert alone == [zoo.hf_greedy(name, p) for p in BATCH_PROMPTS]


@pytest.mark.parametrize("name", ["mha", "tied"])
def test_tokenizers_agree_across_formats(zoo: Zoo, name: str) -> None:
    """The helper's HF tokenizer folder and GGUF vocabulary describe the same tokenizer, and
    generated text is the decoded tokens (so other tests may compare .text too)."""
    text = "the cat sat on the mat, ünïcode!"
    a, b = zoo.llm(name, "safetensors"), zoo.llm(name, "gguf")
    ids = a.tokenizer.encode(text)
    assert ids == b.tokenizer.encode(text)
    assert any(i >= 3 + 256 for i in ids)  # merges were applied
    assert a.tokenizer.decode(ids) == b.tokenizer.decode(ids) == text
    for llm in (a, b):
        [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert out.text == llm.tokenizer.decode(out.token_ids)


# -- checkpoint variants ------------------------------------------------------------------------
def test_sharded_safetensors(zoo: Zoo, tmp_path) -> None:
    name = "gqa"
    model = zoo.hf(name)
    folder = tm.save_hf_checkpoint(model, str(tmp_path / "sharded"), max_shard_size="40KB")
    with open(os.path.join(folder, "model.safetensors.index.json")) as fh:
        weight_map = json.load(fh)["weight_map"]
    shards = sorted(glob.glob(os.path.join(folder, "model-*.safetensors")))
    assert len(shards) >= 3 and set(map(os.path.basename, shards)) == set(weight_map.values())
    assert not os.path.exists(os.path.join(folder, "model.safetensors"))
    llm = LLM(model=folder, progress=False)
    assert_logits_close(llm.compute_logits(PROMPT), tm.hf_logits(model, PROMPT))
    assert greedy(llm, [PROMPT]) == [zoo.hf_greedy(name, PROMPT)]


@pytest.mark.parametrize("weight_type", [t for t in tm.BLOCK_WEIGHT_TYPES if t != "f32"])
def test_quantized_gguf(tmp_path, weight_type: str) -> None:
    """GGUF with F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 weights vs the HF model holding exactly the
    dequantized values."""
    name = "head_dim"  # q/k/v/o in-dims 64 and 96: whole 32-element blocks
    spec = tm.SPECS[name]
    model = tm.build_hf_model(spec)
    original = tm.hf_logits(model, PROMPT)
    tm.quantize_roundtrip_(model, weight_type)
    ref = tm.hf_logits(model, PROMPT)
    assert (ref - original).abs().max().item() > 1e-5  # the round trip really changed the weights
    path = tm.write_gguf(model, str(tmp_path / f"{name}-{weight_type}.gguf"), weight_type=weight_type)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == weight_type.upper()
    assert types["blk.1.ffn_norm.weight"] == "F32"
    llm = LLM(model=path, progress=False)
    if weight_type in ("f16", "bf16"):  # kept as stored (the C kernels widen them exactly), q/k rows un-permuted all the same
        stored = {"f16": torch.float16, "bf16": torch.bfloat16}[weight_type]
        assert llm.engine.model.layers[0].self_attn.qkv_proj.weight.dtype == llm.engine.model.embed_tokens.weight.dtype == stored
    assert_logits_close(llm.compute_logits(PROMPT), ref)
    assert greedy(llm, [PROMPT]) == [tm.hf_greedy(model, PROMPT, N_GREEDY)]


def _expected_kquant_types(name: str, weight_type: str) -> dict[str, str]:
    """The GGML type of every 2-D weight in a K_SPECS file, spelled out (4 layers: the Q4_K_M
    rule gives layers 2 and 3 more bits; kquant_mix's 288-wide ffn_down rows cannot be K-quants)."""
    spec = tm.K_SPECS[name]
    fallback = {"Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
    names = ["token_embd.weight"] + ([] if spec.tie_word_embeddings else ["output.weight"])
    names += [f"blk.{i}.{t}.weight" for i in range(spec.num_layers) for t in
              ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    out = {}
    for n in names:
        is_output = n == "output.weight" or (spec.tie_word_embeddings and n == "token_embd.weight")
        more_bits = n.split(".")[1] in ("2", "3") and n.split(".")[2] in ("attn_v", "ffn_down")
        if weight_type != "q4_k_m":
            t = weight_type.upper()
        else:
            t = "Q6_K" if is_output or more_bits else "Q4_K"
        out[n] = fallback[t] if (name == "kquant_mix" and "ffn_down" in n) else t
    return out


def test_q4_k_m_more_bits_layers() -> None:
    """llama.cpp's use_more_bits: first and last eighth of the layers, every third in between."""
    assert [i for i in range(4) if tm._use_more_bits(i, 4)] == [2, 3]
    assert [i for i in range(8) if tm._use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(30) if tm._use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]


@pytest.mark.parametrize("name", list(tm.K_SPECS))
@pytest.mark.parametrize("weight_type", tm.K_WEIGHT_TYPES)
def test_kquant_gguf(tmp_path, name: str, weight_type: str) -> None:
    """GGUF files with Q4_K/Q5_K/Q6_K weights and a Q4_K_M-style mix (written by
    fasterllama.quant.kquants): fasterllama's logits equal HF transformers loading the same
    file within 1e-4 and greedy tokens are identical; HF loading the file in turn equals the HF
    model holding the dequantized weights, so the file holds exactly those values."""
    transformers = pytest.importorskip("transformers")
    model = tm.build_hf_model(tm.K_SPECS[name])
    original = tm.hf_logits(model, PROMPT)
    tm.quantize_roundtrip_(model, weight_type)
    ref = tm.hf_logits(model, PROMPT)
    assert (ref - original).abs().max().item() > 0.1  # the round trip really changed the weights
    fname = f"{name}-{weight_type}.gguf"
    path = tm.write_gguf(model, str(tmp_path / fname), weight_type=weight_type)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {n: t for n, t in types.items() if not n.endswith("norm.weight")} == _expected_kquant_types(name, weight_type)
    assert {t for n, t in types.items() if n.endswith("norm.weight")} == {"F32"}
    if (name, weight_type) == ("kquant_mix", "q4_k_m"):  # the mix of SmolLM2's llama.cpp Q4_K_M file
        assert set(types.values()) == {"F32", "Q4_K", "Q6_K", "Q5_0", "Q8_0"}

    hf_file = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=fname, dtype=torch.float32).eval()
    from_file = tm.hf_logits(hf_file, PROMPT)
    assert_logits_close(from_file, ref)
    llm = LLM(model=path, progress=False)
    assert_logits_close(llm.compute_logits(PROMPT), from_file)
    tokens = greedy(llm, [PROMPT])[0]
    assert tokens == tm.hf_greedy(hf_file, PROMPT, N_GREEDY) == tm.hf_greedy(model, PROMPT, N_GREEDY)
    assert len(set(tokens)) >= 8  # not a degenerate loop


# SmolLM2's shapes in small: 288-wide rows are not whole K-quant super-blocks, so a q4_k_m file
# of it holds Q5_0 (Q4_K's fallback) and Q8_0 (Q6_K's) attention and gate/up weights, a Q5_0 and
# Q8_0 mix in the fused qkv of layers 2 and 3, a Q8_0 tied embedding, and Q4_K / Q6_K ffn_down.
SMOL_MIX = tm.TinySpec("smol_mix", hidden_size=288, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
                       tie_word_embeddings=True, seed=13)
# fasterllama module -> its GGUF tensors in row order (fused projections: several)
_GGUF_PARTS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
               "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


def _file_weight(t, spec: tm.TinySpec) -> np.ndarray:
    """A GGUF tensor as gguf-py dequantizes it, Q/K rows back in HF order (llama_cpp_permute undone)."""
    w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0])).astype(np.float32)
    heads = {"attn_q": spec.num_heads, "attn_k": spec.num_kv_heads}.get(t.name.split(".")[-2])
    if heads is None:
        return w
    return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


_TYPE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6,
              "IQ4_NL": 9, "IQ4_XS": 9}  # 9: the kernels' width code of IQ4's table values (ops.quantized.NL4)


@pytest.mark.parametrize("name,weight_type", [("smol_mix", "q5_0"), ("smol_mix", "q4_k_m"), ("kquant_mix", "q4_k_m"), ("kquant", "q4_k_m"),
                                              ("kquant", "q5_1"), ("kquant", "q2_k"), ("smol_mix", "iq4_nl"), ("kquant_mix", "iq4_xs")])
def test_gguf_tensors_kept_in_blocks(tmp_path, name: str, weight_type: str) -> None:
    """Every quantized linear of a GGUF file stays quantized (PackedLinear), a fused projection of
    parts of different types as a FusedLinear of each part in its own width (Q5_0 q/k beside Q8_0
    v), dequantizing to exactly gguf-py's floats; logits equal HF transformers loading the same file
    within 1e-4, greedy tokens are identical, alone and in a batch, and decode still runs as one C
    call."""
    transformers = pytest.importorskip("transformers")
    from fasterllama.backends.cpu import kernels as ck
    from fasterllama.quant.linear import FusedLinear, PackedLinear

    spec = SMOL_MIX if name == "smol_mix" else tm.K_SPECS[name]
    model = tm.quantize_roundtrip_(tm.build_hf_model(spec), weight_type)
    fname = f"{name}-{weight_type}.gguf"
    path = tm.write_gguf(model, str(tmp_path / fname), weight_type=weight_type)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    llm = LLM(model=path, progress=False)
    net = llm.engine.model

    modules = {f"layers.{i}.{m}": [f"blk.{i}.{p}.weight" for p in parts] for i in range(spec.num_layers) for m, parts in _GGUF_PARTS.items()}
    modules["lm_head"] = ["token_embd.weight" if spec.tie_word_embeddings else "output.weight"]
    seen = set()
    for module_name, parts in modules.items():
        types = frozenset(tensors[p].tensor_type.name for p in parts)
        module = net.get_submodule(module_name)
        pieces = list(module.parts) if isinstance(module, FusedLinear) else [module]
        assert all(isinstance(p, PackedLinear) for p in pieces), (module_name, types, type(module))
        assert {p.bits for p in pieces} == {_TYPE_BITS[t] for t in types}, (module_name, types)  # no part widened
        want = np.concatenate([_file_weight(tensors[p], spec) for p in parts])
        assert torch.equal(module.dequantize(), torch.from_numpy(want)), module_name
        seen.add(types)
    if weight_type == "q5_0":
        assert seen == {frozenset({"Q5_0"})}
    elif weight_type == "iq4_nl":  # the tied embedding is the output matrix: Q6_K, Q8_0 at 288-wide rows (llama.cpp's mix)
        assert seen == {frozenset({"IQ4_NL"}), frozenset({"Q8_0"})}
    elif name == "smol_mix":  # as in SmolLM2's llama.cpp Q4_K_M file
        assert {frozenset({"Q5_0"}), frozenset({"Q8_0"}), frozenset({"Q5_0", "Q8_0"}), frozenset({"Q4_K"}), frozenset({"Q6_K"})} <= seen
    elif weight_type == "q4_k_m":
        assert {frozenset({"Q4_K"}), frozenset({"Q6_K"})} <= seen
    elif weight_type == "q2_k":  # 2-bit values in their own planes
        assert frozenset({"Q2_K"}) in seen
    elif weight_type == "iq4_xs":  # and IQ4_NL where rows are not whole super-blocks
        assert {frozenset({"IQ4_XS"}), frozenset({"IQ4_NL"})} <= seen
    if ck.load() is not None:
        assert llm.engine.runner.decode_plan is not None

    hf_file = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=fname, dtype=torch.float32).eval()
    assert_logits_close(llm.compute_logits(PROMPT), tm.hf_logits(hf_file, PROMPT))
    tokens = greedy(llm, [PROMPT])[0]
    assert tokens == tm.hf_greedy(hf_file, PROMPT, N_GREEDY)
    assert len(set(tokens)) >= 8  # not a degenerate loop
    assert greedy(llm, [BATCH_PROMPTS[0], PROMPT, BATCH_PROMPTS[2]])[1] == tokens  # batched decode steps: the fused parts' outputs interleave by row


def test_gguf_a8(tmp_path, monkeypatch) -> None:
    """quantization "gguf-a8": the same blocks as "gguf", and every linear takes x rounded to int8 by
    chunk: each product a prompt makes equals its reference op on the same input (the whole model
    cannot: a last-bit difference upstream moves a rounding by a step), the logits stay near the
    exact ones without equalling them, and decode steps (the 1-2 row GEMVs) give the same tokens as
    one C call, op by op and through the reference ops."""
    from test_cpu_kernels import _three_ways

    from fasterllama import ops
    from fasterllama.ops import quantized as qops
    from fasterllama.quant.linear import PackedLinear

    model = tm.quantize_roundtrip_(tm.build_hf_model(SMOL_MIX), "q4_k_m")
    path = tm.write_gguf(model, str(tmp_path / "smol_mix-q4_k_m.gguf"), weight_type="q4_k_m")
    exact, a8 = LLM(model=path, progress=False), LLM(model=path, progress=False, quantization="gguf-a8")
    assert a8.engine.quant_config == "gguf-a8"
    flags = [[m.int8_activations for m in llm.engine.model.modules() if isinstance(m, PackedLinear)] for llm in (exact, a8)]
    assert len(flags[1]) > 8 and not any(flags[0]) and all(flags[1])
    kernel, widths = ops.get_op("panel_linear_a8", "cpu"), set()

    def checked(x, qp, sp, mp, n, bits, bias=None, sups=None):
        y = kernel(x, qp, sp, mp, n, bits, bias, sups)
        assert_logits_close(y, qops.panel_linear_a8(x, qp, sp, mp, n, bits, bias, sups), atol=1e-5 * y.abs().max().item())
        widths.add(bits)
        return y

    with monkeypatch.context() as mp:
        mp.setitem(ops._BACKENDS.setdefault("cpu", {}), "panel_linear_a8", checked)
        mp.setattr(a8.engine.runner, "decode_plan", None)  # the prompt op by op, through the checked op
        got = a8.compute_logits(LONG_PROMPT)
    assert widths == {4, 5, 6, 8}  # Q4_K, Q5_0, Q6_K, Q8_0 (the tied head)
    want = exact.compute_logits(LONG_PROMPT)
    rel = (got - want).abs().max().item() / want.abs().max().item()
    assert 1e-6 < rel < 0.15, rel  # 0.07: 4 random layers amplify the rounding more than a trained model does
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    (one_call, one_lp), (op_by_op, op_lp), (reference, _) = _three_ways(a8, [LONG_PROMPT, PROMPT], params)
    assert one_call == op_by_op == reference and one_call[0][0] == int(got[-1].argmax())
    # the same kernels called by the C step and by the model's ops, whose norms, SiLU and attention
    # sum in another order: an ulp there can move an activation across a rounding, one int8 step,
    # which these 4 random layers amplify (PROMPT's steps: 0.04 apart; "gguf": 2e-4; LONG_PROMPT's 1e-6)
    for toks, a, b in zip(one_call, one_lp, op_lp):
        for t, sa, sb in zip(toks, a, b):  # (the runner-up may differ where two tokens nearly tie)
            assert abs(sa[t] - sb[t]) < 0.1


def test_gguf_a8_in_bf16(tmp_path) -> None:
    """quantization "gguf-a8" in bf16 on the CPU (where the a8 kernels take fp32 only, so the
    reference ops run): every product returns x's dtype, so K/V store into the bf16 cache (until
    2026-11-30 the fp32 products failed there), and the logits stay near fp32's."""
    model = tm.quantize_roundtrip_(tm.build_hf_model(SMOL_MIX), "q4_0")
    path = tm.write_gguf(model, str(tmp_path / "smol_mix-q4_0.gguf"), weight_type="q4_0")
    half, full = (LLM(model=path, progress=False, quantization="gguf-a8", dtype=dtype) for dtype in ("bfloat16", "float32"))
    got, want = half.compute_logits(PROMPT), full.compute_logits(PROMPT)
    assert (got.float() - want).abs().max().item() < 0.1 * want.abs().max().item()
    assert len(greedy(half, [PROMPT], 3)[0]) == 3


@pytest.mark.parametrize("weight_type", ["q8_0", "q4_k_m"])
def test_gguf_biases_kept(tmp_path, weight_type: str) -> None:
    """A llama GGUF with q/k/v/o and MLP `.bias` tensors (llama.cpp reads them as optional): the
    quantized layers that replace the float ones keep the biases (a fused projection's parts each
    their rows), so logits equal the HF model holding the same dequantized weights and biases."""
    from fasterllama.quant.linear import FusedLinear

    spec = dataclasses.replace(SMOL_MIX, name="smol_bias", attention_bias=True, mlp_bias=True)
    model = tm.quantize_roundtrip_(tm.build_hf_model(spec), weight_type)
    ref = tm.hf_logits(model, PROMPT)
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()
    assert (tm.hf_logits(model, PROMPT) - ref).abs().max().item() > 0.1  # the biases matter
    path = tm.write_gguf(tm.quantize_roundtrip_(tm.build_hf_model(spec), weight_type), str(tmp_path / f"bias-{weight_type}.gguf"), weight_type)
    llm = LLM(model=path, progress=False)
    qkv = llm.engine.model.get_submodule("layers.2.self_attn.qkv_proj")
    assert not isinstance(qkv, torch.nn.Linear) and (weight_type == "q8_0" or isinstance(qkv, FusedLinear))
    assert_logits_close(llm.compute_logits(PROMPT), ref)
    assert greedy(llm, [PROMPT]) == [tm.hf_greedy(tm.quantize_roundtrip_(tm.build_hf_model(spec), weight_type), PROMPT, N_GREEDY)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_chunked_prefill_matches_hf(zoo: Zoo, fmt: str) -> None:
    """A 7-token step budget splits prompts into chunks (mixed with other sequences' decodes)."""
    name = "gqa"
    llm = LLM(model=zoo.path(name, fmt), progress=False, max_num_batched_tokens=7)
    assert_logits_close(llm.compute_logits(LONG_PROMPT), tm.hf_logits(zoo.hf(name), LONG_PROMPT))
    assert greedy(llm, BATCH_PROMPTS) == [zoo.hf_greedy(name, p) for p in BATCH_PROMPTS]
