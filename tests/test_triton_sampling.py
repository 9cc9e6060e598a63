"""The one-launch sampler (backends/cuda/triton_sampling.py) against the PyTorch sampler
(engine/sampler.py): on a GPU at the default model's vocabulary, on the CPU under
TRITON_INTERPRET=1 at a small one."""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")

from fasterllama import SamplingParams  # noqa: E402
from fasterllama.backends.cuda import triton_sampling  # noqa: E402
from fasterllama.engine import sampler  # noqa: E402
from fasterllama.engine.sequence import Sequence  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
V, ROWS = (2500, 24) if DEVICE == "cpu" else (49152, 96)  # V: not a multiple of the kernel's block


@pytest.fixture(autouse=True)
def _blocks_per_row(monkeypatch) -> None:
    """Under the interpreter, blocks and chunks of 1,024 tokens: the small vocabulary still takes
    three (the passes' load of the next block before working on this one, the last one partial)."""
    if DEVICE == "cpu":
        monkeypatch.setattr(triton_sampling, "BLOCK", 1024)
        monkeypatch.setattr(triton_sampling, "CHUNK", 1024)


def _rows(n: int, seed: int) -> tuple[torch.Tensor, sampler.SamplingBatch]:
    """Rows of every kind: greedy, temperatures, top-k (1, some, more than the kernel's copy holds,
    past the vocabulary), top-p with a peaked and a flat distribution, min-p, mixes, masked (-inf)
    logits, logits in few distinct values (ties at the top-k boundary)."""
    g = torch.Generator().manual_seed(seed)
    rows, logits = [], []
    for i in range(n):
        params = SamplingParams(temperature=[0.0, 0.3, 0.8, 1.5][i % 4], top_k=[0, 1, 7, 50, 300, V + 10][i % 6], top_p=[1.0, 0.9, 0.5, 0.99][i // 3 % 4],
                                min_p=[0.0, 0.05, 0.3][i // 5 % 3], seed=int(torch.randint(0, 2**62, (1,), generator=g)))
        seq = Sequence([1, 2, 3], params, None, params.seed)
        seq.output_token_ids = list(range(i % 5))
        rows.append((seq, []))
        row = torch.randn(V, generator=g) * (0.01 if i % 6 == 5 else 4.0)  # every sixth flat: the nucleus is most of the vocabulary
        if i % 7 == 3:
            row[: V // 3] = float("-inf")  # banned tokens (penalties, min_tokens)
        if i % 11 == 4:
            row = row.round()  # hundreds of tokens tie at the top-k boundary: more than the copy holds
        logits.append(row)
    logits = torch.stack(logits).to(DEVICE)
    return logits, sampler.sampling_batch(rows, V, [2], logits.device)


def _tie_inclusive_draw(logits: torch.Tensor, b: sampler.SamplingBatch) -> torch.Tensor:
    """The reference's draw with every token tied (in scaled logit) to the least one it kept kept
    too: the kernel's top-p keeps a token while the mass strictly above it is < top_p, so tokens of
    equal logit share one fate, where the reference's sort keeps some of a tie at the nucleus'
    boundary (those first in sort order) and drops the rest."""
    kept = sampler.probabilities(logits, b) > 0
    scaled = sampler.penalized(logits, b) / torch.where(b.temperature > 0, b.temperature, 1.0)[:, None]
    floor = torch.where(kept, scaled, float("inf")).amin(dim=-1, keepdim=True)
    e = torch.where(scaled >= floor, (scaled - scaled.amax(dim=-1, keepdim=True)).exp(), 0.0)
    return (e / -torch.log(sampler.hashed_uniform(b.seeds, b.steps, logits.shape[-1])).float()).argmax(dim=-1)


@pytest.mark.parametrize("seed", [4, 5])
def test_triton_sample_rows_draws_the_reference_samplers_tokens(seed: int) -> None:
    """Equal tokens except where the reference's two best scores tie to 1e-5, or where the
    nucleus' boundary falls inside a run of equal logits (rows in few distinct values: at the
    GPU's vocabulary the reference keeps 26 of 48 tokens tied there, the kernel all 48)."""
    logits, b = _rows(ROWS, seed)
    want = sampler.reference_sample(logits, b)
    got = triton_sampling.sample_rows(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps)
    scores = (sampler.probabilities(logits, b) / -torch.log(sampler.hashed_uniform(b.seeds, b.steps, V)).float()).topk(2, dim=-1).values
    near_tie = (scores[:, 0] - scores[:, 1]) <= 1e-5 * scores[:, 0]
    assert ((got == want) | (got == _tie_inclusive_draw(logits, b)) | near_tie).all(), (got, want)
    assert (got == want).float().mean() > 0.95
    assert len(set(want.tolist())) > ROWS // 2  # rows draw different tokens


def test_triton_sample_rows_on_random_shapes_and_filters(monkeypatch) -> None:
    """Vocabularies around the chunk and block sizes (one chunk, a last chunk of one token), k
    around LOCAL_CAP and the vocabulary, flat and peaked rows, mostly banned rows, rows of signed
    zeros (-0.0 == +0.0: one key): the reference's tokens, or its tie-inclusive draw."""
    monkeypatch.setattr(triton_sampling, "CHUNK", 512)
    rng = random.Random(0)
    for case in range(12):
        vocab = rng.choice([100, 511, 513, 1500, 2049])
        g = torch.Generator().manual_seed(case)
        rows, logits = [], []
        for _ in range(rng.randint(1, 3)):
            top_k = rng.choice([0, 1, 63, 64, 65, 100, vocab - 1, vocab + 5])
            params = SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0, 2.0]), top_k=top_k, top_p=rng.choice([1.0, 0.95, 0.5, 0.1]),
                                    min_p=rng.choice([0.0, 0.1]), seed=rng.randint(0, 2**40))
            rows.append((Sequence([1, 2, 3], params, None, params.seed), []))
            row = torch.randn(vocab, generator=g) * rng.choice([0.1, 1.0, 5.0, 20.0])
            if rng.random() < 0.3:
                row[torch.randperm(vocab, generator=g)[: vocab * 9 // 10]] = float("-inf")
            if rng.random() < 0.3:
                row = row.round()  # (at scale 0.1: zeros of both signs)
            logits.append(row)
        logits = torch.stack(logits).to(DEVICE)
        b = sampler.sampling_batch(rows, vocab, [2], logits.device)
        want = sampler.reference_sample(logits, b)
        got = triton_sampling.sample_rows(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps)
        assert ((got == want) | (got == _tie_inclusive_draw(logits, b))).all(), (case, vocab, got, want)


def test_triton_sample_rows_takes_signed_zeros_as_equal() -> None:
    """-0.0 and +0.0 are equal logits: a top-k whose k-th largest is a zero keeps both signs, as the
    reference does (their bit patterns differ: as raw keys, -0.0 sorted below +0.0)."""
    logits = torch.zeros(2, V)
    logits[:, 1::2] = -0.0
    logits[1, : V // 2] = float("-inf")
    params = [SamplingParams(temperature=1.0, top_k=k, seed=3) for k in (2, 70)]
    b = sampler.sampling_batch([(Sequence([1, 2, 3], prm, None, prm.seed), []) for prm in params], V, [2], DEVICE)
    logits = logits.to(DEVICE)
    want = sampler.reference_sample(logits, b)
    got = triton_sampling.sample_rows(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps)
    assert torch.equal(got, want), (got, want)


def test_triton_sample_rows_candidate_copy_draws_what_the_row_draws(monkeypatch) -> None:
    """The passes after top-k read a copy of the tokens it keeps; with no room for a copy (CAP 1)
    they read the whole row: the same tokens either way (sums in another order: near ties aside)."""
    logits, b = _rows(ROWS // 2, 5)
    args = (logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps)
    copied = triton_sampling.sample_rows(*args)
    monkeypatch.setattr(triton_sampling, "CAP", 1)
    whole = triton_sampling.sample_rows(*args)
    assert (copied == whole).float().mean() > 0.95, (copied, whole)


def test_triton_sample_rows_reads_only_the_chunks_candidates_where_they_suffice(monkeypatch) -> None:
    """Rows whose top-k fits the chunks' copies (k <= LOCAL_CAP, no chunk's copy cut short by
    ties), and top-p rows whose candidates hold the nucleus, draw from the candidates alone: given a
    row of NaN after the chunk kernel has read the real one, they still draw the reference's token.
    (The rest fall back to the row: top-k past LOCAL_CAP, flat rows' nuclei, ties.)"""
    g = torch.Generator().manual_seed(7)
    rows = 8
    logits = (torch.randn(rows, V, generator=g) * 4).to(DEVICE)
    top_k = [40, 1, 64, 0] * 2
    # (peaked enough at either vocabulary that the tokens above the largest chunk threshold hold
    # top_p of the mass with room: at 49,152 tokens and temperature 1 they held 94.6-97%)
    params = [SamplingParams(temperature=[0.5, 0.7][i % 2], top_k=top_k[i], top_p=0.9 if top_k[i] == 0 else [1.0, 0.95][i // 4], min_p=0.02,
                             seed=i) for i in range(rows)]
    seqs = [(Sequence([1, 2, 3], prm, None, prm.seed), []) for prm in params]
    b = sampler.sampling_batch(seqs, V, [2], logits.device)
    want = sampler.reference_sample(logits, b)
    chunk_kernel = triton_sampling._chunk_kernel

    class RealRowForTheChunks:  # the chunk kernel launched over the real logits, whatever sample_rows was given
        def __getitem__(self, grid):
            return lambda x, *args, **kw: chunk_kernel[grid](logits, *args, **kw)

    monkeypatch.setattr(triton_sampling, "_chunk_kernel", RealRowForTheChunks())
    got = triton_sampling.sample_rows(torch.full_like(logits, float("nan")), b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps)
    assert torch.equal(got, want), (got, want)


@triton.jit
def _kth_key_kernel(x_ptr, k_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    k = tl.load(k_ptr + row)
    key = triton_sampling._kth_largest_key(x_ptr + row * V, V, 1.0, k, tl.arange(0, BLOCK), BLOCK)
    tl.store(out_ptr + row, key)


def test_triton_kth_largest_key_is_the_sorted_rows_kth() -> None:
    """The radix select's key is the k-th largest of the row, ties, negatives and -inf included."""
    g = torch.Generator().manual_seed(6)
    n = 300
    x = torch.randn(6, n, generator=g) * 3
    x[1] = x[1].round()  # ties
    x[2, : n // 2] = float("-inf")
    x[3] = -x[3].abs()  # all negative
    x[4] = 0.0  # one value
    x[5, :10] = torch.tensor([-0.0, 0.0] * 5)  # signed zeros
    k = torch.tensor([1, 37, 200, n, 5, 150])
    out = torch.empty(6, dtype=torch.int64)
    x, k, out = x.to(DEVICE), k.to(DEVICE), out.to(DEVICE)
    _kth_key_kernel[(6,)](x, k, out, n, BLOCK=128)
    bits = (x + 0.0).view(torch.int32).long()  # (-0.0 + 0.0 = +0.0: signed zeros are one key, as they are equal floats)
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    want = keys.sort(dim=1, descending=True).values.gather(1, (k - 1)[:, None]).squeeze(1)
    assert torch.equal(out, want), (out, want)

