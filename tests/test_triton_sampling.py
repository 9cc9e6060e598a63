"""The one-launch sampler (backends/cuda/triton_sampling.py) against the PyTorch sampler
(engine/sampler.py): on a GPU at the default model's vocabulary, on the CPU under
TRITON_INTERPRET=1 at a small one."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")

from fasterllama import SamplingParams  # noqa: E402
from fasterllama.backends.cuda import triton_sampling  # noqa: E402
from fasterllama.engine import sampler  # noqa: E402
from fasterllama.engine.sequence import Sequence  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
V, ROWS = (2500, 24) if DEVICE == "cpu" else (49152, 96)  # V: not a multiple of the kernel's block


def test_triton_sample_rows_draws_the_reference_samplers_tokens() -> None:
    """Rows of every kind: greedy, temperatures, top-k (1, some, past the vocabulary), top-p with a
    peaked and a flat distribution, min-p, mixes, masked (-inf) logits. Equal tokens except where
    the reference's two best scores tie to 1e-5."""
    g = torch.Generator().manual_seed(4)
    rows, logits = [], []
    for i in range(ROWS):
        params = SamplingParams(temperature=[0.0, 0.3, 0.8, 1.5][i % 4], top_k=[0, 1, 7, 50, V + 10][i % 5], top_p=[1.0, 0.9, 0.5, 0.99][i // 3 % 4],
                                min_p=[0.0, 0.05, 0.3][i // 5 % 3], seed=int(torch.randint(0, 2**62, (1,), generator=g)))
        seq = Sequence([1, 2, 3], params, None, params.seed)
        seq.output_token_ids = list(range(i % 5))
        rows.append((seq, []))
        row = torch.randn(V, generator=g) * (0.01 if i % 6 == 5 else 4.0)  # every sixth flat: the nucleus is most of the vocabulary
        if i % 7 == 3:
            row[: V // 3] = float("-inf")  # banned tokens (penalties, min_tokens)
        logits.append(row)
    logits = torch.stack(logits).to(DEVICE)
    b = sampler.sampling_batch(rows, V, [2], logits.device)
    want = sampler.sample_with_probs(logits, b)[0]
    got = triton_sampling.sample_rows(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps)
    scores = (sampler.probabilities(logits, b) / -torch.log(sampler.hashed_uniform(b.seeds, b.steps, V)).float()).topk(2, dim=-1).values
    near_tie = (scores[:, 0] - scores[:, 1]) <= 1e-5 * scores[:, 0]
    assert ((got == want) | near_tie).all(), (got, want)
    assert (got == want).float().mean() > 0.95
    assert len(set(want.tolist())) > ROWS // 2  # rows draw different tokens
