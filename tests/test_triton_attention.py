"""The Triton attention kernels against the reference ops (a slot cache: one block a sequence) and a
dense oracle (a paged cache of shuffled blocks).

Runs on a CUDA GPU at real shapes, or on the CPU under the Triton interpreter at small ones:
    TRITON_INTERPRET=1 python -m pytest tests/test_triton_attention.py
Caches hold NaN wherever nothing was written, so a read past a sequence's keys shows up as NaN."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),  # the interpreter's
]
pytest.importorskip("triton")

from fasterllama.backends.cuda import triton_attention as ta
from fasterllama.ops import reference
from fasterllama.ops.metadata import AttentionMetadata

DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}  # atol and rtol
# RoPE outputs round like the reference's on a GPU; the interpreter truncates each cast to bf16
ROPE_TOL = {**TOL, torch.bfloat16: 6e-2} if INTERPRET else TOL
# PADDED_DIM: a head_dim that is not a power of two, which the kernels pad and mask
if INTERPRET:  # MHA, GQA group 3, GQA group 4, MQA; every dtype with each
    HEADS, HEAD_DIMS, PADDED_DIM = [(4, 4), (6, 2), (8, 2), (4, 1)], [16, 32], 24
    CASES = [(h, kvh, HEAD_DIMS[(i + j) % 2], dt) for i, (h, kvh) in enumerate(HEADS) for j, dt in enumerate(DTYPES)]
    # head dims padded to 16 (8: half of a RoPE half pads too), 32 and 128; group 3 with one of them
    CASES += [(4, 4, 8, torch.float32), (6, 2, 24, torch.bfloat16), (8, 2, 80, torch.float16), (4, 1, 8, torch.bfloat16)]
else:  # plus group 8; bf16 (the GPU default) everywhere, fp32 or fp16 besides (each config compiles once)
    HEADS, HEAD_DIMS, PADDED_DIM = [(32, 32), (9, 3), (32, 8), (64, 8), (8, 1)], [64, 128], 80
    CASES = [(h, kvh, d, dt) for i, (h, kvh) in enumerate(HEADS) for j, d in enumerate(HEAD_DIMS)
             for dt in (torch.bfloat16, DTYPES[2 * ((i + j) % 2)])]
    # padded head dims (80, 96: 128 lanes), group 3 among them
    CASES += [(32, 8, 80, torch.bfloat16), (9, 3, 96, torch.bfloat16), (32, 32, 80, torch.float16),
              (8, 1, 96, torch.float32), (64, 8, 96, torch.float16)]
CASE_IDS = [f"h{h}-kv{kvh}-d{d}-{str(dt).split('.')[1]}" for h, kvh, d, dt in CASES]


def _rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Fresh normal values, drawn on the test device (each test seeds torch first)."""
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, tol: dict[torch.dtype, float] = TOL) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=tol[dtype], rtol=tol[dtype], equal_nan=True)


def _meta(new_lens: list[int], starts: list[int], slots: list[int], capacity: int) -> AttentionMetadata:
    """A step over a slot cache: each sequence owns one block of `capacity` rows (block `slot`)."""
    offsets = [0]
    for n in new_lens:
        offsets.append(offsets[-1] + n)
    slot_mapping = torch.tensor([s * capacity + p for s, st, n in zip(slots, starts, new_lens) for p in range(st, st + n)], dtype=torch.int64)
    positions = torch.tensor([p for st, n in zip(starts, new_lens) for p in range(st, st + n)], dtype=torch.int64)
    tables = torch.tensor([[s] for s in slots], dtype=torch.int32)
    return AttentionMetadata(slot_mapping.to(DEVICE), positions.to(DEVICE), tables.to(DEVICE), starts, offsets)


def _slot_cache(num_slots: int, kvh: int, max_len: int, d: int, dtype: torch.dtype, filled: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot caches [num_slots, kvh, max_len, d]: random in the first filled[slot] positions, NaN elsewhere."""
    caches = []
    for _ in range(2):
        c = torch.full((num_slots, kvh, max_len, d), float("nan"), dtype=dtype, device=DEVICE)
        for slot, length in filled.items():
            c[slot, :, :length] = _rand(kvh, length, d, dtype=dtype)
        caches.append(c)
    return caches[0], caches[1]


def _paged_cache(lengths: list[int], kvh: int, d: int, block_size: int, dtype: torch.dtype):
    """A paged cache [num_blocks, kvh, block_size, d] whose sequences own shuffled blocks, NaN where
    nothing was written, the block tables (unused entries -1) and each sequence's dense K and V."""
    per_seq = [-(-n // block_size) for n in lengths]
    max_blocks = max(max(per_seq), 1)
    num_blocks = sum(per_seq) + 3  # spare blocks nobody owns stay NaN
    order = torch.randperm(num_blocks).tolist()
    tables = torch.full((len(lengths), max_blocks), -1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, kvh, block_size, d), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    dense = []
    for s, n in enumerate(lengths):
        k, v = _rand(kvh, n, d, dtype=dtype), _rand(kvh, n, d, dtype=dtype)
        for i in range(per_seq[s]):
            blk = order.pop()
            tables[s, i] = blk
            lo, hi = i * block_size, min((i + 1) * block_size, n)
            k_cache[blk, :, : hi - lo], v_cache[blk, :, : hi - lo] = k[:, lo:hi], v[:, lo:hi]
        dense.append((k, v))
    return k_cache, v_cache, tables.to(DEVICE), dense, max_blocks * block_size


def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal attention in fp32: q [n, H, D] at positions q_pos [n] over k, v [KVH, L, D]."""
    group = q.shape[1] // k.shape[0]
    k, v = k.float().repeat_interleave(group, 0), v.float().repeat_interleave(group, 0)
    scores = torch.einsum("nhd,hld->hnl", q.float(), k) * scale
    visible = torch.arange(k.shape[1], device=q.device)[None, :] <= q_pos[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)  # no keys: zeros
    return torch.einsum("hnl,hld->nhd", probs, v)


def _qkv(T: int, h: int, kvh: int, d: int, dtype: torch.dtype):
    """A strided qkv projection (a column slice of a wider tensor) and random-angle cos/sin."""
    qkv = _rand(T, (h + 2 * kvh) * d + 8, dtype=dtype)[:, 8:]
    angles = torch.rand(T, d, device=DEVICE) * 6.3
    return qkv, angles.cos(), angles.sin()


# -- RoPE + KV store ----------------------------------------------------------------------------------


@pytest.mark.parametrize("half", [32, 48])  # (48: a half padded to a power of two)
def test_rope_tables_match_reference(half: int) -> None:
    """A step's cos/sin tables in one launch: torch's fp32 angles, cos and sin to within an ulp or so
    (positions up to 40,000: large angles, where an imprecise cosf would show)."""
    positions = torch.tensor([0, 1, 7, 511, 4097, 39999, 12, 3], device=DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 2 * half, 2, device=DEVICE).float() / (2 * half)))
    (cos, sin), (cos_ref, sin_ref) = ta.rope_tables(positions, inv_freq), reference.rope_tables(positions, inv_freq)
    assert cos.shape == sin.shape == (8, 2 * half) and cos.dtype == torch.float32
    torch.testing.assert_close(cos, cos_ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(sin, sin_ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("h,kvh,d,dtype", CASES, ids=CASE_IDS)
def test_rope_and_store_kv_matches_reference(h: int, kvh: int, d: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    new_lens, starts, slots = [5, 1, 7, 1, 2], [0, 9, 3, 20, 30], [2, 0, 5, 3, 4]
    meta = _meta(new_lens, starts, slots, 32)
    qkv, cos, sin = _qkv(sum(new_lens), h, kvh, d, dtype)
    k_ref, v_ref = _slot_cache(6, kvh, 32, d, dtype, {})
    k_got, v_got = k_ref.clone(), v_ref.clone()
    q_ref = reference.rope_and_store_kv(qkv, cos, sin, k_ref, v_ref, meta, h, kvh, d)
    q_got = ta.rope_and_store_kv(qkv, cos, sin, k_got, v_got, meta, h, kvh, d)
    _close(q_got, q_ref, dtype, ROPE_TOL)
    _close(k_got, k_ref, dtype, ROPE_TOL)
    assert torch.equal(v_got.isnan(), v_ref.isnan()) and torch.equal(v_got.nan_to_num(), v_ref.nan_to_num())


@pytest.mark.parametrize("d", [HEAD_DIMS[0], PADDED_DIM])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 12])
def test_rope_and_store_paged_skips_padding_rows(block_size: int, dtype: torch.dtype, d: int) -> None:
    torch.manual_seed(1)
    h, kvh = HEADS[1][0], HEADS[1][1]
    num_blocks, T = 6, 20
    slot_mapping = torch.randperm(num_blocks * block_size)[:T]
    slot_mapping[[3, 11, 19]] = -1  # CUDA-graph padding rows
    qkv, cos, sin = _qkv(T, h, kvh, d, dtype)
    k_cache = torch.full((num_blocks, kvh, block_size, d), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    q = ta.rope_and_store(qkv, cos, sin, k_cache, v_cache, slot_mapping.to(DEVICE), h, kvh, d)

    q_ref, k_ref, v_ref = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    _close(q, reference.apply_rope(q_ref.reshape(T, h, d), cos, sin), dtype, ROPE_TOL)
    k_ref = reference.apply_rope(k_ref.reshape(T, kvh, d), cos, sin)
    k_want, v_want = k_cache.clone().fill_(float("nan")), v_cache.clone().fill_(float("nan"))
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_want[slot // block_size, :, slot % block_size] = k_ref[t]
            v_want[slot // block_size, :, slot % block_size] = v_ref[t].reshape(kvh, d)
    _close(k_cache, k_want, dtype, ROPE_TOL)
    assert torch.equal(v_cache.isnan(), v_want.isnan()) and torch.equal(v_cache.nan_to_num(), v_want.nan_to_num())


# -- decode -------------------------------------------------------------------------------------------

if INTERPRET:  # (batch, cache capacity): capacity 24 runs one split, 64 several
    DECODE_SHAPES = [(1, 24), (4, 24), (1, 64), (4, 64)]
else:
    DECODE_SHAPES = [(1, 4096), (64, 4096), (7, 512)]


@pytest.mark.parametrize("batch,max_len", DECODE_SHAPES)
@pytest.mark.parametrize("h,kvh,d,dtype", CASES, ids=CASE_IDS)
def test_decode_matches_reference(h: int, kvh: int, d: int, dtype: torch.dtype, batch: int, max_len: int) -> None:
    """An all-decode step through the op wrapper: variable lengths, slots out of order."""
    torch.manual_seed(batch * 1000 + max_len)
    num_slots = batch + 3
    slots = torch.randperm(num_slots)[:batch].tolist()
    starts = torch.randint(0, max_len, (batch,)).tolist()
    starts[0] = max_len - 1  # one sequence fills the cache
    meta = _meta([1] * batch, starts, slots, max_len)
    k_cache, v_cache = _slot_cache(num_slots, kvh, max_len, d, dtype, {s: st + 1 for s, st in zip(slots, starts)})
    q = _rand(batch, h, d, dtype=dtype)
    want = reference.attention(q, k_cache, v_cache, meta, d**-0.5)
    got = ta.attention(q, k_cache, v_cache, meta, d**-0.5)
    _close(got, want, dtype)


if INTERPRET:  # sequence lengths: a capacity of 70+ runs several splits, of 24 one
    DECODE_LENGTHS = [[37, 0, 1, 70, 16], [0, 5, 17]]
else:
    DECODE_LENGTHS = [[3000, 0, 1, 4096, 513, 64], [0, 5, 200]]


@pytest.mark.parametrize("d", [HEAD_DIMS[-1], PADDED_DIM])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", DECODE_LENGTHS, ids=["long", "short"])
@pytest.mark.parametrize("block_size", [8, 12, 16])
def test_decode_paged(block_size: int, lengths: list[int], dtype: torch.dtype, d: int) -> None:
    """The launcher on a paged cache, with an empty sequence (zeros out) among others."""
    torch.manual_seed(2)
    h, kvh = HEADS[2][0], HEADS[2][1]
    k_cache, v_cache, tables, dense, capacity = _paged_cache(lengths, kvh, d, block_size, dtype)
    q = _rand(len(lengths), h, d, dtype=dtype)
    seq_lens = torch.tensor(lengths, device=DEVICE)
    got = ta.decode_attention(q, k_cache, v_cache, tables, seq_lens, d**-0.5, capacity)
    assert not got.isnan().any()
    for b, (k, v) in enumerate(dense):
        pos = torch.tensor([lengths[b] - 1], device=DEVICE)
        _close(got[b : b + 1], _oracle(q[b : b + 1], k, v, pos, d**-0.5), dtype)


@pytest.mark.parametrize("block_size", [8, 12])
@pytest.mark.parametrize("h,kvh,d,dtype", CASES, ids=CASE_IDS)
def test_decode_rotates_and_stores_the_new_token_itself(h: int, kvh: int, d: int, dtype: torch.dtype, block_size: int) -> None:
    """decode_attention's rope: the qkv projection's rows in, q and k rotated and the new key and
    value stored by the split holding the new token: the same cache and the same output, bit for
    bit, as rope_and_store then the decode kernel (an empty padding row, slot -1, stores nothing)."""
    torch.manual_seed(h * 100 + d)
    lengths = DECODE_LENGTHS[0]
    k_ref, v_ref, tables, _, capacity = _paged_cache(lengths, kvh, d, block_size, dtype)
    slots = torch.tensor([int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1 for b, n in enumerate(lengths)],
                         device=DEVICE)
    for b, n in enumerate(lengths):  # the new token's slot: NaN until it is stored
        if n:
            blk, off = int(tables[b, (n - 1) // block_size]), (n - 1) % block_size
            k_ref[blk, :, off], v_ref[blk, :, off] = float("nan"), float("nan")
    k_got, v_got = k_ref.clone(), v_ref.clone()
    qkv, cos, sin = _qkv(len(lengths), h, kvh, d, dtype)
    seq_lens = torch.tensor(lengths, device=DEVICE)
    q = ta.rope_and_store(qkv, cos, sin, k_ref, v_ref, slots, h, kvh, d)
    want = ta.decode_attention(q, k_ref, v_ref, tables, seq_lens, d**-0.5, capacity)
    got = ta.decode_attention(qkv, k_got, v_got, tables, seq_lens, d**-0.5, capacity, rope=(cos, sin, slots, h))
    assert torch.equal(k_got.nan_to_num(7.0), k_ref.nan_to_num(7.0)) and torch.equal(v_got.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert not got.isnan().any() and torch.equal(got, want)


@pytest.mark.parametrize("order", ["drafts in order", "drafts reversed"])
@pytest.mark.parametrize("block_n,num_splits", [(16, 1), (16, 4)])
def test_decode_rope_in_a_verify_step(order: str, block_n: int, num_splits: int) -> None:
    """A speculative verify step: a row per drafted token of one sequence (positions 30, 31, 32,
    each attending up to itself) beside another sequence. Whatever order the rows' programs run in
    (the interpreter runs them in row order; "reversed" puts the later drafts first), each reads
    the earlier drafts' keys and values only after storing them itself: the two kernels' cache
    and output, bit for bit, with a split boundary between the drafts (4 splits of 16 keys)."""
    torch.manual_seed(5)
    h, kvh, d, bs, dtype = HEADS[1][0], HEADS[1][1], HEAD_DIMS[0], 8, torch.bfloat16
    k_ref, v_ref, tables, _, capacity = _paged_cache([33, 20], kvh, d, bs, dtype)
    rows = [(0, 30), (0, 31), (0, 32), (1, 19)]  # (sequence, position)
    rows = rows[2::-1] + rows[3:] if order == "drafts reversed" else rows
    slots = [int(tables[s, p // bs]) * bs + p % bs for s, p in rows]
    for slot in slots:  # what the step stores: NaN until then
        k_ref[slot // bs, :, slot % bs], v_ref[slot // bs, :, slot % bs] = float("nan"), float("nan")
    k_got, v_got = k_ref.clone(), v_ref.clone()
    row_tables = tables[[s for s, _ in rows]]
    seq_lens, slot_mapping = torch.tensor([p + 1 for _, p in rows], device=DEVICE), torch.tensor(slots, device=DEVICE)
    qkv, cos, sin = _qkv(len(rows), h, kvh, d, dtype)
    q = ta.rope_and_store(qkv, cos, sin, k_ref, v_ref, slot_mapping, h, kvh, d)
    want = ta.decode_attention(q, k_ref, v_ref, row_tables, seq_lens, d**-0.5, capacity, block_n, num_splits)
    got = ta.decode_attention(qkv, k_got, v_got, row_tables, seq_lens, d**-0.5, capacity, block_n, num_splits, rope=(cos, sin, slot_mapping, h))
    assert torch.equal(k_got.nan_to_num(7.0), k_ref.nan_to_num(7.0)) and torch.equal(v_got.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert not got.isnan().any() and torch.equal(got, want)


@pytest.mark.parametrize("decode", [True, False])
def test_rope_store_attention_op_matches_reference(decode: bool) -> None:
    """The op the model calls: a decode-only step in the fused launch, any other step through
    rope_and_store_kv and attention; the reference's output and cache either way."""
    torch.manual_seed(4)
    h, kvh, d = HEADS[1][0], HEADS[1][1], HEAD_DIMS[0]
    new_lens, starts, slots = ([1, 1, 1], [9, 0, 30], [2, 0, 1]) if decode else ([5, 1, 7], [0, 9, 3], [2, 0, 1])
    meta = _meta(new_lens, starts, slots, 32)
    assert meta.all_decode == decode
    qkv, cos, sin = _qkv(sum(new_lens), h, kvh, d, torch.float32)
    k_ref, v_ref = _slot_cache(3, kvh, 32, d, torch.float32, dict(zip(slots, starts)))
    k_got, v_got = k_ref.clone(), v_ref.clone()
    q = reference.rope_and_store_kv(qkv, cos, sin, k_ref, v_ref, meta, h, kvh, d)
    want = reference.attention(q, k_ref, v_ref, meta, d**-0.5)
    got = ta.rope_store_attention(qkv, cos, sin, k_got, v_got, meta, h, kvh, d, d**-0.5)
    _close(got, want, torch.float32)
    _close(k_got, k_ref, torch.float32)
    _close(v_got, v_ref, torch.float32)


@pytest.mark.parametrize("block_n,num_splits", [(16, 1), (16, 5), (32, 2)])
def test_decode_given_tiles_and_splits(block_n: int, num_splits: int) -> None:
    """The tile and split choices benchmarks/gpu_attention_sweep.py times, given explicitly: the
    same attention whatever they are (a short sequence leaves splits empty)."""
    torch.manual_seed(3)
    lengths = [37, 0, 70] if INTERPRET else [3000, 0, 513]
    h, kvh = HEADS[2][0], HEADS[2][1]
    d = HEAD_DIMS[-1]
    k_cache, v_cache, tables, dense, capacity = _paged_cache(lengths, kvh, d, 16, torch.float32)
    q = _rand(len(lengths), h, d, dtype=torch.float32)
    got = ta.decode_attention(q, k_cache, v_cache, tables, torch.tensor(lengths, device=DEVICE), d**-0.5, capacity, block_n, num_splits)
    for b, (k, v) in enumerate(dense):
        _close(got[b : b + 1], _oracle(q[b : b + 1], k, v, torch.tensor([lengths[b] - 1], device=DEVICE), d**-0.5), torch.float32)


# -- prefill ------------------------------------------------------------------------------------------

if INTERPRET:  # (new tokens, cached before them) per sequence; capacity 80
    PREFILL_STEP, PREFILL_CAPACITY = [(40, 0), (1, 10), (21, 25), (1, 0), (3, 60), (16, 16)], 80
else:
    PREFILL_STEP, PREFILL_CAPACITY = [(2048, 0), (1, 100), (300, 1000), (1, 0), (17, 4000), (129, 64)], 4096


@pytest.mark.parametrize("h,kvh,d,dtype", CASES, ids=CASE_IDS)
def test_prefill_matches_reference(h: int, kvh: int, d: int, dtype: torch.dtype) -> None:
    """A mixed step through the op wrapper: prompts from scratch, prompts after a cached prefix
    and single-token sequences, packed, in slots out of order."""
    torch.manual_seed(3)
    new_lens, starts = [n for n, _ in PREFILL_STEP], [s for _, s in PREFILL_STEP]
    slots = [4, 0, 6, 2, 1, 3]
    meta = _meta(new_lens, starts, slots, PREFILL_CAPACITY)
    k_cache, v_cache = _slot_cache(7, kvh, PREFILL_CAPACITY, d, dtype, {s: st + n for s, n, st in zip(slots, new_lens, starts)})
    q = _rand(sum(new_lens), h, d, dtype=dtype)
    want = reference.attention(q, k_cache, v_cache, meta, d**-0.5)
    got = ta.attention(q, k_cache, v_cache, meta, d**-0.5)
    _close(got, want, dtype)


@pytest.mark.parametrize("d", [HEAD_DIMS[-1], PADDED_DIM])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 12, 16])
def test_prefill_paged(block_size: int, dtype: torch.dtype, d: int) -> None:
    """The launcher on a paged cache, an empty sequence included, q a strided view."""
    torch.manual_seed(4)
    h, kvh = HEADS[1][0], HEADS[1][1]
    step = PREFILL_STEP[:3] + [(0, 5)] + PREFILL_STEP[3:]
    new_lens, starts = [n for n, _ in step], [s for _, s in step]
    k_cache, v_cache, tables, dense, _ = _paged_cache([n + s for n, s in step], kvh, d, block_size, dtype)
    T = sum(new_lens)
    q = _rand(T, h + 1, d, dtype=dtype)[:, 1:]
    cu = torch.tensor([0] + new_lens, device=DEVICE).cumsum(0).to(torch.int32)
    got = ta.prefill_attention(q, k_cache, v_cache, tables, cu, torch.tensor(starts, device=DEVICE, dtype=torch.int32),
                               d**-0.5, max(new_lens))
    assert not got.isnan().any()
    for s, (k, v) in enumerate(dense):
        lo, hi = cu[s].item(), cu[s + 1].item()
        pos = torch.arange(starts[s], starts[s] + hi - lo, device=DEVICE)
        _close(got[lo:hi], _oracle(q[lo:hi], k, v, pos, d**-0.5), dtype)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_decode_step_replays_in_cuda_graph() -> None:
    """RoPE + store and decode attention captured once, replayed on new lengths, tables and inputs:
    the launches depend on shapes only and never sync with the host."""
    torch.manual_seed(5)
    h, kvh, d, dtype, batch, max_len = 32, 8, 128, torch.bfloat16, 16, 2048
    k_cache = torch.zeros(batch + 4, kvh, max_len, d, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    qkv, cos, sin = _qkv(batch, h, kvh, d, dtype)
    tables = torch.zeros(batch, 1, dtype=torch.int64, device=DEVICE)
    seq_lens = torch.ones(batch, dtype=torch.int64, device=DEVICE)

    def step() -> torch.Tensor:
        slot_mapping = tables[:, 0] * max_len + seq_lens - 1
        q = ta.rope_and_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, h, kvh, d)
        return ta.decode_attention(q, k_cache, v_cache, tables, seq_lens, d**-0.5, max_len)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):
        tables.copy_(torch.randperm(batch + 4, device=DEVICE)[:batch, None])
        seq_lens.copy_(torch.randint(1, max_len + 1, (batch,), device=DEVICE))
        for t in (k_cache, v_cache, qkv):
            t.normal_()
        graph.replay()
        k_after, v_after = k_cache.clone(), v_cache.clone()
        want = step()  # eager, on the same inputs (stores the same k/v again)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        assert torch.equal(k_after, k_cache) and torch.equal(v_after, v_cache)


def test_supports_even_head_dims() -> None:
    assert all(ta.supports(d) for d in (8, 24, 40, 64, 80, 96, 128, 160, 256))
    assert not any(ta.supports(d) for d in (0, 6, 7, 9, 33, 258, 512))
