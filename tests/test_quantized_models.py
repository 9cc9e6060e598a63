"""Quantized models end to end on the default model: perplexity close to fp32, resident weight
memory, GGUF quants kept natively (exact), and quantize -> save -> load round trips."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import decode_tolerance, default_model_path

from fasterllama import LLM, SamplingParams
from fasterllama.evaluate import perplexity
from fasterllama.quant import weight_bytes
from fasterllama.quant.linear import Int8Linear, PackedLinear

pytestmark = pytest.mark.skipif(default_model_path() is None, reason="default model not installed")

EVAL = "/usr/share/common-licenses/GPL-3"
CALIBRATION = "/usr/share/common-licenses/Apache-2.0"
N_TOKENS = 1024


def _text(path: str, fallback: str) -> str:
    return open(path, encoding="utf-8").read() if os.path.isfile(path) else fallback


@pytest.fixture(scope="module")
def eval_ids(default_llm):
    text = _text(EVAL, " ".join(f"Sentence number {i} talks about the weather and the sea." for i in range(400)))
    return default_llm.tokenizer.encode(text)[:N_TOKENS]


@pytest.fixture(scope="module")
def fp32_ppl(fp32_llm, eval_ids):
    return perplexity(fp32_llm, eval_ids, progress=False)["perplexity"]


# (mode, allowed perplexity increase over fp32 on these 1024 tokens, max weight bytes vs fp32);
# w4-g32: +0.00% and 0.183 with its int8 head (+3.4% and 0.156 with -head4), 2026-11-27; w4-g32-sym
# (Q4_0's groups, no search): +19.6%, 2026-11-30
MODES = [("w8", 0.01, 0.30), ("w8-g32", 0.01, 0.30), ("w4-g32", 0.01, 0.19), ("w4-g32-sym", 0.25, 0.19), ("w8a8", 0.02, 0.45),
         ("w8a8-static", 0.05, 0.45)]


@pytest.mark.parametrize("mode,max_increase,max_bytes", MODES, ids=[m[0] for m in MODES])
def test_quantized_perplexity_and_memory(fp32_llm, eval_ids, fp32_ppl, mode, max_increase, max_bytes):
    llm = LLM(quantization=mode, calibration_text=_text(CALIBRATION, "") or None, progress=False)
    ppl = perplexity(llm, eval_ids, progress=False)["perplexity"]
    assert ppl <= fp32_ppl * (1 + max_increase), (mode, ppl, fp32_ppl)
    ratio = weight_bytes(llm.engine.model) / weight_bytes(fp32_llm.engine.model)
    assert ratio <= max_bytes, (mode, ratio)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert "Paris" in out.text or mode.endswith("-sym")  # (Q4_0's groups lose this fact at 135M parameters)
    if mode == "w8a8":  # on a GGUF the Q8_0 lm_head (the tied embedding) stays int8: the file's weights exactly
        model = llm.engine.model
        assert llm.engine.quant_config.int8_lm_head and isinstance(model.lm_head, Int8Linear)
        assert model.embed_tokens.table is model.lm_head
        assert torch.equal(model.lm_head.dequantize(), fp32_llm.engine.model.lm_head.weight)


def test_gguf_quants_kept_natively_and_exact(default_llm, fp32_llm):
    """The default keeps the file's Q4_1/Q8_0 tensors; their kernels see the very floats that
    dequantizing the file gives, so only summation order can differ from the fp32 model."""

    model, ref = default_llm.engine.model, fp32_llm.engine.model
    assert default_llm.engine.quant_config == "gguf" and fp32_llm.engine.quant_config is None
    assert weight_bytes(model) <= 1.3 * os.path.getsize(default_model_path()) < weight_bytes(ref) / 3
    assert isinstance(model.layers[0].mlp.gate_up_proj, PackedLinear) and model.layers[0].mlp.gate_up_proj.bits == 4  # Q4_1 in the file
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.bits == 8  # the tied Q8_0 embedding
    for layer in (0, 17, 29):
        assert torch.equal(model.layers[layer].mlp.gate_up_proj.dequantize(), ref.layers[layer].mlp.gate_up_proj.weight)
        assert torch.equal(model.layers[layer].self_attn.qkv_proj.dequantize(), ref.layers[layer].self_attn.qkv_proj.weight)
    assert torch.equal(model.lm_head.dequantize(), ref.lm_head.weight)
    ids = default_llm.tokenizer.encode("Quantized weights, repacked exactly, give the same logits.")
    torch.testing.assert_close(default_llm.compute_logits(ids), fp32_llm.compute_logits(ids), rtol=0, atol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
    a, b = default_llm.generate([ids], params)[0], fp32_llm.generate([ids], params)[0]
    assert a.token_ids == b.token_ids  # decode steps through the 4-bit and the fp32 kernels
    assert max(abs(x[t] - y[t]) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids)) < decode_tolerance()


@pytest.mark.parametrize("source,mode", [("tiny", "w4-g64"), ("tiny", "w8a8-static-mse"),
                                         pytest.param("smollm2-135m-instruct", "w8a8", marks=pytest.mark.real_model)])
def test_quantize_command_round_trip(tmp_path, source, mode):
    """`fasterllama quantize` writes a checkpoint that loads to the same logits and chat prompt as
    quantizing at load time: static scales, searched 4-bit groups (on a tiny model: each takes ~20 s
    of calibration or search on the real one, twice here), and the GGUF's chat template, tokenizer
    and int8 head with SmoothQuant's calibration on the real model."""
    if source == "tiny":
        import tiny_models as tm

        source = tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["gqa"]), str(tmp_path / "hf"))
    out = tmp_path / "q"
    proc = subprocess.run([sys.executable, "-m", "fasterllama", "quantize", "-q", "--mode", mode, "-o", str(out), source],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    fresh = LLM(source, quantization=mode, progress=False)
    saved = LLM(str(out), progress=False)
    ids = fresh.tokenizer.encode("Saving must not change a single logit.")
    torch.testing.assert_close(saved.compute_logits(ids), fresh.compute_logits(ids), rtol=0, atol=0)
    assert saved.tokenizer.chat_template == fresh.tokenizer.chat_template
    if fresh.tokenizer.chat_template:  # (the tiny model's tokenizer has none)
        msgs = [{"role": "user", "content": "Hi"}]
        assert saved.chat_prompt(msgs) == fresh.chat_prompt(msgs)


def test_quantization_errors(tmp_path):
    from fasterllama.errors import FasterLlamaError

    with pytest.raises(FasterLlamaError, match="unknown quantization mode 'w3'.*none .*gguf"):
        LLM(quantization="w3", progress=False)
    import tiny_models as tm

    hf_folder = tm.save_hf_checkpoint(tm.build_hf_model(tm.TinySpec("plain")), str(tmp_path / "hf"))
    for mode in ("gguf", "gguf-a8"):
        with pytest.raises(FasterLlamaError, match="not a GGUF file"):
            LLM(tmp_path / "hf", quantization=mode, progress=False)
    assert LLM(hf_folder, progress=False).engine.quant_config is None  # the default on other checkpoints: float
    kept = LLM(progress=False)  # the default model: its 4-bit tensors kept
    with pytest.raises(FasterLlamaError, match="quantized already.*none"):
        kept.engine.quantize("w8")
    proc = subprocess.run([sys.executable, "-m", "fasterllama", "generate", "--quantization", "w9", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "quantization" in proc.stderr
