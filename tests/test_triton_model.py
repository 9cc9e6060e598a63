"""The CUDA backend end to end without a GPU: a tiny model whose every op runs as a Triton kernel
on CPU tensors under TRITON_INTERPRET=1, decode steps through the graph plan's static buffers and
batch padding (run eagerly where there are no graphs). Logits and greedy tokens must match HF,
and each quantization mode must give what the reference ops give on the same quantized model."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels in the interpreter (TRITON_INTERPRET=1)")

import tiny_models as tm  # noqa: E402

from fasterllama import SamplingParams, ops  # noqa: E402
from fasterllama.backends.cuda import CUDABackend  # noqa: E402
from fasterllama.backends.cuda.graphs import CUDAGraphDecode  # noqa: E402
from fasterllama.engine import llm_engine  # noqa: E402
from fasterllama.loading.model_loader import load_model  # noqa: E402

KQUANT_2 = dataclasses.replace(tm.K_SPECS["kquant"], name="kquant_2", num_layers=2)  # (the K-quant layouts on 2 layers: the interpreter's time)
PROMPT = torch.randint(3, 320, (12,), generator=torch.Generator().manual_seed(5)).tolist()
BATCH = [PROMPT[:3], PROMPT, PROMPT[2:9]]


class InterpretedCUDA(CUDABackend):
    """The CUDA backend's ops and decode plan, on CPU tensors."""

    def register_ops(self) -> None:
        from fasterllama.backends.cuda import kernel_ops

        for name, fn in kernel_ops().items():
            ops.register("cpu", name, fn)
        self.kernels = True


@pytest.fixture
def interpreted(monkeypatch):
    saved = dict(ops._BACKENDS.get("cpu", {}))
    ops._BACKENDS["cpu"] = {}
    monkeypatch.setattr(llm_engine, "get_backend", InterpretedCUDA)
    yield
    ops._BACKENDS["cpu"] = saved


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    hf = tm.build_hf_model(tm.TinySpec("gqa_hd16", num_heads=4, num_kv_heads=2, seed=11))  # head_dim 16: the kernels take 16..256
    return hf, tm.save_hf_checkpoint(hf, str(tmp_path_factory.mktemp("triton_model") / "gqa"))


def _engine(path: str, quantization: str | None) -> llm_engine.LLMEngine:
    loaded = load_model(path, torch.float32, torch.device("cpu"), None, True, progress=False)
    engine = llm_engine.LLMEngine.from_model(loaded.model, loaded.tokenizer, max_model_len=48, max_num_seqs=4)
    if quantization is not None:
        engine.quantize(quantization, calibration_tokens=64)  # (calibration runs through the interpreter too)
    return engine


def _greedy(engine: llm_engine.LLMEngine, prompts: list[list[int]], n: int = 6) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [s.output_token_ids for s in seqs]


def _with_reference_ops(engine, fn):
    """fn() with the reference ops and no decode plan (the oracle)."""
    saved, plan = dict(ops._BACKENDS["cpu"]), engine.runner.decode_plan
    ops._BACKENDS["cpu"], engine.runner.decode_plan = {}, None
    try:
        return fn()
    finally:
        ops._BACKENDS["cpu"], engine.runner.decode_plan = saved, plan


def test_triton_model_matches_hf(interpreted, gqa) -> None:
    hf, path = gqa
    engine = _engine(path, None)
    assert isinstance(engine.runner.decode_plan, CUDAGraphDecode)
    assert (engine.compute_logits(PROMPT) - tm.hf_logits(hf, PROMPT)).abs().max().item() < 1e-3
    assert _greedy(engine, [PROMPT]) == [tm.hf_greedy(hf, PROMPT, 6)]
    assert _greedy(engine, BATCH) == [tm.hf_greedy(hf, p, 6) for p in BATCH]  # 3 rows in a bucket of 4
    assert engine.runner.decode_plan.graphs.keys() == {1, 4}


@pytest.mark.parametrize("quantization", ["w8", "w8-g32", "w4-g32", "w8a8", "w8a8-static-max"])
def test_triton_model_quantized_same_as_reference(interpreted, gqa, quantization: str) -> None:
    _, path = gqa
    engine = _engine(path, quantization)
    got = engine.compute_logits(PROMPT)
    ref = _with_reference_ops(engine, lambda: engine.compute_logits(PROMPT))
    assert (got - ref).abs().max().item() < 2e-2 * ref.abs().max().item()  # int8 activations: ties may round apart
    tokens = _greedy(engine, BATCH)
    assert tokens == _with_reference_ops(engine, lambda: _greedy(engine, BATCH))


@pytest.mark.parametrize("quantization", [None, "w4-g32"])  # (the int8 GEMVs' fused modes: test_triton_gemv.py)
def test_triton_model_fused_gemvs_same_as_reference(interpreted, gqa, monkeypatch, quantization: str | None) -> None:
    """Where tune() finds it faster, the down projection's decode GEMV makes SiLU·mul itself
    (ops.silu_and_mul_linear) and the qkv and gate_up GEMVs make the add + RMSNorm before them
    (ops.rms_norm_linear; all chosen here for every shape): the reference ops' tokens, through the
    graph plan's batch-1 bucket (the 4-row bucket takes the separate kernels and the tiled GEMMs)."""
    from fasterllama.backends.cuda import gemv

    class Everywhere(dict):
        def get(self, key, default=None):
            return True

    monkeypatch.setattr(gemv, "_GATED", Everywhere())
    monkeypatch.setattr(gemv, "_NORMED", Everywhere())
    monkeypatch.setitem(gemv.DEFAULT, "float", "gemv")
    calls = []
    module_gemv = gemv._module_gemv

    def watched(module, x, gated=False, norm=None):
        calls.append("gated" if gated else "normed" if norm is not None else "plain")
        return module_gemv(module, x, gated, norm)

    monkeypatch.setattr(gemv, "_module_gemv", watched)
    hf, path = gqa
    engine = _engine(path, quantization)
    tokens = _greedy(engine, [PROMPT])
    layers = hf.config.num_hidden_layers  # every layer's down projection, qkv and gate_up (in the graph's capture at least)
    assert calls.count("gated") >= layers and calls.count("normed") >= 2 * layers
    assert tokens == _with_reference_ops(engine, lambda: _greedy(engine, [PROMPT]))


@pytest.mark.parametrize("quantization", ["w4-g32", "w8-g32"])
def test_triton_model_mma_gemvs_same_as_the_other_kernels(interpreted, gqa, monkeypatch, quantization: str) -> None:
    """A bf16 model whose every 4-bit or int8 linear is served by the MMA GEMV (gemv_mma.py: the
    one-row config in the batch-1 bucket, the batch config in the 4-row bucket and for prompts of
    up to 16 tokens, as tune() may choose): the tokens and logits of the GEMVs and tiled kernels."""
    from fasterllama.backends.cuda import gemv, gemv_mma

    _, path = gqa
    loaded = load_model(path, torch.bfloat16, torch.device("cpu"), None, True, progress=False)
    engine = llm_engine.LLMEngine.from_model(loaded.model, loaded.tokenizer, max_model_len=48, max_num_seqs=4)
    engine.quantize(quantization, calibration_tokens=64)
    want_tokens, want_logits = (_greedy(engine, [PROMPT], 3), _greedy(engine, BATCH, 3)), engine.compute_logits(PROMPT)  # (3 tokens: 2 decode steps a bucket)

    class MMAEverywhere(dict):
        def get(self, key, default=None):
            return ("gemv-mma", gemv_mma.BATCH_CONFIGS[0] if key[0].endswith("rows") else gemv_mma.MMA_CONFIGS[0])

    rows = []
    for name in ("int4_gemv_mma", "int8_gemv_mma"):
        real = getattr(gemv_mma, name)
        monkeypatch.setattr(gemv_mma, name, lambda x, *a, real=real, **k: (rows.append(x.numel() // x.shape[-1]), real(x, *a, **k))[1])
    monkeypatch.setattr(gemv, "_CHOICE", MMAEverywhere())
    assert (_greedy(engine, [PROMPT], 3), _greedy(engine, BATCH, 3)) == want_tokens
    got = engine.compute_logits(PROMPT)
    assert (got.float() - want_logits.float()).abs().max().item() < 2e-2 * want_logits.float().abs().max().item()
    assert {1, 4, len(PROMPT)} <= set(rows)  # the decode buckets of 1 and 4 rows, a 12-token prompt


def test_speculative_verify_steps_replay_the_decode_buckets(interpreted, gqa) -> None:
    """Prompt-lookup verify steps (a row per drafted token) run in the decode buckets: greedy tokens
    as without speculation, drafts accepted and rejected."""
    from fasterllama.engine.proposers import NgramProposer
    from fasterllama.engine.speculative import Speculator

    _, path = gqa
    engine = _engine(path, None)
    prompts = [PROMPT + PROMPT[:6], BATCH[0] * 3]
    want = _greedy(engine, prompts, 10)
    assert engine.runner.max_verify_rows == 4  # the largest bucket
    engine.speculator = Speculator(NgramProposer(1, 6), 3, 0.0, engine.runner.max_verify_rows)  # a row costs nothing: draft all it may
    assert _greedy(engine, prompts, 10) == want
    assert _greedy(engine, prompts[:1], 10) == want[:1]  # alone: 1 + 3 rows in the bucket of 4
    s = engine.speculator
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert 4 in engine.runner.decode_plan.graphs


@pytest.mark.parametrize("weight_type,decode_steps", [("q5_k", 2), ("q2_k", 0)])  # (the interpreter's time: one decode check)
def test_gguf_off_cpu_layouts_with_mins(interpreted, monkeypatch, tmp_path, weight_type: str, decode_steps: int) -> None:
    """A Q5_K (Q5_1 where rows are short) or Q2_K file in the row layouts a GPU loads (int8 values
    with a scale and a min per group, gguf_native._module off the CPU), through the Triton kernels:
    HF's logits on the same file, and its greedy tokens through the decode GEMVs."""
    from fasterllama.quant import gguf_native
    from fasterllama.quant.linear import Int8Linear

    real = gguf_native._module
    monkeypatch.setattr(gguf_native, "_module", lambda parts, device: real(parts, torch.device("cuda")))
    hf = tm.quantize_roundtrip_(tm.build_hf_model(KQUANT_2), weight_type)
    path = tm.write_gguf(hf, str(tmp_path / f"tiny-{weight_type}.gguf"), weight_type=weight_type)
    loaded = load_model(path, torch.float32, torch.device("cpu"), None, True, progress=False)
    with_mins = [m for m in loaded.model.modules() if isinstance(m, Int8Linear) and m.weight_min is not None]
    assert len(with_mins) >= 4 * KQUANT_2.num_layers  # every projection kept quantized, none as float
    engine = llm_engine.LLMEngine.from_model(loaded.model, loaded.tokenizer, max_model_len=48, max_num_seqs=4)
    assert (engine.compute_logits(PROMPT) - tm.hf_logits(hf, PROMPT)).abs().max().item() < 1e-3
    if decode_steps:
        assert _greedy(engine, [PROMPT], decode_steps) == [tm.hf_greedy(hf, PROMPT, decode_steps)]


def test_gguf_q4_k_off_cpu_in_its_factored_form(interpreted, monkeypatch, tmp_path) -> None:
    """A Q4_K file in the layout a GPU loads (int8 sub-block scales and mins with fp16 d / -dmin,
    laid out in pairs by compact_scales), through the Triton kernels: HF's logits on the same
    file, and its greedy tokens through the decode GEMVs."""
    from fasterllama.backends.cuda import compact_scales
    from fasterllama.quant import gguf_native
    from fasterllama.quant.linear import Int4Linear

    real = gguf_native._module
    monkeypatch.setattr(gguf_native, "_module", lambda parts, device: real(parts, torch.device("cuda")))
    hf = tm.quantize_roundtrip_(tm.build_hf_model(KQUANT_2), "q4_k")
    path = tm.write_gguf(hf, str(tmp_path / "tiny-q4_k.gguf"), weight_type="q4_k")
    loaded = load_model(path, torch.float32, torch.device("cpu"), None, True, progress=False)
    factored = [m for m in loaded.model.modules() if isinstance(m, Int4Linear) and m.sups is not None]
    assert len(factored) >= 4 * KQUANT_2.num_layers and compact_scales(loaded.model) >= len(factored)
    engine = llm_engine.LLMEngine.from_model(loaded.model, loaded.tokenizer, max_model_len=48, max_num_seqs=4)
    assert (engine.compute_logits(PROMPT) - tm.hf_logits(hf, PROMPT)).abs().max().item() < 1e-3
    assert _greedy(engine, [PROMPT], 2) == [tm.hf_greedy(hf, PROMPT, 2)]


def test_chained_steps_through_the_graph_plan(interpreted, gqa) -> None:
    """Chained decode steps (on by default with these kernels) through the graph plan: the ids
    gathered on the device from the last step's samples, rows dropped as sequences end; greedy
    and Triton-sampled tokens as without chaining."""
    _, path = gqa
    engine = _engine(path, None)
    plan = engine.runner.decode_plan
    chained: list[list[int]] = []
    run_chained = plan.run_chained
    plan.run_chained = lambda inputs, tokens, rows: (chained.append(list(rows)), run_chained(inputs, tokens, rows))[1]
    requests = [(BATCH[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
                (BATCH[1], SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=2, max_tokens=6, ignore_eos=True)),
                (BATCH[2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))]

    def run() -> list[list[int]]:
        seqs = [engine.add_request(p, params) for p, params in requests]
        while engine.has_unfinished():
            engine.step()
        return [s.output_token_ids for s in seqs]

    got = run()
    # (each launch's rows index the step before's: the first sequence's third token surely ends
    # it, so the second launch leaves it out; then the third's fifth)
    assert chained == [[0, 1, 2], [1, 2], [0, 1], [0]]
    engine.chain_steps = False
    assert run() == got and len(got[1]) == 6


@pytest.mark.parametrize("weight_type", ["q4_1", "q6_k"])  # 4-bit values with mins (chunks of 32), int8 values in groups of 16 (chunks of 16)
def test_gguf_a8_off_cpu_same_as_reference(interpreted, monkeypatch, tmp_path, weight_type: str) -> None:
    """quantization "gguf-a8" in the row layouts a GPU loads: prompts through x rounded to int8 and
    the tiled kernels, decode steps through the integer GEMVs (gemv_a8.py, in the graph plan's
    buckets). Each product equals its reference op on the same input; the whole model cannot (an
    ulp upstream moves a rounding of x by a step, which random layers amplify: test_parity_tiny's
    test_gguf_a8), so its logits are held near "gguf"'s and the reference ops' instead."""
    from fasterllama.backends.cuda import gemv_a8
    from fasterllama.ops import quantized
    from fasterllama.quant import gguf_native
    from fasterllama.quant.linear import Int4Linear, Int8Linear

    real = gguf_native._module
    monkeypatch.setattr(gguf_native, "_module", lambda parts, device: real(parts, torch.device("cuda")))
    spec = dataclasses.replace(tm.K_SPECS["kquant"], name="kquant_1", num_layers=1)  # (4 layers: 2-2.5 minutes interpreted on an AVX2 VM)
    hf = tm.quantize_roundtrip_(tm.build_hf_model(spec), weight_type)
    path = tm.write_gguf(hf, str(tmp_path / f"tiny-{weight_type}.gguf"), weight_type=weight_type)
    engines = {}
    for quantization in ("gguf", "gguf-a8"):
        loaded = load_model(path, torch.float32, torch.device("cpu"), quantization, True, progress=False)
        engines[quantization] = llm_engine.LLMEngine.from_model(loaded.model, loaded.tokenizer, max_model_len=48, max_num_seqs=4)
    engine = engines["gguf-a8"]
    linears = [m for m in engine.model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    assert len(linears) >= 4 * spec.num_layers and all(m.int8_activations for m in linears)
    rows, gemv_calls = [], []
    for name in ("int8_gemv_a8", "int4_gemv_a8"):
        real_gemv = getattr(gemv_a8, name)
        monkeypatch.setattr(gemv_a8, name, lambda x, *a, real_gemv=real_gemv, **k: (gemv_calls.append(x.shape), real_gemv(x, *a, **k))[1])
    for name in ("int8_weight_linear_a8", "int4_weight_linear_a8"):
        kernel, reference = ops._BACKENDS["cpu"][name], getattr(quantized, name)

        def checked(x, *args, kernel=kernel, reference=reference, **kwargs):
            y, want = kernel(x, *args, **kwargs), reference(x, *args, **kwargs)
            assert ((y - want).norm() / want.norm()).item() < 1e-5
            rows.append(x.numel() // x.shape[-1])
            return y

        monkeypatch.setitem(ops._BACKENDS["cpu"], name, checked)
    got = engine.compute_logits(PROMPT)
    ref = _with_reference_ops(engine, lambda: engine.compute_logits(PROMPT))
    exact = engines["gguf"].compute_logits(PROMPT)
    assert (got - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    assert 1e-4 < (got - exact).abs().max().item() / exact.abs().max().item() < 0.15
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean().item() >= 0.75
    tokens = _greedy(engine, BATCH[:2], 3)
    assert [len(t) for t in tokens] == [3, 3] and 2 in rows and max(rows) == len(PROMPT) + 3  # (decode steps: the two rows)
    assert gemv_calls and max(s[-2] if len(s) > 1 else 1 for s in gemv_calls) <= 2  # decode rows through the integer GEMVs
