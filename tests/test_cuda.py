"""The same engine on an NVIDIA GPU (skipped without CUDA): tiny random models against HF fp32 on
the CPU, so `LLM(device="cuda")` keeps the CPU path's guarantees: fp32 logits and greedy tokens
equal to HF's, batches equal to single requests, bf16 (the GPU default) close, and every
quantization mode giving what the same mode gives on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

import tiny_models as tm

from fasterllama import LLM, SamplingParams

NAMES = ["gqa", "mqa", "head_dim", "llama3_rope", "mistral"]
PROMPT = torch.randint(3, 320, (24,), generator=torch.Generator().manual_seed(7)).tolist()
BATCH = [PROMPT[:5], PROMPT, PROMPT[3:14]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, str]]:
    root = tmp_path_factory.mktemp("cuda_models")
    out = {}
    for name in NAMES:
        hf = tm.build_hf_model(tm.SPECS[name])
        out[name] = (hf, tm.save_hf_checkpoint(hf, os.path.join(root, name)))
    return out


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("name", NAMES)
def test_fp32_matches_hf(models, name: str) -> None:
    hf, path = models[name]
    llm = LLM(model=path, device="cuda", dtype="float32", progress=False)
    got = llm.compute_logits(PROMPT).cpu()
    ref = tm.hf_logits(hf, PROMPT)
    assert (got - ref).abs().max().item() < 1e-3
    assert _greedy(llm, [PROMPT]) == [tm.hf_greedy(hf, PROMPT, GREEDY.max_tokens)]
    assert _greedy(llm, BATCH) == [_greedy(llm, [p])[0] for p in BATCH]


@pytest.mark.parametrize("name", NAMES)
def test_bf16_default_is_close(models, name: str) -> None:
    hf, path = models[name]
    llm = LLM(model=path, device="cuda", progress=False)
    assert llm.engine.dtype == torch.bfloat16
    got = llm.compute_logits(PROMPT).float().cpu()
    ref = tm.hf_logits(hf, PROMPT)
    assert (got - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


@pytest.mark.parametrize("mode", ["w8", "w8-g32", "w4-g32", "w4-g32-sym", "w8a8", "w8a8-static-max"])
def test_quantized_same_as_cpu(models, mode: str) -> None:
    """The GPU holds w8-g32's group scales in fp16 and Q4_0-like groups without mins
    (compact_scales); the logits are still the CPU's."""
    from fasterllama.quant.linear import Int4Linear, Int8Linear

    _, path = models[NAMES[0]]
    cpu = LLM(model=path, device="cpu", dtype="float32", quantization=mode, progress=False)
    gpu = LLM(model=path, device="cuda", dtype="float32", quantization=mode, progress=False)
    if _kernel_backend(gpu) and mode in ("w8-g32", "w4-g32-sym"):
        linears = [m for m in gpu.engine.model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
        if mode == "w8-g32":
            grouped = [m for m in linears if m.group_size]
            assert grouped and all(m.weight_scale.dtype == torch.float16 for m in grouped)
        else:
            assert any(isinstance(m, Int4Linear) for m in linears) and all(m.mins is None for m in linears if isinstance(m, Int4Linear))
    a, b = cpu.compute_logits(PROMPT), gpu.compute_logits(PROMPT).cpu()
    # same integer weights; int8 activations may round differently at a few ties
    assert (a - b).abs().max().item() < 2e-2 * a.abs().max().item()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9
    assert len(_greedy(gpu, BATCH)[1]) == GREEDY.max_tokens


@pytest.mark.parametrize("name,weight_type", [("head_dim", "q8_0"), ("head_dim", "q4_1"), ("kquant", "q4_k_m"), ("kquant", "q6_k"),
                                              ("kquant_mix", "iq4_xs"), ("kquant", "q5_k"), ("kquant", "q2_k")])
def test_quantized_gguf_on_cuda(tmp_path, name: str, weight_type: str) -> None:
    """A GGUF's Q8_0/Q4_1 tensors, a Q4_K_M file's Q4_K / Q6_K / Q5_0 / Q8_0 ones, IQ4_XS / IQ4_NL
    ones (int8: their table's values) and Q5_K / Q5_1 / Q2_K ones (int8 with a min per group) stay
    quantized on the GPU too (the Triton GEMV/GEMM kernels read the file's values) and give HF's
    logits and tokens, as the CPU default does."""
    from fasterllama.quant.linear import Int4Linear, Int8Linear

    spec = tm.K_SPECS[name] if name in tm.K_SPECS else tm.SPECS[name]
    hf = tm.quantize_roundtrip_(tm.build_hf_model(spec), weight_type)
    path = tm.write_gguf(hf, str(tmp_path / f"tiny-{weight_type}.gguf"), weight_type=weight_type)
    ref = tm.hf_logits(hf, PROMPT)
    gpu = LLM(model=path, device="cuda", dtype="float32", progress=False)
    cpu = LLM(model=path, device="cpu", progress=False)
    assert gpu.engine.quant_config == "gguf"
    kept = [m for m in gpu.engine.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert len(kept) >= 4 * spec.num_layers  # every projection
    got = gpu.compute_logits(PROMPT).cpu()
    assert (got - ref).abs().max().item() < 1e-3
    assert (got - cpu.compute_logits(PROMPT)).abs().max().item() < 1e-3
    assert _greedy(gpu, [PROMPT]) == [tm.hf_greedy(hf, PROMPT, GREEDY.max_tokens)] == _greedy(cpu, [PROMPT])


@pytest.mark.parametrize("weight_type", ["q4_1", "q6_k"])
def test_gguf_a8_on_cuda(tmp_path, weight_type: str) -> None:
    """quantization "gguf-a8" on the GPU (decode through the integer GEMVs, IDP4A): logits near the
    CPU's gguf-a8 (the same arithmetic in another order: a rounding of x may step apart, which
    random layers amplify), and graph-replayed decode steps give the tokens of the same kernels
    launched one by one."""
    hf = tm.quantize_roundtrip_(tm.build_hf_model(tm.K_SPECS["kquant"]), weight_type)
    path = tm.write_gguf(hf, str(tmp_path / f"tiny-{weight_type}.gguf"), weight_type=weight_type)
    gpu = LLM(model=path, device="cuda", dtype="float32", quantization="gguf-a8", progress=False)
    cpu = LLM(model=path, device="cpu", quantization="gguf-a8", progress=False)
    a, b = cpu.compute_logits(PROMPT), gpu.compute_logits(PROMPT).cpu()
    assert (a - b).abs().max().item() < 5e-2 * a.abs().max().item()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.75
    if not _kernel_backend(gpu):
        pytest.skip("Triton kernels unavailable")
    runner = gpu.engine.runner
    graphed = _greedy(gpu, BATCH)
    runner.decode_plan, plan = None, runner.decode_plan
    try:
        assert _greedy(gpu, BATCH) == graphed and plan.graphs
    finally:
        runner.decode_plan = plan


def _kernel_backend(llm: LLM) -> bool:
    return getattr(llm.engine.backend, "kernels", False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", [None, "w8-g32", "w4-g32", "w8a8"])
def test_cuda_graph_decode_same_as_eager(models, dtype: str, quantization) -> None:
    """Decode steps replayed from CUDA graphs (batches padded to a bucket) give the tokens and
    logprobs of the same kernels launched one by one."""
    _, path = models["mistral"]
    llm = LLM(model=path, device="cuda", dtype=dtype, quantization=quantization, progress=False)
    if not _kernel_backend(llm):
        pytest.skip("Triton kernels unavailable")
    runner = llm.engine.runner
    assert runner.decode_plan is not None
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    graphed = llm.generate(BATCH, params)
    runner.decode_plan, plan = None, runner.decode_plan
    try:
        eager = llm.generate(BATCH, params)
    finally:
        runner.decode_plan = plan
    assert plan.graphs, "no decode step ran from a graph"
    for g, e in zip(graphed, eager):
        assert g.token_ids == e.token_ids
        for lg, le in zip(g.logprobs, e.logprobs):
            tol = 1e-4 if dtype == "float32" else 5e-2
            assert all(abs(lg[t] - le[t]) < tol for t in le if t in lg)
    if quantization is None and dtype == "bfloat16":  # vLLM's enforce_eager: no graphs, the same tokens
        no_graphs = LLM(model=path, device="cuda", dtype=dtype, progress=False, enforce_eager=True)
        assert no_graphs.engine.runner.decode_plan is None
        assert [o.token_ids for o in no_graphs.generate(BATCH, params)] == [o.token_ids for o in eager]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_chained_steps_same_as_unchained(models, dtype: str) -> None:
    """Decode steps launched before the last step's tokens are read (the default on CUDA: ids
    gathered on the device, graph replays queued behind each other) give the tokens of steps
    read one at a time, greedy and sampled, as sequences end at different steps."""
    _, path = models["gqa"]
    llm = LLM(model=path, device="cuda", dtype=dtype, progress=False, enable_prefix_caching=False)  # (both runs compute every prompt)
    engine = llm.engine
    if not _kernel_backend(llm):
        pytest.skip("Triton kernels unavailable")
    assert engine.chain_steps
    launched: list[int] = []
    launch = engine.runner.execute_chained
    engine.runner.execute_chained = lambda *args: (launched.append(len(args[2])), launch(*args))[1]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=5, max_tokens=16, ignore_eos=True)]
    chained = [o.token_ids for o in llm.generate(BATCH, params)]
    engine.chain_steps = False
    assert chained == [o.token_ids for o in llm.generate(BATCH, params)]
    assert launched[0] == 3 and launched[-1] == 1 and len(launched) >= 20


def test_cuda_programmatic_dependent_launch_changes_nothing(models, monkeypatch) -> None:
    """Kernels launched while the one before still runs (PDL, on Hopper: each waits for it before
    touching memory) give the logprobs and tokens of kernels launched after it, in graphs and eagerly."""
    from fasterllama.backends.cuda import pdl

    if pdl.OFF or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL off or before Hopper")
    _, path = models["mistral"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    runs = []
    for off in (False, True):
        monkeypatch.setattr(pdl, "OFF", off)
        llm = LLM(model=path, device="cuda", dtype="float32", quantization="w4-g32", progress=False)
        if not _kernel_backend(llm):
            pytest.skip("Triton kernels unavailable")
        runs.append(llm.generate(BATCH, params))
    for with_pdl, without in zip(*runs):  # (a kernel reading before the one before has written: far off)
        assert with_pdl.token_ids == without.token_ids
        for a, b in zip(with_pdl.logprobs, without.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_cuda_seeded_sampling_same_as_cpu(models) -> None:
    """Seeded sampling draws the same tokens on the GPU (graphs, kernels) as on the CPU."""
    _, path = models["gqa"]
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=3, max_tokens=12, ignore_eos=True)
    cpu = LLM(model=path, device="cpu", dtype="float32", progress=False)
    gpu = LLM(model=path, device="cuda", dtype="float32", progress=False)
    assert [o.token_ids for o in gpu.generate(BATCH, params)] == [o.token_ids for o in cpu.generate(BATCH, params)]


def test_cuda_speculative_decoding_same_tokens(models) -> None:
    """Prompt lookup and a draft model on the GPU (verify steps replayed from the decode graphs'
    buckets): greedy tokens as without speculation; the measured row cost is printed (a GPU row
    should be nearly free next to the CPU's ~0.35)."""
    _, path = models[NAMES[0]]
    prompts = [p * 3 for p in BATCH]
    plain = LLM(model=path, device="cuda", dtype="float32", progress=False)
    want = _greedy(plain, prompts)
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                 {"method": "draft_model", "model": path, "num_speculative_tokens": 3}):
        llm = LLM(model=path, device="cuda", dtype="float32", progress=False, speculative_config=spec)
        print(spec["method"], "row cost", llm.engine.speculator.row_cost, "draft cost", llm.engine.speculator.draft_cost)
        llm.engine.speculator.row_cost = llm.engine.speculator.draft_cost = 0.0
        assert _greedy(llm, prompts) == want
        assert llm.engine.speculator.num_accepted_tokens > 0
