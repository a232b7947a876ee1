"""A GGUF file's metadata and tensors, read straight from a memory map.

The gguf package's GGUFReader makes a numpy view for every part of every metadata value, and a
262144-token vocabulary is a million of them: 33 s on a 2-core machine before the first start of
the default model could begin converting it. This reader unpacks the key-value pairs with struct
into Python values (an array into a list) in well under a second, and gives
each tensor's data as the same memory-map view GGUFReader does, so that gguf.quants.dequantize
takes it unchanged.

Layout (little-endian GGUF v2 and v3): "GGUF", version u32, tensor count u64, key-value count u64;
the key-value pairs (key string, value type u32, value); the tensor infos (name string, dims u32,
each dim u64 from the fastest, type u32, offset u64 from the data start); the data, aligned to
general.alignment (32 unless given). A string is a u64 length and its UTF-8 bytes.
"""
from __future__ import annotations

import hashlib
import mmap
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_ARRAY, _STRING = 9, 8
_U64 = struct.Struct("<Q")
# value type -> (struct format, numpy dtype) for the fixed-size types
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
# tensor types whose data are plain numbers rather than quantized blocks
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF lists it: the fastest-varying dimension first
    data: np.ndarray        # numbers, or for quantized types bytes: [..., bytes per row]


class MappedFile:
    """A file's read-only memory map, apart from what was parsed out of it: what a tensor read in
    place keeps alive, and not the metadata (a vocabulary is tens of MB of Python strings)."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            try:
                self.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise ValueError(f"{path} is not a GGUF file (it is empty)") from None
        self.bytes = np.frombuffer(self.mmap, dtype=np.uint8)

    def release_pages(self, part: np.ndarray | None = None) -> None:
        """Drops this process's pages of the file, or of `part` of it (a tensor's data): they stay
        in the page cache, what was read stops counting as this process's memory, and a later read
        faults the page in again."""
        if part is None:
            self.mmap.madvise(mmap.MADV_DONTNEED)
            return
        start = part.ctypes.data - self.bytes.ctypes.data
        first = start - start % mmap.PAGESIZE
        self.mmap.madvise(mmap.MADV_DONTNEED, first, start + part.nbytes - first)


class _Array(NamedTuple):
    at: int  # where the array's item type lies


class Metadata(dict):
    """The key-value pairs, an array read into a list when first looked up: a start that finds
    its tokenizer converted already never reads the vocabulary's strings (tens of MB of them)."""

    def __init__(self, parser: _Parser):
        super().__init__()
        self._parser = parser

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        if isinstance(value, _Array):
            value = self._parser.array(value.at)
            super().__setitem__(key, value)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def values(self):
        return [self[key] for key in self]

    def items(self):
        return [(key, self[key]) for key in self]


class GGUFFile:
    """metadata: {key: value}, Python values as GGUFReader's contents() gives them (a list for an
    array); tensors: in the file's order. ValueError for a file that is not GGUF, or is cut short."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        # The parser stays for the arrays read later; it holds the metadata's values, not the
        # file object (no cycle: a load's file goes when its last reference does).
        self._parser = _Parser(self.path)
        self.mapped = self._parser.mapped
        try:
            self.metadata, self.tensors = self._parser.read()
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"{self.path} is not a readable GGUF file ({exc})") from None

    def digest(self, keys: list[str]) -> str:
        """A hash of these metadata values as the file stores them (keys it lacks count as
        absent): what a cache of something derived from them alone can be keyed by."""
        return self._parser.digest(keys)

    def array_bytes(self, key: str) -> tuple[int, int, np.ndarray]:
        """Array `key`'s item type (a GGUF value type: 8 for strings), its length, and its items
        as the file holds them (a view of the map): for native code that reads a vocabulary
        without making 262144 Python strings. KeyError where the file has no such array."""
        return self._parser.array_bytes(key)


class _Parser:
    """The reading of one file's header: its metadata, its tensors' places, an array when asked."""

    def __init__(self, path: Path):
        self.path = path
        self.mapped = MappedFile(path)
        self._mmap, self._map = self.mapped.mmap, self.mapped.bytes
        self._buf = memoryview(self._map)
        self._at = 0
        self._lock = threading.Lock()  # the reading position, for an array read after the parse

    def array(self, at: int) -> list:
        with self._lock:
            self._at = at
            try:
                return self._value(_ARRAY)
            except (struct.error, UnicodeDecodeError, IndexError) as exc:
                raise ValueError(f"{self.path} is not a readable GGUF file ({exc})") from None

    def read(self) -> tuple[dict[str, Any], list[GGUFTensor]]:
        if bytes(self._buf[:4]) != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        self._at = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are; a "
                             "big-endian file reads as a huge version)")
        n_tensors, n_values = self._unpack("<Q"), self._unpack("<Q")
        metadata = Metadata(self)
        self._value_bytes: dict[str, tuple[int, int]] = {}  # key -> where its type and value lie
        for _ in range(n_values):
            key = self._string()
            start = self._at
            kind = self._unpack("<I")
            if kind == _ARRAY:
                dict.__setitem__(metadata, key, _Array(self._at))
                self._skip(kind)
            else:
                dict.__setitem__(metadata, key, self._value(kind))
            self._value_bytes[key] = (start, self._at)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, GGMLQuantizationType(self._unpack("<I")), dims, self._unpack("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        start = -(-self._at // alignment) * alignment
        return metadata, [self._tensor(name, kind, dims, start + offset) for name, kind, dims, offset in infos]

    def _tensor(self, name: str, kind: GGMLQuantizationType, dims: tuple[int, ...], at: int) -> GGUFTensor:
        count = int(np.prod(dims))
        shape = tuple(reversed(dims))
        if kind in _PLAIN:
            dtype = np.dtype(_PLAIN[kind])
            nbytes = count * dtype.itemsize
        else:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            if shape[-1] % block:
                raise ValueError(f"{self.path}: tensor {name} rows of {shape[-1]} are not whole {kind.name} blocks")
            dtype, shape = np.dtype(np.uint8), (*shape[:-1], shape[-1] // block * block_bytes)
            nbytes = count // block * block_bytes
        if at + nbytes > len(self._map):
            raise ValueError(f"{self.path} is cut short: tensor {name} ends past the end of the file")
        return GGUFTensor(name, kind, dims, self._map[at:at + nbytes].view(dtype).reshape(shape))

    def array_bytes(self, key: str) -> tuple[int, int, np.ndarray]:
        start, end = self._value_bytes[key]
        kind, item, n = struct.unpack_from("<IIQ", self._buf, start) if end - start >= 16 else (None, 0, 0)
        if kind != _ARRAY:
            raise KeyError(f"{self.path}: metadata {key} is not an array")
        return item, n, self._map[start + 16:end]

    def digest(self, keys: list[str]) -> str:
        h = hashlib.sha256()
        for key in keys:
            start, end = self._value_bytes.get(key, (0, 0))
            h.update(b"%d:%s:%d\0" % (len(key), key.encode(), end - start))
            h.update(self._buf[start:end])
        return h.hexdigest()

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        end = self._at + n
        if end > len(self._buf):
            raise ValueError(f"{self.path} is cut short inside its metadata")
        text = str(self._buf[self._at:end], "utf-8")
        self._at = end
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind][0])
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: unknown metadata value type {kind}")
        item, n = self._unpack("<I"), self._unpack("<Q")
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            end = self._at + n * dtype.itemsize
            if end > len(self._buf):
                raise ValueError(f"{self.path} is cut short inside its metadata")
            values = np.frombuffer(self._buf, dtype=dtype, count=n, offset=self._at).tolist()
            self._at = end
            return values
        if item == _STRING:
            return self._strings(n)
        return [self._value(item) for _ in range(n)]

    def _skip(self, kind: int) -> None:
        """Past a value without reading it, checking only that the file holds it."""
        if kind == _STRING:
            n = self._unpack("<Q")
            self._at += n
        elif kind in _SCALARS:
            self._at += struct.calcsize(_SCALARS[kind][0])
        elif kind != _ARRAY:
            raise ValueError(f"{self.path}: unknown metadata value type {kind}")
        else:
            item, n = self._unpack("<I"), self._unpack("<Q")
            if item in _SCALARS:
                self._at += n * struct.calcsize(_SCALARS[item][0])
            elif item == _STRING:
                at, length = self._at, _U64.unpack_from
                for _ in range(n):
                    at += 8 + length(self._buf, at)[0]
                self._at = at
            else:
                for _ in range(n):
                    self._skip(item)
        if self._at > len(self._buf):
            raise ValueError(f"{self.path} is cut short inside its metadata")

    def _strings(self, n: int) -> list[str]:
        # One loop with nothing called per string but the unpack and the decode: a vocabulary
        # is most of the metadata, and _string's calls per item took most of a start.
        buf, at, size, out = self._mmap, self._at, len(self._buf), []
        length = _U64.unpack_from
        for _ in range(n):
            (k,) = length(buf, at)
            at += 8
            if at + k > size:
                raise ValueError(f"{self.path} is cut short inside its metadata")
            out.append(buf[at:at + k].decode("utf-8"))
            at += k
        self._at = at
        return out
