"""Megatron-style tensor parallelism of a loaded (and quantized) LlamaForCausalLM.

Each rank keeps its part: the fused qkv projection by heads (a KV head's query heads stay
together; with more ranks than KV heads a KV head is replicated and its query heads split), o_proj
by its input columns with an all-reduce after it, gate_up by intermediate rows, down_proj by the
same intermediate columns with an all-reduce, and the embedding / lm_head by vocabulary rows (the
embedding's rows all-reduced, the logits gathered on rank 0 for sampling). Splits may be uneven
(SmolLM2's 3 KV heads over 2 ranks: 2 and 1). Quantized weights are cut along their groups, so each
rank holds exactly the values a single process holds; a cut that would split a group is an error.

Rows sum in another order than one process sums them: logits agree to float rounding. Under w8a8
a row-parallel input's per-token scales are the maximum over all ranks (one all-reduce of T
floats), so the int8 values are the very ones a single process makes, and the ranks sum their
exact int32 accumulators before the one dequantization: the single process's values bit for bit
(summing dequantized floats instead differed in the last bits, which int8 rounding in later layers
amplified to logits ~2 apart on the default model)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..errors import FasterLlamaError
from ..model.llama import Linear, LlamaForCausalLM, SiluAndMul
from ..quant.convert import SiluAndMulQuant
from ..quant.linear import FusedLinear, Int4Linear, Int8Linear, PackedLinear, QuantizedEmbedding, W8A8Linear
from .group import TPGroup


def even_split(n: int, parts: int) -> list[int]:
    """n items in `parts` contiguous chunks whose sizes differ by at most one (larger first)."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def _chunk(n: int, parts: int, rank: int, unit: int = 1) -> range:
    sizes = [s * unit for s in even_split(n // unit, parts)]
    lo = sum(sizes[:rank])
    return range(lo, lo + sizes[rank])


def _intermediate_unit(intermediate: int, size: int) -> int:
    """The intermediate columns split in whole blocks of the largest power of two up to 256 (a
    K-quant super-block) that divides them and leaves a block for every rank: whole groups of any
    quantization (16 .. 256 columns) on every rank."""
    unit = 256
    while unit > 1 and (intermediate % unit or intermediate // unit < size):
        unit //= 2
    return unit


@dataclass(frozen=True)
class ShardPlan:
    """Which heads, intermediate columns and vocabulary rows one rank holds, and so which rows or
    input columns of each weight (`cut_module`)."""

    cfg: ModelConfig
    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range
    vocab_sizes: tuple[int, ...]

    @classmethod
    def build(cls, cfg: ModelConfig, rank: int, size: int) -> ShardPlan:
        heads, kv, group = cfg.num_heads, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
        if size <= kv:
            kv_heads = _chunk(kv, size, rank)
            q_heads = range(kv_heads.start * group, kv_heads.stop * group)
        else:  # more ranks than KV heads: each KV head on size/kv ranks, its query heads split between them
            if size % kv or size // kv > group:
                raise FasterLlamaError(f"tensor_parallel_size {size} does not fit the model's {kv} KV heads and {heads} query heads "
                                       f"(use at most {kv} ranks, or a multiple of {kv} up to {heads})")
            per = size // kv
            kv_heads = range(rank // per, rank // per + 1)
            own = _chunk(group, per, rank % per)
            q_heads = range(kv_heads.start * group + own.start, kv_heads.start * group + own.stop)
        if cfg.intermediate_size < size:
            raise FasterLlamaError(f"the intermediate size {cfg.intermediate_size} does not split over {size} ranks")
        unit = _intermediate_unit(cfg.intermediate_size, size)
        return cls(cfg, rank, size, q_heads, kv_heads, _chunk(cfg.intermediate_size, size, rank, unit),
                   _chunk(cfg.vocab_size, size, rank), tuple(even_split(cfg.vocab_size, size)))

    def local_config(self) -> ModelConfig:
        """The config of this rank's attention (its heads): what its KV cache holds."""
        return replace(self.cfg, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads))

    def local_model_config(self) -> ModelConfig:
        """The config of a model with only this rank's part (built, then filled by cut_tensor's parts)."""
        return replace(self.local_config(), intermediate_size=len(self.intermediate), vocab_size=len(self.vocab), head_dim=self.cfg.head_dim)

    def cut_tensor(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint's canonical (HF-named) tensor as it loads; a row-parallel
        bias stays whole on rank 0 and is zero elsewhere (the all-reduce adds it once)."""
        hd, parts = self.cfg.head_dim, name.split(".")
        kind, is_bias = (parts[-2] if len(parts) > 1 else ""), parts[-1] == "bias"
        heads = {"q_proj": self.q_heads, "k_proj": self.kv_heads, "v_proj": self.kv_heads}.get(kind)
        if heads is not None:
            return t[heads.start * hd : heads.stop * hd]
        if kind in ("gate_proj", "up_proj"):
            return t[self.intermediate.start : self.intermediate.stop]
        if kind in ("embed_tokens", "lm_head"):
            return t[self.vocab.start : self.vocab.stop]
        if kind in ("o_proj", "down_proj"):
            if is_bias:
                return t if self.rank == 0 else torch.zeros_like(t)
            cols = range(self.q_heads.start * hd, self.q_heads.stop * hd) if kind == "o_proj" else self.intermediate
            return t[:, cols.start : cols.stop]
        return t

    def rows_and_cols(self, path: str) -> tuple[torch.Tensor | None, slice | None]:
        """(output rows, input columns) this rank keeps of the weight at `path` (a module path
        such as layers.3.self_attn.qkv_proj, lm_head or embed_tokens)."""
        cfg, hd = self.cfg, self.cfg.head_dim
        q, kv, inter = self.q_heads, self.kv_heads, self.intermediate
        kind = path.rsplit(".", 1)[-1]
        if kind == "qkv_proj":
            return torch.cat([torch.arange(q.start * hd, q.stop * hd), cfg.q_size + torch.arange(kv.start * hd, kv.stop * hd),
                              cfg.q_size + cfg.kv_size + torch.arange(kv.start * hd, kv.stop * hd)]), None
        if kind == "o_proj":
            return None, slice(q.start * hd, q.stop * hd)
        if kind == "gate_up_proj":
            return torch.cat([torch.arange(inter.start, inter.stop), cfg.intermediate_size + torch.arange(inter.start, inter.stop)]), None
        if kind == "down_proj":
            return None, slice(inter.start, inter.stop)
        if kind in ("lm_head", "embed_tokens"):
            return torch.arange(self.vocab.start, self.vocab.stop), None
        raise FasterLlamaError(f"tensor parallelism does not split {path!r}")


# -- cutting one module -----------------------------------------------------------------------------
def _group_of(module: nn.Module) -> int:
    """Input columns one quantization scale covers (1: per channel or float)."""
    return getattr(module, "group_size", None) or 1


def _cols_of_groups(cols: slice, group: int, what: str, k: int) -> slice:
    if cols.start % group or cols.stop % group:
        raise FasterLlamaError(f"tensor parallelism would cut {what}'s groups of {group} input columns at column "
                               f"{cols.start if cols.start % group else cols.stop} of {k}; use a tensor_parallel_size that splits it "
                               "on group boundaries")
    return slice(cols.start // group, cols.stop // group)


def _part_rows(rows: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """The rows among `rows` (of a fused projection) that fall in the part [start, start + n), as
    the part's own indices."""
    inside = rows[(rows >= start) & (rows < start + n)]
    return inside - start


def take(module: nn.Module, rows: torch.Tensor | None = None, cols: slice | None = None, bias: bool = True, what: str = "a weight") -> nn.Module:
    """A new module of the same kind holding rows `rows` (output features) and input columns
    `cols` of `module`'s weight, values unchanged; bias=False drops the bias (row-parallel ranks
    after the first: the all-reduce adds it once)."""
    every = slice(None)
    if isinstance(module, FusedLinear):  # each part its own rows of the whole's
        kept, start = [], 0
        for p in module.parts:
            mine = None if rows is None else _part_rows(rows, start, p.out_features)
            if mine is None or len(mine):
                kept.append(take(p, mine, cols, bias, what))
            start += p.out_features
        return kept[0] if len(kept) == 1 else FusedLinear(kept)
    r = every if rows is None else rows
    c = every if cols is None else cols
    b = None if module.bias is None or not bias else module.bias.data[r].clone()
    if isinstance(module, Linear):
        w = module.weight.data[r][:, c].contiguous()
        new = Linear(w.shape[1], w.shape[0], bias=b is not None)
        new.weight = nn.Parameter(w, requires_grad=False)
        new.bias = None if b is None else nn.Parameter(b, requires_grad=False)
        return new
    gc = every if cols is None else _cols_of_groups(cols, _group_of(module), what, module.in_features)
    if isinstance(module, W8A8Linear):
        return W8A8Linear(module.qweight.data[r][:, c], module.weight_scale.data[r], module.input_scale, b, module.dtype, module.clip)
    if isinstance(module, Int8Linear):
        q, s = module.rows_layout()
        m = module.weight_min
        return _same_activations(module, Int8Linear(q[r][:, c], s[r] if module.group_size is None else s[r][:, gc], b,
                                                    None if m is None else m.data[r][:, gc]))
    if isinstance(module, Int4Linear):
        q, s, m = module._rows(every)
        sups = module.sups
        per_sup = 1 if sups is None else module.scales.shape[1] // sups[0].shape[1]  # groups a super-block
        whole = gc.start is None or (gc.start % per_sup == 0 and gc.stop % per_sup == 0)
        if sups is not None and whole:  # Q4_K's factored form (4.6 bits a weight, not 6) where the cut keeps super-blocks whole
            sc = every if gc.start is None else slice(gc.start // per_sup, gc.stop // per_sup)
            return _same_activations(module, Int4Linear(q[r][:, c], module.scales[r][:, gc], module.mins[r][:, gc], b,
                                                        scale_super=sups[0][r][:, sc], min_super=sups[1][r][:, sc]))
        return _same_activations(module, Int4Linear(q[r][:, c], s[r][:, gc], m[r][:, gc], b, scale_dtype=s.dtype))
    if isinstance(module, PackedLinear):
        q, s, m = module.rows_layout()
        return _same_activations(module, PackedLinear(q[r][:, c], s[r][:, gc], None if m is None else m[r][:, gc], module.bits, b))
    raise FasterLlamaError(f"tensor parallelism cannot split a {type(module).__name__}")


def _same_activations(module: nn.Module, part: nn.Module) -> nn.Module:
    """A quantized linear's part takes x as the whole did: rounded to int8 under "gguf-a8"."""
    part.int8_activations = module.int8_activations
    return part


def cut_module(plan: ShardPlan, path: str, module: nn.Module) -> nn.Module:
    """This rank's part of the linear at `path` (as it loads, or after quantization); a part
    already cut stays as it is."""
    if getattr(module, "tp_cut", False):
        return module
    rows, cols = plan.rows_and_cols(path)
    part = take(module, rows, cols, bias=cols is None or plan.rank == 0, what=path)
    part.tp_cut = True
    return part


class RowParallel(nn.Module):
    """A linear holding some input columns: its partial outputs summed over the ranks. Under w8a8
    (`quant` = (static scale, clip) of the quantizer it replaces, `bias` the whole linear's) the
    int8 input is quantized here with the per-token scale of the whole row (the maximum over the
    ranks), and the int32 accumulators are summed before they are dequantized."""

    def __init__(self, inner: nn.Module, group: TPGroup, quant: tuple[torch.Tensor | None, bool] | None = None,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.inner, self.group, self.quant, self.bias = inner, group, quant, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return self.group.all_reduce(self.inner(x))
        static, clip = self.quant
        xf = x.float()
        amax = self.group.all_reduce(xf.abs().amax(dim=-1), dist.ReduceOp.MAX)
        scale = ops.quantized.per_token_scales(amax, static, clip)
        xq = torch.round(xf / scale[..., None]).clamp(-127, 127).to(torch.int8)
        acc = self.group.all_reduce(ops.int8_gemm(xq.reshape(-1, xq.shape[-1]), self.inner.qweight.t()))
        y = ops.dequantize_gemm(acc, scale.reshape(-1), self.inner.weight_scale, self.bias, x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of this rank's vocabulary slice; other tokens' rows are zero here and
    come from their rank in the all-reduce."""

    def __init__(self, inner: nn.Module, vocab: range, group: TPGroup) -> None:
        super().__init__()
        self.inner, self.lo, self.n, self.group = inner, vocab.start, len(vocab), group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        inside = (local >= 0) & (local < self.n)
        h = self.inner(torch.where(inside, local, 0)).masked_fill(~inside[:, None], 0)
        return self.group.all_reduce(h)


class ParallelLMHead(nn.Module):
    """The logits of this rank's vocabulary slice, gathered side by side on rank 0 (None elsewhere)."""

    def __init__(self, inner: nn.Module, sizes: tuple[int, ...], group: TPGroup) -> None:
        super().__init__()
        self.inner, self.sizes, self.group = inner, list(sizes), group

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.group.gather_last_dim(self.inner(x), self.sizes)


def shard_model(model: LlamaForCausalLM, group: TPGroup) -> ShardPlan:
    """Cut `model` in place down to rank group.rank's part and put the collectives between the
    parts; returns the plan it followed. A model loaded in parts (model.tp_plan, see
    loading.model_loader) is only wrapped."""
    cfg = model.config
    plan = ShardPlan.build(cfg, group.rank, group.size)
    loaded_cut = getattr(model, "tp_plan", None) is not None
    if loaded_cut:
        for m in model.modules():
            m.tp_cut = True
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = cut_module(plan, f"layers.{i}.self_attn.qkv_proj", attn.qkv_proj)
        o_quant = (attn.o_proj.input_scale, attn.o_proj.clip) if isinstance(attn.o_proj, W8A8Linear) else None
        o_bias = attn.o_proj.bias if o_quant is not None else None
        attn.o_proj = RowParallel(cut_module(plan, f"layers.{i}.self_attn.o_proj", attn.o_proj), group, o_quant, o_bias)
        attn.num_heads, attn.num_kv_heads = len(plan.q_heads), len(plan.kv_heads)
        attn.q_size, attn.kv_size = len(plan.q_heads) * cfg.head_dim, len(plan.kv_heads) * cfg.head_dim
        mlp.gate_up_proj = cut_module(plan, f"layers.{i}.mlp.gate_up_proj", mlp.gate_up_proj)
        down_quant = None
        if isinstance(mlp.act, SiluAndMulQuant):  # quantized in RowParallel, over the whole row
            down_quant, mlp.act = (mlp.act.static_scale, mlp.act.clip), SiluAndMul()
        elif isinstance(mlp.down_proj, W8A8Linear):
            down_quant = (mlp.down_proj.input_scale, mlp.down_proj.clip)
        down_bias = mlp.down_proj.bias if down_quant is not None else None
        mlp.down_proj = RowParallel(cut_module(plan, f"layers.{i}.mlp.down_proj", mlp.down_proj), group, down_quant, down_bias)
    embed = model.embed_tokens
    if isinstance(embed, QuantizedEmbedding):  # its table: a quantized matrix, the lm_head too when tied
        tied = model.lm_head is embed.table
        embed = QuantizedEmbedding(cut_module(plan, "embed_tokens", embed.table), embed.dtype)
        head = embed.table if tied else cut_module(plan, "lm_head", model.lm_head)
    else:
        tied = isinstance(model.lm_head, Linear) and model.lm_head.weight is embed.weight
        if not loaded_cut:
            w = embed.weight.data[plan.vocab.start : plan.vocab.stop].clone()
            embed = nn.Embedding(len(plan.vocab), w.shape[1], _weight=w).requires_grad_(False)
        if tied:
            head = Linear(cfg.hidden_size, len(plan.vocab))
            head.weight = embed.weight  # (the same tensor when loaded in parts too)
        else:
            head = cut_module(plan, "lm_head", model.lm_head)
    model.embed_tokens = VocabParallelEmbedding(embed, plan.vocab, group)
    model.lm_head = ParallelLMHead(head, plan.vocab_sizes, group)
    return plan
