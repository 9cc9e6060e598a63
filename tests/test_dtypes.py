"""bf16 / fp16 are selectable and stay close to the fp32 reference."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from fasterllama import LLM, SamplingParams

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    model = tm.build_hf_model(tm.SPECS["gqa"])
    folder = tm.save_hf_checkpoint(model, str(tmp_path_factory.mktemp("dtype") / "hf"))
    return model, folder


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_precision_close_to_fp32(tiny_folder, dtype, torch_dtype):
    hf, folder = tiny_folder
    llm = LLM(folder, dtype=dtype, progress=False)
    assert llm.engine.model.layers[0].self_attn.qkv_proj.weight.dtype == torch_dtype
    assert llm.engine.kv_cache.layers[0][0].dtype == torch_dtype
    ids = list(range(10, 40))
    ours, ref = llm.compute_logits(ids), tm.hf_logits(hf, ids)
    rel = (ours - ref).norm() / ref.norm()
    assert ours.dtype == torch.float32 and rel < 0.03, rel
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


def test_bad_dtype_and_device_errors(tiny_folder):
    from fasterllama.errors import FasterLlamaError

    _, folder = tiny_folder
    with pytest.raises(FasterLlamaError, match="dtype"):
        LLM(folder, dtype="int3", progress=False)
    with pytest.raises(FasterLlamaError, match="device"):
        LLM(folder, device="tpu", progress=False)


@pytest.mark.parametrize("mode", ["w8a8", "w8a8-static", "w4-g32"])
def test_quantizing_a_16bit_model_after_loading(tmp_path, mode):
    """engine.quantize on a bf16 folder loaded as stored (its matrices 16-bit) quantizes the fp32
    floats, as loading with quantization=mode does: the same logits (w8a8 crashed: its activations
    took the weights' bf16)."""
    hf = tm.build_hf_model(tm.TinySpec("tied16", num_heads=4, num_kv_heads=2, tie_word_embeddings=True)).to(torch.bfloat16)
    folder = tm.save_hf_checkpoint(hf, str(tmp_path / "bf16"))
    later = LLM(folder, progress=False)
    later.engine.quantize(mode)
    at_load = LLM(folder, quantization=mode, progress=False)
    ids = list(range(10, 40))
    assert torch.equal(later.compute_logits(ids), at_load.compute_logits(ids))
    assert later.generate([ids], SamplingParams(temperature=0, max_tokens=6))[0].token_ids == at_load.generate([ids], SamplingParams(temperature=0, max_tokens=6))[0].token_ids


@pytest.mark.parametrize("mode", ["w8", "w4-g32", "w8a8"])
def test_weight_only_modes_quantize_16bit_weights_without_an_fp32_copy(tmp_path, monkeypatch, mode):
    """quantization=w8 / w4 on a bf16 folder loads it 16-bit and widens one linear at a time as it
    quantizes (a bf16 7B model then quantizes without its 28 GB fp32 copy); w8a8 loads fp32 as
    before (SmoothQuant scales whole layers). Either way the result is the fp32 twin folder's, to the bit."""
    import fasterllama.engine.llm_engine as le

    hf = tm.build_hf_model(tm.TinySpec("untied16", num_heads=4, num_kv_heads=2, intermediate_size=96)).to(torch.bfloat16)
    half = tm.save_hf_checkpoint(hf, str(tmp_path / "bf16"))
    twin = tm.save_hf_checkpoint(hf.float(), str(tmp_path / "fp32"))
    kept, load = [], le.load_model
    monkeypatch.setattr(le, "load_model", lambda *a, **k: kept.append(a[-1]) or load(*a, **k))
    ids = list(range(10, 40))
    got, want = (LLM(path, quantization=mode, progress=False).compute_logits(ids) for path in (half, twin))
    assert kept == [mode != "w8a8"] * 2 and torch.equal(got, want)
