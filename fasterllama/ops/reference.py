"""PyTorch reference ops: readable, run on every device, and the oracle for faster backends."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, then scaled in the input dtype (as HF LLaMA does)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add before a norm, then the norm: (rms_norm(x + residual), x + residual)."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] (fp32) of each position's RoPE angles, rotate-half layout: the
    angles of inv_freq [head_dim / 2] repeated for the second half."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for a fused [.., 2*intermediate] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A weight stored narrower than x (a checkpoint's 16-bit matrix in an fp32 model) widens to
    x's type: the products of the widened copy."""
    return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype), bias)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value (the first one on ties): greedy decoding's next tokens."""
    return x.argmax(dim=-1)


def argmax_tokens(x: torch.Tensor) -> list[int]:
    """argmax of each row of x [B, V] as Python ints: the sampler's all-greedy step."""
    return x.argmax(dim=-1).tolist()


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Write this step's K/V ([T, kv_heads, head_dim]) into the paged caches [blocks, kv_heads, block_size, head_dim]."""
    bs = k_cache.shape[2]
    keep = meta.slot_mapping >= 0  # padding rows (-1) are stored nowhere
    slots = meta.slot_mapping if bool(keep.all()) else meta.slot_mapping[keep]
    k, v = (k, v) if slots is meta.slot_mapping else (k[keep], v[keep])
    k_cache[slots // bs, :, slots % bs] = k
    v_cache[slots // bs, :, slots % bs] = v


def gather_kv(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached rows of sequences with block tables `blocks` ([B, nb] or [nb]) as
    contiguous [B, kv_heads, length, head_dim] (or [kv_heads, length, head_dim])."""
    bs = cache.shape[2]
    nb = -(-length // bs)
    g = cache[blocks[..., :nb].long()]  # [..., nb, kv_heads, bs, d]
    g = g.movedim(-3, -4)  # [..., kv_heads, nb, bs, d]
    return g.reshape(*g.shape[:-3], nb * bs, g.shape[-1])[..., :length, :]


def rope_and_store_kv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int,
) -> torch.Tensor:
    """Split a fused qkv projection [T, (H + 2 KVH) * D], rotate q and k, cache k and v; returns q [T, H, D]."""
    T = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = apply_rope(q.reshape(T, num_heads, head_dim), cos, sin)
    k = apply_rope(k.reshape(T, num_kv_heads, head_dim), cos, sin)
    store_kv(k_cache, v_cache, k, v.reshape(T, num_kv_heads, head_dim), meta)
    return q


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One new query per sequence ([B, heads, head_dim]) against its cache, all sequences at once.

    Grouped-query heads share their K/V without copies: q is viewed as [B, kv_heads, group, d]."""
    B, H, D = q.shape
    L = meta.decode_max_len
    k = gather_kv(k_cache, meta.decode_block_tables, L)
    v = gather_kv(v_cache, meta.decode_block_tables, L)
    kv_heads = k.shape[1]
    qg = q.view(B, kv_heads, H // kv_heads, D)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, kv_heads, group, L]
    if B > 1:
        pad = torch.arange(L, device=q.device)[None, :] >= meta.decode_lengths[:, None]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        v = v.masked_fill(pad[:, None, :, None], 0)  # rows past a sequence's end may be uninitialized: 0 * NaN = NaN
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).view(B, H, D)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, decode=decode_attention,
              prefill=None) -> torch.Tensor:
    """Causal attention of each sequence's new queries ([T, heads, head_dim]) over its cached K/V.

    No attention crosses sequences. New tokens sit at the end of their sequence, so the causal
    mask is aligned bottom-right (query j of n new tokens sees start + j + 1 keys). `decode` attends
    the single-token sequences, `prefill(q [n, H, D], k_cache, v_cache, block_table [nb], start, scale)`
    each longer one (a backend passes its kernels; SDPA by default)."""
    if meta.all_decode:
        return decode(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if meta.decode_lengths.numel():
        out[meta.decode_rows] = decode(q[meta.decode_rows], k_cache, v_cache, meta, scale)
    for i in meta.multi_token_seqs:
        lo, hi = meta.token_offsets[i], meta.token_offsets[i + 1]
        n, start, table = hi - lo, meta.start_positions[i], meta.block_tables[i]
        if prefill is not None:
            out[lo:hi] = prefill(q[lo:hi], k_cache, v_cache, table, start, scale)
            continue
        total = start + n
        qi = q[lo:hi].transpose(0, 1)  # [heads, n, d]
        ki = gather_kv(k_cache, table, total)  # [kv_heads, total, d]
        vi = gather_kv(v_cache, table, total)
        if start == 0:
            mask, causal = None, True
        else:
            cols = torch.arange(total, device=q.device)
            rows = torch.arange(start, total, device=q.device)
            mask, causal = cols[None, :] <= rows[:, None], False
        oi = F.scaled_dot_product_attention(  # 4-D inputs: CPU's flash kernel takes only those
            qi[None], ki[None], vi[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=ki.shape[0] != qi.shape[0]
        )
        out[lo:hi] = oi[0].transpose(0, 1)
    return out
