"""A decode step, token ids to logits, in one C call (fl_decode_forward in csrc/cpu_kernels.c).

The CPU analogue of replaying a captured CUDA graph: the weights' and KV caches' addresses are
collected once into an array of C structs, so a decode step crosses from Python into C once
instead of ~300 times (embedding, every layer, final norm, lm_head). Runs steps where every sequence decodes one token (batch <= 16) on fp32
models with float (fp32, or 16-bit as stored), int8 or 4-bit linears, and steps with prompts (up to PREFILL_MAX_ROWS rows)
where every layer's linears are panels: the GEMM and the prefill attention kernel as op by op,
with the model's RoPE tables, so the logits are the op-by-op forward's to the bit (a 128-token
prompt of a Q4_K_M file 1.08x faster: the ~30 ms of Python around ~135 kernel calls gone).
Everything else goes through the model's forward, which uses the same kernels op by op and is the
reference this path is tested against. w8a8 models
(int8 activations) run here too: the C step quantizes each linear's input as the model's fused
norm/SiLU quantizers would (the static scale of each, or per token) and multiplies int8 by int8."""

from __future__ import annotations

import ctypes

import torch

from ...engine.scheduler import ScheduledSeq
from ...model.llama import Linear, LlamaForCausalLM, RMSNorm
from ...ops import AttentionMetadata, quantized
from ...quant.convert import QuantRMSNorm, SiluAndMulQuant
from ...quant.linear import FusedLinear, Int4Linear, Int8Linear, PackedLinear, QuantizedEmbedding, W8A8Linear
from . import kernels as cpu_kernels

_P, _I = ctypes.c_void_p, ctypes.c_int64
PREFILL_MAX_ROWS = 512  # past it a prompt chunk goes op by op: the step's buffers grow with its rows (~36 KB a row), the Python saved does not


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _I), ("n", _I), ("k", _I), ("g", _I), ("bits", _I), ("sbytes", _I), ("w", _P), ("scales", _P), ("mins", _P),
                ("sup_s", _P), ("sup_m", _P), ("gps", _I), ("parts", _P), ("nparts", _I), ("bias", _P), ("wsum", _P), ("in_scale", _P), ("clip", _I), ("a8", _I),
                ("wtype", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("mlp_norm", _P), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear), ("k_cache", _P), ("v_cache", _P)]


def _linear(m: torch.nn.Module, quantizer: torch.nn.Module, keep: list[torch.Tensor]) -> _Linear | None:
    """The C description of linear `m`; for w8a8, `quantizer` (the module that quantizes its input)
    holds the static scale (None: per token) and the clip setting. Tensors made here go to `keep`."""
    bias = getattr(m, "bias", None)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    if type(m) is Linear:
        return _floats(m.weight, bias) if m.in_features % 32 == 0 else None
    if isinstance(m, FusedLinear):  # matrices side by side: one kind-4 linear over their kind-1 descriptions
        parts = [_linear(p, None, keep) for p in m.parts]
        if any(p is None or p.kind != 1 or p.bias for p in parts) or len(parts) > 8:
            return None
        if len({p.a8 for p in parts}) > 1:
            return None
        array = (_Linear * len(parts))(*parts)
        keep.append(array)
        return _Linear(4, m.out_features, m.in_features, parts=ctypes.addressof(array), nparts=len(parts), a8=parts[0].a8)
    panels = _panels(m)
    if panels is not None and m.in_features % 32 == 0:
        q, scales, mins, bits, g = panels
        a8 = getattr(m, "int8_activations", False)  # quantization "gguf-a8": x rounded to int8 (kernels.panel_linear_a8's)
        if a8 and g != 16 and g % 32:
            return None
        sup_s, sup_m, gps = cpu_kernels.super_scales(scales, getattr(m, "sups", None))
        return _Linear(1, m.out_features, m.in_features, g, quantized.kernel_width(q, bits), scales.element_size(), q.data_ptr(), scales.data_ptr(), cpu_kernels.ptr(mins),
                       sup_s, sup_m, gps, bias=cpu_kernels.ptr(bias), a8=int(a8))
    if isinstance(m, W8A8Linear) and m.in_features % 32 == 0 and m.weight_scale.dim() == 1 and m.dtype == torch.float32:
        wsum = m.qweight.sum(dim=1, dtype=torch.int32)
        keep.append(wsum)
        in_scale = quantizer.input_scale if quantizer is m else getattr(quantizer, "static_scale", None)
        return _Linear(3, m.out_features, m.in_features, m.in_features, 8, 4, m.qweight.data_ptr(), m.weight_scale.data_ptr(), bias=cpu_kernels.ptr(bias),
                       wsum=wsum.data_ptr(), in_scale=cpu_kernels.ptr(in_scale), clip=int(getattr(quantizer, "clip", False)))
    return None


def _floats(w: torch.Tensor, bias: torch.Tensor | None) -> _Linear | None:
    """A kind-0 description: float weights [n, k], fp32 or 16-bit as the checkpoint stored them."""
    if w.dtype not in cpu_kernels.WEIGHT_TYPES or not w.is_contiguous():
        return None
    return _Linear(0, w.shape[0], w.shape[1], w.shape[1], 8 * w.element_size(), w.element_size(), w.data_ptr(), bias=cpu_kernels.ptr(bias),
                   wtype=cpu_kernels.WEIGHT_TYPES[w.dtype])


def _panels(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int] | None:
    """(values, scales, mins or None, bits, group size) of a linear whose weights are in panels."""
    if isinstance(m, PackedLinear) and m.group_size % 4 == 0:
        return m.qweight, m.scales, m.mins, m.bits, m.group_size
    if isinstance(m, Int8Linear) and m.panels and m.weight_scale.dtype == torch.float32:
        return m.qweight, m.weight_scale, None, 8, m.group_size or m.in_features
    if isinstance(m, Int4Linear) and m.panels and m.scales.dtype == torch.float16:
        return m.qweight, m.scales, m.mins, 4, m.group_size
    return None


def _embedding(m: torch.nn.Module, keep: list[torch.Tensor]) -> _Linear | None:
    """The C description of the token embedding's table (its rows, as a linear's weight rows)."""
    if isinstance(m, torch.nn.Embedding):
        return _floats(m.weight, None)
    if isinstance(m, QuantizedEmbedding) and m.dtype == torch.float32 and isinstance(m.table, (Int8Linear, Int4Linear, PackedLinear)):
        return _linear(m.table, None, keep)
    return None


class _DecodeInputs:
    """A decode step's inputs (token, position, KV slot, length and block table of each sequence)
    in int64/int32 buffers made once and filled through ctypes: the step makes no tensors. Each
    torch call costs 30-150 us right after a step's weights have streamed through the caches (Zen 3,
    2 cores); the five tensors pack_batch made were ~2% of a 135M model's decode step."""

    def __init__(self, rows: int, block_size: int) -> None:
        self.block_size, self.width = block_size, 0
        self.ints = torch.zeros(4, rows, dtype=torch.int64)  # tokens, positions, slot mapping, lengths
        self.ptrs = [self.ints.data_ptr() + 8 * rows * i for i in range(4)]
        self.tokens, self.positions, self.slots, self.lengths = ((ctypes.c_int64 * rows).from_address(a) for a in self.ptrs)
        self.grow(64)

    def grow(self, width: int) -> None:
        """Block tables up to `width` blocks a sequence."""
        self.width = width
        self.tables = torch.zeros(self.ints.shape[1], width, dtype=torch.int32)
        self.tables_ptr = self.tables.data_ptr()
        self.table_rows = (ctypes.c_int32 * self.tables.numel()).from_address(self.tables_ptr)

    def fill(self, batch: list[ScheduledSeq]) -> None:
        bs = self.block_size
        longest = max(len(item.seq.block_table) for item in batch)
        if longest > self.width:
            self.grow(max(longest, 2 * self.width))
        for i, item in enumerate(batch):
            seq, p = item.seq, item.seq.num_cached
            table = seq.block_table
            self.tokens[i] = seq.token_ids(p, p + 1)[0]
            self.positions[i] = p
            self.slots[i] = table[p // bs] * bs + p % bs
            self.lengths[i] = p + 1
            self.table_rows[i * self.width : i * self.width + len(table)] = table


class CPUDecodePlan:
    max_rows = cpu_kernels.GEMV_MAX_ROWS
    chains = False  # the C step runs on the host's cores: nothing to overlap (Backend.chains_steps)

    def __init__(self, model: LlamaForCausalLM, layers: ctypes.Array, embed: _Linear, lm_head: _Linear,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], made: list[torch.Tensor], prefill_rows: int = 0) -> None:
        self.model, self.layers, self.embed, self.lm_head, self.kv_caches = model, layers, embed, lm_head, kv_caches
        self.prefill_rows = prefill_rows  # the most rows a step with prompts may have here (0: none)
        # the tensors behind the addresses: kept alive even if the model's modules are replaced
        self._tensors = [t for m in (*model.layers, model.embed_tokens, model.lm_head) for t in (*m.parameters(), *m.buffers())]
        self._tensors += [model.norm.weight, model.inv_freq] + made
        cfg = model.config
        k = kv_caches[0][0]
        self.dims = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, k.shape[2], k.stride(0), k.stride(1))
        self.eps = ctypes.c_float(cfg.rms_norm_eps)
        self.decode_inputs = _DecodeInputs(self.max_rows, k.shape[2])
        self.addresses = (ctypes.addressof(layers), ctypes.addressof(embed), model.inv_freq.data_ptr(), model.norm.weight.data_ptr(), ctypes.addressof(lm_head))
        self.profile: ctypes.Array | None = None  # set by start_profile(): seconds per stage

    STAGES = ("rms_norm", "qkv_proj", "rope+store_kv", "attention", "o_proj", "gate_up_proj", "silu*mul", "down_proj", "residual add", "embedding", "lm_head")

    def start_profile(self) -> None:
        """Accumulate the time of each stage of the C decode step from now on (see profile_report)."""
        self.profile = (ctypes.c_double * len(self.STAGES))()

    def profile_report(self) -> dict[str, float]:
        return dict(zip(self.STAGES, self.profile)) if self.profile is not None else {}

    @classmethod
    def build(cls, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> CPUDecodePlan | None:
        """The plan for this model and cache, or None where the C path does not cover it."""
        cfg = model.config
        if cpu_kernels.load() is None or cfg.head_dim % 8 or cfg.head_dim > 256 or cfg.hidden_size % 8 or cfg.intermediate_size % 8:
            return None
        if any(k.device.type != "cpu" or not cpu_kernels.paged(k, v) or k.stride() != kv_caches[0][0].stride() for k, v in kv_caches):
            return None
        norms = [model.norm] + [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        if any(type(n) not in (RMSNorm, QuantRMSNorm) or n.weight.dtype != torch.float32 for n in norms) or type(model.norm) is not RMSNorm:
            return None
        structs, made = [], []
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            quantizers = (layer.input_layernorm, attn.o_proj, layer.post_attention_layernorm, mlp.act)  # what feeds each int8 input
            linears = [_linear(m, q, made) for m, q in zip(modules, quantizers)]
            if any(lin is None for lin in linears) or type(mlp.act).__name__ not in ("SiluAndMul", "SiluAndMulQuant"):
                return None
            # int8 inputs where, and only where, the model's norms and SiLU hand the linears int8
            fused = {0: type(layer.input_layernorm) is QuantRMSNorm, 2: type(layer.post_attention_layernorm) is QuantRMSNorm, 3: type(mlp.act) is SiluAndMulQuant}
            if any((linears[i].kind == 3) != quantized for i, quantized in fused.items()):
                return None
            structs.append(_Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(), *linears, k_cache.data_ptr(), v_cache.data_ptr()))
        embed, lm_head = _embedding(model.embed_tokens, made), _linear(model.lm_head, model.lm_head, made)
        if embed is None or lm_head is None or model.inv_freq.dtype != torch.float32:
            return None
        # prompts too where every layer's linears are panels (the GEMM past GEMV_MAX_ROWS, as op by
        # op) and the prefill attention kernel takes the head size; fp32 and w8a8 layers take
        # prompts op by op (oneDNN's sgemm, the int8 GEMM)
        panels = all(lin.kind in (1, 4) for layer in structs for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        prefill_rows = PREFILL_MAX_ROWS if panels and cfg.head_dim % cpu_kernels.vector_lanes() == 0 else 0
        return cls(model, (_Layer * len(structs))(*structs), embed, lm_head, kv_caches, made, prefill_rows)

    def covers(self, batch: list[ScheduledSeq]) -> bool:
        """Steps of decoding sequences (one new token each, and any drafts: a row per token), and
        up to prefill_rows rows of prompts (and decodes beside them) where the linears are panels."""
        rows = sum(item.num_tokens for item in batch)
        if all(item.num_tokens == 1 + len(item.drafts) for item in batch):
            return 0 < rows <= self.max_rows
        return 0 < rows <= self.prefill_rows

    def run(self, batch: list[ScheduledSeq], rows: list[int] | None = None) -> torch.Tensor:
        from ...engine.model_runner import pack_batch

        if rows is None and all(item.num_tokens == 1 for item in batch):  # plain decodes: the inputs in the plan's buffers
            inputs = self.decode_inputs
            inputs.fill(batch)
            logits = torch.empty(len(batch), self.lm_head.n, dtype=torch.float32)
            tokens, positions, slots, lengths = inputs.ptrs
            self._call(tokens, len(batch), slots, positions, inputs.tables_ptr, inputs.width, lengths, len(batch), logits)
            return logits
        return self.forward(*pack_batch(batch, self.dims[5], torch.device("cpu")), rows)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, rows: list[int] | None = None) -> torch.Tensor:
        """fp32 logits [B, vocab] of the step's tokens (of `rows` only, [len(rows), vocab], where
        given), as the model's forward and compute_logits give them."""
        model = self.model
        B = input_ids.shape[0]
        out_rows = None if rows is None else torch.tensor(rows, dtype=torch.int64)
        logits = torch.empty(B if rows is None else len(rows), self.lm_head.n, dtype=torch.float32)
        offsets = starts = cos = sin = None  # all decoding: one batched attention call, RoPE tables made in C
        if not meta.all_decode:  # each sequence's attention (prefill's over its rows, decode's for one); the model's RoPE tables
            offsets, starts = torch.tensor(meta.token_offsets, dtype=torch.int64), torch.tensor(meta.start_positions, dtype=torch.int64)
            cos, sin = model.rope_tables(meta.positions)
        ptr = cpu_kernels.ptr
        self._call(input_ids.data_ptr(), B, meta.slot_mapping.data_ptr(), meta.positions.data_ptr(), meta.block_tables.data_ptr(),
                   meta.block_tables.stride(0), meta.decode_lengths.data_ptr(), meta.num_seqs, logits, ptr(out_rows), ptr(offsets), ptr(starts),
                   ptr(cos), ptr(sin))
        return logits

    def _call(self, input_ids: int, B: int, slots: int, positions: int, tables: int, table_stride: int, lengths: int, num_seqs: int,
              logits: torch.Tensor, out_rows: int | None = None, offsets: int | None = None, starts: int | None = None, cos: int | None = None,
              sin: int | None = None) -> None:
        """fl_decode_forward on the addresses of the step's inputs (offsets, starts, cos, sin: steps with prompts)."""
        hidden, H, KVH, D, inter, block_size, block_stride, head_stride = self.dims
        layers, embed, inv_freq, norm, lm_head = self.addresses
        cpu_kernels.load().fl_decode_forward(
            layers, len(self.layers), input_ids, embed, B, hidden, H, KVH, D, inter, block_size, block_stride, head_stride, self.eps,
            inv_freq, slots, positions, tables, table_stride, lengths, num_seqs, offsets, starts, logits.shape[0], out_rows, cos, sin, norm,
            lm_head, logits.data_ptr(), None if self.profile is None else ctypes.addressof(self.profile),
        )
