"""Quantized linear layers. Each has the call signature of model.llama.Linear (x -> y) and keeps
its weights quantized in memory; `dequantize()` gives the float weight back (tests, embedding)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .. import ops
from ..backends.cpu import kernels as cpu_kernels
from .quantize import dequantize_int4, dequantize_int8


def _buffer(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class _PanelStorage:
    """For the weight-only linears: `use_panels()` permutes the tensors into the CPU kernels' panels
    of 32 rows (ops.to_panels, ops.int8_to_panels), which the CPU engine does. State dicts always
    hold the row layout (`rows_layout()`), so saved checkpoints do not depend on it."""

    ROW_FIELDS: tuple[str, ...] = ()
    panels = False

    def rows_layout(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _rows_derived(self) -> bool:
        """Whether the saved row layout differs from the tensors held (then it is computed)."""
        return self.panels

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._rows_derived():
            for name, t in zip(self.ROW_FIELDS, self.rows_layout()):
                destination[prefix + name] = t


class Int8Linear(_PanelStorage, nn.Module):
    """Weight-only int8 (mode `w8`): per output channel, or per group of input columns (Q8_0-like);
    optionally with a min per group, w = q * scale + min (a GGUF's Q5_1, Q5_K and Q2_K blocks off
    the CPU, whose values 0..31 or 0..3 it holds exactly; those stay in rows, never panels)."""

    ROW_FIELDS = ("qweight", "weight_scale")
    int8_activations = False  # quantization "gguf-a8": x rounded to int8 per chunk (ops.int8_weight_linear_a8, panel_linear_a8)

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, mins: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.qweight = _buffer(qweight.contiguous())
        self.weight_scale = _buffer(scale.float().contiguous())
        self.bias = None if bias is None else _buffer(bias)
        self.group_size = None if scale.dim() == 1 else self.in_features // scale.shape[1]
        assert mins is None or (self.group_size is not None and mins.shape == scale.shape), "mins need per-group scales of their shape"
        self.weight_min = None if mins is None else _buffer(mins.float().contiguous())

    def use_panels(self) -> None:
        if not self.panels and self.weight_min is None:  # (the CPU's int8 panels have no mins: rows and the reference op)
            qp, sp = ops.int8_to_panels(self.qweight, self.weight_scale)
            self.qweight, self.weight_scale = _buffer(qp), _buffer(sp)
            self.panels = True

    def _rows(self, rows: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.panels:
            return self.qweight[rows], self.weight_scale[rows]
        q, s = ops.int8_panel_rows(self.qweight, self.weight_scale, rows, self.out_features)
        return q, s.reshape(-1) if self.group_size is None else s.contiguous()

    def rows_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rows(slice(None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels:
            panel_linear = ops.panel_linear_a8 if self.int8_activations else ops.panel_linear
            return panel_linear(x, self.qweight, self.weight_scale, None, self.out_features, 8, self.bias)
        linear = ops.int8_weight_linear_a8 if self.int8_activations else ops.int8_weight_linear
        return linear(x, self.qweight, self.weight_scale, self.bias, self.weight_min)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(*self.rows_layout(), dtype, self.weight_min)

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int8(*self._rows(rows), dtype, None if self.weight_min is None else self.weight_min[rows])


class Int4Linear(_PanelStorage, nn.Module):
    """Weight-only 4-bit, group-wise (mode `w4`; GGUF Q4_0/Q4_1/Q4_K repacked exactly off the CPU):
    w = scale * q + min per group, q in 0..15, scale and min stored in fp16; or, given scale_super
    and min_super (a GGUF's Q4_K off the CPU), in the K-quant's own factored form: `scales` and
    `mins` int8 sub-block values [N, G] times an fp16 value a super-block [N, G / gps] (4.6 bits a
    weight, not the 6 of fp32 products; the CUDA backend lays each pair out side by side for its
    kernels: backends/cuda.compact_scales). `mins` is None where the CUDA backend found every min
    -8 * scale (Q4_0's symmetric groups), which its kernels then compute, not read."""

    ROW_FIELDS = ("qweight", "scales", "mins")
    int8_activations = False  # quantization "gguf-a8": x rounded to int8 per chunk (ops.int4_weight_linear_a8, panel_linear_a8)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, bias: torch.Tensor | None = None,
                 scale_dtype: torch.dtype = torch.float16, scale_super: torch.Tensor | None = None,
                 min_super: torch.Tensor | None = None) -> None:
        super().__init__()
        assert (scale_super is None) == (min_super is None), "a factored form has both super-block values"
        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scale.shape[1]
        self.qweight = _buffer(ops.pack_int4(q, self.group_size))
        sdtype = scale_dtype if scale_super is None else torch.int8
        self.scales = _buffer(scale.to(sdtype).contiguous())  # [N, K/g]
        self.mins: nn.Parameter | None = _buffer(mins.to(sdtype).contiguous())
        self.scale_super = None if scale_super is None else _buffer(scale_super.half().contiguous())
        self.min_super = None if min_super is None else _buffer(min_super.half().contiguous())
        self.bias = None if bias is None else _buffer(bias)

    @property
    def sups(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(scale_super, min_super) of factored scales, else None: the ops' `sups` argument."""
        return None if self.scale_super is None else (self.scale_super, self.min_super)

    def _scales(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Some rows' scales as floats (factored ones: their exact fp32 products; the rows picked
        first: an embedding's lookup reads a few rows of a vocabulary's)."""
        s = self.scales[rows]
        return s if self.scale_super is None else ops.quantized.factored(s, self.scale_super[rows])

    def _mins(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Some rows' mins as floats, -8 * scale where they are not held."""
        if self.mins is None:
            return ops.quantized.symmetric_mins(self.scales[rows])
        m = self.mins[rows]
        return m if self.min_super is None else ops.quantized.factored(m, self.min_super[rows])

    def _rows_derived(self) -> bool:
        return self.panels or self.mins is None

    def use_panels(self) -> None:
        if not self.panels:
            qp, sp, mp = ops.to_panels(self.qweight, self._scales(), self._mins(), self.group_size)
            self.qweight, self.scales, self.mins = _buffer(qp), _buffer(sp), _buffer(mp)
            self.scale_super = self.min_super = None
            self.panels = True

    def _rows(self, rows: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(4-bit values [R, K], scales [R, G], mins [R, G]) of some rows."""
        if self.panels:
            q, s, m = ops.panel_rows(self.qweight, self.scales, self.mins, rows, self.out_features)
        else:
            q, s, m = ops.unpack_int4_rows(self.qweight, rows, self.group_size), self._scales(rows), self._mins(rows)
        return q.reshape(q.shape[0], -1), s, m

    def rows_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed [N, K/2], scales [N, G], mins [N, G]) whichever the storage (factored scales
        and mins as their float products)."""
        if self.panels:
            return ops.from_panels(self.qweight, self.scales, self.mins, self.out_features)
        return self.qweight, self._scales(), self._mins()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels:
            panel_linear = ops.panel_linear_a8 if self.int8_activations else ops.panel_linear
            return panel_linear(x, self.qweight, self.scales, self.mins, self.out_features, 4, self.bias)
        linear = ops.int4_weight_linear_a8 if self.int8_activations else ops.int4_weight_linear
        return linear(x, self.qweight, self.scales, self.mins, self.group_size, self.bias, self.sups)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(*self._rows(slice(None)), dtype)

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(*self._rows(rows), dtype)


def _fp16_exact(t: torch.Tensor) -> bool:
    """Whether every value of t is an fp16 value. In numpy, as _as converts: torch's CPU fp32 ->
    fp16 copy ran ~6x slower, and a load checks every linear's scales."""
    a = t.detach().cpu().float().numpy()
    with np.errstate(over="ignore"):
        return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype (fp16 and fp32 from floats by numpy, as _fp16_exact checks them)."""
    if t.dtype == dtype or dtype not in (torch.float16, torch.float32) or not t.is_floating_point():
        return t.to(dtype)
    with np.errstate(over="ignore"):
        return torch.from_numpy(t.detach().cpu().float().numpy().astype(np.float16 if dtype == torch.float16 else np.float32))


class PackedLinear(nn.Module):
    """Weights of 2-6 or 8 bits kept in the CPU kernels' panels (ops.pack_panels) with a scale
    and a min per row and group: w = scale * q + min. GGUF's block types repack into it exactly
    (quant/gguf_native.py): Q4_0, Q5_0, Q3_K, Q6_K (mins=None: the values are centred, w = scale *
    (q - 2^(bits-1))), Q4_1, Q5_1, Q2_K, Q4_K, Q5_K (mins stored), Q8_0 (int8, no mins). Scales and mins are
    fp16 where every one of them is an fp16 value, else fp32 (a K-quant's fp16 super-block scale
    times its 6-bit sub-block scale has up to 17 significant bits), or in the K-quant's own factored
    form: scale_super given, `scale` (and `mins`) are int8 sub-block values [N, G] and
    scale_super (min_super) fp16 [N, G / gps], one per super-block of gps groups: scale = sub *
    super, exact in fp32, 1.1 bytes a group instead of 4 (Q4_K: 4.6 bits a weight, not 6)."""

    # quantization "gguf-a8": every product takes x rounded to int8 (ops.panel_linear_a8, as
    # llama.cpp computes), decode's GEMVs too (1.14-1.25x the int16-x GEMVs on Zen 1 for 4 and 6 bits; 5-bit L5 lanes about even)
    int8_activations = False

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None, bits: int, bias: torch.Tensor | None = None,
                 scale_super: torch.Tensor | None = None, min_super: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.bits = bits
        self.group_size = self.in_features // scale.shape[1]
        order = ops.quantized._panel_order
        if scale_super is not None:
            sdtype = torch.int8
            self.scale_super = _buffer(order(scale_super.half()))
            self.min_super = None if mins is None else _buffer(order(min_super.half()))
        else:
            exact16 = all(t is None or _fp16_exact(t) for t in (scale, mins))
            sdtype = torch.float16 if exact16 else torch.float32
            self.scale_super = self.min_super = None
        lanes = bits in (5, 6) and self.group_size % 8 == 0 and cpu_kernels.value_lanes()  # the layout the CPU kernels read best
        self.qweight = _buffer(ops.pack_panels(q, self.group_size, bits, lanes))
        self.scales = _buffer(order(_as(scale, sdtype)))
        self.mins = None if mins is None else _buffer(order(_as(mins, sdtype)))
        self.bias = None if bias is None else _buffer(bias)

    @property
    def sups(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(scale_super, min_super) of factored scales, else None: the ops' `sups` argument."""
        return None if self.scale_super is None else (self.scale_super, self.min_super)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (ops.panel_linear_a8 if self.int8_activations else ops.panel_linear)(x, self.qweight, self.scales, self.mins, self.out_features, self.bits,
                                                                 self.bias, self.sups)

    def rows_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(values [N, K], scales [N, G], mins [N, G] or None): what it was built from (factored
        scales and mins as their float products)."""
        n, sq = self.out_features, ops.quantized
        q = sq.unpack_panels(self.qweight, self.bits, n)
        s = sq.panel_scales(sq.factored(self.scales, self.scale_super) if self.scale_super is not None else self.scales, n)
        m = None if self.mins is None else sq.panel_scales(sq.factored(self.mins, self.min_super) if self.min_super is not None else self.mins, n)
        return q, s, m

    def dequantize_rows(self, rows: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
        return ops.dequantize_panel_rows(self.qweight, self.scales, self.mins, self.bits, rows, self.out_features, dtype, self.sups)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dequantize_rows(slice(None), dtype)

    def extra_repr(self) -> str:
        factored = "" if self.scale_super is None else f" x fp16 per {self.in_features // self.group_size // self.scale_super.shape[1]} groups"
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={self.group_size}, scales={self.scales.dtype}{factored}, mins={self.mins is not None}"


class W8A8Linear(nn.Module):
    """FasterLLaMA's INT8 GEMM (mode `w8a8`): int8 weights with per-output-channel scales, int8
    activations with per-token dynamic scales (input_scale None) or one static calibrated scale;
    int8 x int8 -> int32, dequantized by x_scale * w_scale. Accepts a float input or an already
    quantized (int8, scale) pair from a fused op (RMSNorm+quant, SiLU*mul+quant)."""

    def __init__(
        self, qweight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32, clip: bool = False,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.dtype, self.clip = dtype, clip
        self.qweight = _buffer(qweight.contiguous())
        self.weight_scale = _buffer(scale.float().contiguous())
        self.input_scale = None if input_scale is None else _buffer(input_scale.float().reshape(()))
        self.bias = None if bias is None else _buffer(bias)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.quantize_per_token(x, self.input_scale, self.clip)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], out_dtype: torch.dtype | None = None) -> torch.Tensor:
        xq, xs = x if isinstance(x, tuple) else self.quantize_input(x)
        dtype = out_dtype or (x.dtype if isinstance(x, torch.Tensor) else self.dtype)
        return ops.int8_linear(xq, xs, self.qweight, self.weight_scale, self.bias, dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.weight_scale, dtype)


class FusedLinear(nn.Module):
    """Projections fused along their outputs (q, k, v) whose quantized forms differ, each kept in
    its own: a _K_M file's q/k in Q5_0 beside v in Q8_0 would otherwise all widen to int8 (+3 bits
    a weight), an 8B file's Q4_K q/k beside Q6_K v to 6-bit values with fp32 scales in groups of 16
    (~10 bits). The CPU decode step runs the parts as one matrix (one parallel loop)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None  # the parts hold theirs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])


class QuantizedEmbedding(nn.Module):
    """Token embedding that reads rows of a quantized matrix (tied with the quantized lm_head, or
    its own), so the table is never expanded to float."""

    def __init__(self, table: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.dequantize_rows(ids, self.dtype)
