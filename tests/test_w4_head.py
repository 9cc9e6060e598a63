"""w4 keeps the lm_head / embedding in int8 groups of 32 by default (`-head4` asks for 4 bits):
that one matrix in 4 bits was most of w4's perplexity loss. Saved checkpoints keep their head."""

from __future__ import annotations

import json
import os

import pytest
import tiny_models as tm
import torch

from fasterllama import LLM
from fasterllama.quant.checkpoint import save_quantized
from fasterllama.quant.linear import Int4Linear, Int8Linear

PROMPT = [(5 * i) % 180 + 7 for i in range(40)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    model = tm.build_hf_model(tm.SPECS["tied"])  # one matrix for the embedding and the lm_head
    yield tm.save_hf_checkpoint(model, str(tmp_path_factory.mktemp("w4head") / "hf"))
    torch.set_num_threads(2)


def _head_error(llm: LLM, ref: LLM) -> float:
    """Mean |logit error| over the prompt (the max of one random model's logits is noise: with
    searched 4-bit scales the 4-bit head's worst logit came out closer, its mean much worse)."""
    return (llm.compute_logits(PROMPT) - ref.compute_logits(PROMPT)).abs().mean().item()


def test_w4_head_in_int8_by_default(folder):
    fp32 = LLM(folder, progress=False)
    w4, head4 = LLM(folder, quantization="w4-g64", progress=False), LLM(folder, quantization="w4-g64-head4", progress=False)
    m = w4.engine.model
    assert isinstance(m.layers[0].mlp.gate_up_proj, Int4Linear) and m.layers[0].mlp.gate_up_proj.group_size == 64
    assert isinstance(m.lm_head, Int8Linear) and m.lm_head.group_size == 32
    assert m.embed_tokens.table is m.lm_head  # tied: one int8 matrix for both
    assert isinstance(head4.engine.model.lm_head, Int4Linear)
    assert str(w4.engine.quant_config) == "w4-g64" and str(head4.engine.quant_config) == "w4-g64-head4"
    # the same 4-bit layers; the int8 head brings the logits closer to the float model's
    assert _head_error(w4, fp32) < _head_error(head4, fp32)


@pytest.mark.parametrize("spec", ["w4", "w4-head4"])
def test_saved_w4_keeps_its_head(folder, tmp_path, spec):
    llm = LLM(folder, quantization=spec, progress=False)
    out = str(tmp_path / "saved")
    save_quantized(llm.engine, out)
    modes = {f: os.stat(os.path.join(out, f)).st_mode & 0o777 for f in ("model.safetensors", "config.json")}
    assert modes["model.safetensors"] == modes["config.json"]  # (safetensors wrote the weights 0600: unreadable to others)
    loaded = LLM(out, progress=False)
    assert type(loaded.engine.model.lm_head) is type(llm.engine.model.lm_head)
    assert torch.equal(loaded.compute_logits(PROMPT), llm.compute_logits(PROMPT))


def test_checkpoint_saved_before_head_bits_loads_a_4bit_head(folder, tmp_path):
    """A w4 checkpoint written before QuantConfig.head_bits existed had a 4-bit head."""
    llm = LLM(folder, quantization="w4-head4", progress=False)
    out = str(tmp_path / "old")
    save_quantized(llm.engine, out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    del config["quantization_config"]["head_bits"]
    with open(path, "w") as f:
        json.dump(config, f)
    loaded = LLM(out, progress=False)
    assert isinstance(loaded.engine.model.lm_head, Int4Linear)
    assert torch.equal(loaded.compute_logits(PROMPT), llm.compute_logits(PROMPT))
