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
