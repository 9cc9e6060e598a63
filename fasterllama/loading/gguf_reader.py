"""A lean reader of GGUF files: metadata as plain Python values, tensors as views of one memory map.

gguf-py's GGUFReader parses every element of every metadata array into numpy views of the file
(two objects per vocabulary entry): opening the default model's file costs 160 MB of resident
memory, more than its weights. This reads the same format (GGUF v2/v3, little-endian) with the
same interface the loader uses from GGUFReader — `fields[key].contents()`, `tensors` with `name`,
`tensor_type`, `shape`, `data`, `data_offset`, `n_bytes` — and uses gguf-py's type tables
(tests/test_loading.py checks it against GGUFReader field by field and tensor by tensor)."""

from __future__ import annotations

import importlib.util
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np


def _gguf_constants() -> Any:
    """gguf-py's `constants` module (the type tables), without running the package's __init__,
    which imports its writer, vocab and sentencepiece (4 MB resident, 0.15 s) that reading a
    file never uses; the package itself where it is already imported or the file will not load."""
    if "gguf" in sys.modules:
        return sys.modules["gguf"]
    try:
        spec = importlib.util.find_spec("gguf")
        path = os.path.join(os.path.dirname(spec.origin), "constants.py")
        constants_spec = importlib.util.spec_from_file_location("fasterllama._gguf_constants", path)
        module = importlib.util.module_from_spec(constants_spec)
        sys.modules[constants_spec.name] = module  # (its enums pickle by module name)
        constants_spec.loader.exec_module(module)
        return module
    except Exception:  # a gguf-py whose constants need the package
        import gguf

        return gguf


_constants = _gguf_constants()
GGML_QUANT_SIZES, GGMLQuantizationType = _constants.GGML_QUANT_SIZES, _constants.GGMLQuantizationType

# value type id -> (struct format, numpy dtype) for the fixed-size ones
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32), 5: ("<i", np.int32),
            6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9
# tensor types numpy reads natively; the others are bytes [rows, bytes per row]
_NATIVE = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
           GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
           GGMLQuantizationType.I64: np.int64}


# Type ids llama.cpp wrote once and has since removed: files still on the Hub carry them.
_REMOVED_TYPES = {4: "Q4_2", 5: "Q4_3", 31: "Q4_0_4_4", 32: "Q4_0_4_8", 33: "Q4_0_8_8", 36: "IQ4_NL_4_4", 37: "IQ4_NL_4_8", 38: "IQ4_NL_8_8"}


class GGUFFormatError(ValueError):
    """What is wrong with a file, said in full (the loader shows it after the file's path)."""


def tensor_type(type_id: int, name: str) -> GGMLQuantizationType:
    """The type of tensor `name`, or a GGUFFormatError naming the tensor and what its id was."""
    try:
        return GGMLQuantizationType(type_id)
    except ValueError:
        pass
    if type_id in _REMOVED_TYPES:
        raise GGUFFormatError(f"tensor {name} is {_REMOVED_TYPES[type_id]} (type id {type_id}), a type llama.cpp has removed "
                              "(ARM-repacked or early 4-bit): use a file quantized since (e.g. Q4_0 or Q4_K_M)") from None
    raise GGUFFormatError(f"tensor {name} has GGUF type id {type_id}, unknown to this gguf package: the file is corrupt "
                          "or newer than it (pip install -U gguf)") from None


@dataclass
class Field:
    name: str
    value: Any
    types: tuple[int, ...] = ()  # GGUF value type ids, as GGUFReader's: (type,) or (ARRAY, item type)

    def contents(self) -> Any:
        return self.value


@dataclass
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # GGUF order: the row length first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        s = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.unpack("<I"), self.unpack("<Q")
            if itype in _SCALARS:  # one read for the whole array
                dtype = np.dtype(_SCALARS[itype][1]).newbyteorder("<")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(itype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.unpack(_SCALARS[vtype][0])


class GGUFFile:
    """Open `path` (memory-mapped, read-only): `fields` (key -> Field) and `tensors` (list of Tensor)."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as fh:
            self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        c = _Cursor(self._mmap)
        if c.unpack("<I") != 0x46554747:
            raise ValueError("bad magic")
        version = c.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
        self.fields: dict[str, Field] = {k: Field(k, v) for k, v in (("GGUF.version", version), ("GGUF.tensor_count", n_tensors), ("GGUF.kv_count", n_kv))}
        for _ in range(n_kv):
            key, vtype = c.string(), c.unpack("<I")
            types = (vtype, struct.unpack_from("<I", self._mmap, c.pos)[0]) if vtype == _ARRAY else (vtype,)
            self.fields[key] = Field(key, c.value(vtype), types)
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.unpack("<Q") for _ in range(c.unpack("<I"))]
            infos.append((name, dims, tensor_type(c.unpack("<I"), name), c.unpack("<Q")))
        alignment = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        start = -(-c.pos // alignment) * alignment
        self.tensors = [self._tensor(name, dims, ttype, start + offset) for name, dims, ttype, offset in infos]

    def _tensor(self, name: str, dims: list[int], ttype: GGMLQuantizationType, offset: int) -> Tensor:
        n = int(np.prod(dims)) if dims else 1
        block, size = GGML_QUANT_SIZES[ttype]
        n_bytes = n // block * size
        if offset + n_bytes > len(self._mmap):
            raise GGUFFormatError(f"truncated GGUF file (tensor {name} extends past the end)")
        shape = list(reversed(dims))
        if ttype in _NATIVE:
            data = np.frombuffer(self._mmap, dtype=_NATIVE[ttype], count=n, offset=offset).reshape(shape)
        else:  # blocks: bytes [..., row bytes]
            shape[-1] = shape[-1] // block * size
            data = np.frombuffer(self._mmap, dtype=np.uint8, count=n_bytes, offset=offset).reshape(shape)
        return Tensor(name, ttype, np.array(dims, dtype=np.uint64), n, n_bytes, offset, data)
