"""Shared fixtures. The default model (and HF transformers on the same GGUF) load once a session."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> None:
    """Each test draws its random inputs from a seed of its own name: the same values whatever ran
    before it in its worker (under xdist the order differs run to run, and a test whose claim held
    for most draws but not all failed at random)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)

REAL_MODEL_FIXTURES = {"default_llm", "fp32_llm", "hf_default", "hf_tokenizer"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that load the real default model (in this process or a CLI subprocess) are `slow`:
    `-m "not slow"` is the fast tier, tiny random models only."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.slow)


def default_model_path() -> str | None:
    from fasterllama.loading.registry import DEFAULT_MODEL, KNOWN_MODELS

    return KNOWN_MODELS[DEFAULT_MODEL].path()


def decode_tolerance() -> float:
    """How far decode steps' log-probabilities may sit from a float forward's (compute_logits, the
    fp32 model): summation order (1e-4) where the GEMVs take fp32 x; 1e-3 where they round x to
    int16 per 8 columns (AVX2 builds, kernels.gemv_x: 6e-4 measured against HF transformers)."""
    from fasterllama.backends.cpu import kernels as ck

    return 1e-3 if ck.gemv_x_block() else 1e-4


@pytest.fixture(scope="session")
def default_llm():
    from fasterllama import LLM

    if default_model_path() is None:
        pytest.skip("default model not installed")
    return LLM(progress=False)


@pytest.fixture(scope="session")
def fp32_llm():
    """The default model with every tensor dequantized to fp32 (quantization="none")."""
    from fasterllama import LLM

    if default_model_path() is None:
        pytest.skip("default model not installed")
    return LLM(quantization="none", progress=False)


@pytest.fixture(scope="session")
def hf_tokenizer():
    """HF transformers' tokenizer of the default GGUF (without its model: loading that dequantizes
    every tensor in Python, ~40 s on a slow machine)."""
    path = default_model_path()
    if path is None:
        pytest.skip("default model not installed")
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def hf_default(hf_tokenizer, tmp_path_factory):
    """(model, tokenizer) of HF transformers loading the default GGUF in fp32: the reference.
    HF's GGUF load parses the file's metadata in Python, twice (~36 s on a slow machine), so under
    pytest-xdist the first worker saves what it loaded (its config and state dict, the same fp32
    values) for the others to read back (~3 s)."""
    path = default_model_path()
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(path)

    def from_gguf():
        return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        model = from_gguf()
    else:
        from filelock import FileLock

        shared = tmp_path_factory.getbasetemp().parent / "hf_default.pt"  # this run's, shared by its workers
        with FileLock(f"{shared}.lock"):
            if shared.is_file():
                saved = torch.load(shared, weights_only=True)
                config = transformers.AutoConfig.for_model(**saved["config"])
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
                model.load_state_dict(saved["state"])
            else:
                model = from_gguf()
                config = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}  # (HF's GGUF marker)
                torch.save({"config": config, "state": model.state_dict()}, shared)
    model.eval()
    return model, hf_tokenizer
