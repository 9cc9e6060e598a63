"""Quantized models end to end on the default model: perplexity close to fp32, resident weight
memory, GGUF quants kept natively (exact), and quantize -> save -> load round trips."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import default_model_path
from fasterllama import LLM, SamplingParams
from fasterllama.evaluate import perplexity
from fasterllama.quant import weight_bytes

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
def fp32_ppl(default_llm, eval_ids):
    return perplexity(default_llm, eval_ids, progress=False)["perplexity"]


# (mode, allowed perplexity increase over fp32 on these 1024 tokens, max weight bytes vs fp32)
MODES = [("w8", 0.01, 0.30), ("w8-g32", 0.01, 0.30), ("w4-g32", 0.08, 0.18), ("w8a8", 0.02, 0.45), ("w8a8-static", 0.05, 0.45)]


@pytest.mark.parametrize("mode,max_increase,max_bytes", MODES, ids=[m[0] for m in MODES])
def test_quantized_perplexity_and_memory(default_llm, eval_ids, fp32_ppl, mode, max_increase, max_bytes):
    llm = LLM(quantization=mode, calibration_text=_text(CALIBRATION, "") or None, progress=False)
    ppl = perplexity(llm, eval_ids, progress=False)["perplexity"]
    assert ppl <= fp32_ppl * (1 + max_increase), (mode, ppl, fp32_ppl)
    ratio = weight_bytes(llm.engine.model) / weight_bytes(default_llm.engine.model)
    assert ratio <= max_bytes, (mode, ratio)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert "Paris" in out.text


def test_gguf_quants_kept_natively_and_exact(default_llm):
    llm = LLM(quantization="gguf", progress=False)
    file_size = os.path.getsize(default_model_path())
    assert weight_bytes(llm.engine.model) <= 1.3 * file_size
    ids = default_llm.tokenizer.encode("Quantized weights, repacked exactly, give the same logits.")
    torch.testing.assert_close(llm.compute_logits(ids), default_llm.compute_logits(ids), rtol=1e-4, atol=1e-4)
    from fasterllama.quant.linear import Int4Linear, Int8Linear

    assert isinstance(llm.engine.model.layers[0].mlp.gate_up_proj, Int4Linear)  # Q4_1 in the file
    assert isinstance(llm.engine.model.lm_head, Int8Linear)  # the tied Q8_0 embedding


@pytest.mark.parametrize("mode", ["w4-g64", "w8a8-static-mse"])
def test_quantize_command_round_trip(tmp_path, mode):
    out = tmp_path / "q"
    proc = subprocess.run([sys.executable, "-m", "fasterllama", "quantize", "-q", "--mode", mode, "-o", str(out), "smollm2-135m-instruct"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    fresh = LLM(quantization=mode, progress=False)
    saved = LLM(str(out), progress=False)
    ids = fresh.tokenizer.encode("Saving must not change a single logit.")
    torch.testing.assert_close(saved.compute_logits(ids), fresh.compute_logits(ids), rtol=0, atol=0)
    msgs = [{"role": "user", "content": "Hi"}]
    assert saved.chat_prompt(msgs) == fresh.chat_prompt(msgs)


def test_quantization_errors(tmp_path):
    from fasterllama.errors import FasterLlamaError

    with pytest.raises(FasterLlamaError, match="unknown quantization mode"):
        LLM(quantization="w3", progress=False)
    proc = subprocess.run([sys.executable, "-m", "fasterllama", "generate", "--quantization", "w9", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "quantization" in proc.stderr
