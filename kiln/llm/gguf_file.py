"""A GGUF file's header checked before anything else reads it, so that a file kiln
cannot use fails with a message naming what is wrong and what to do, not a traceback
from inside ``gguf`` or transformers (``gguf.GGUFReader`` raises ``ValueError: 99 is
not a valid GGMLQuantizationType`` for a newer type, and numpy's reshape errors for a
truncated file).

The walk follows the GGUF layout (version 2 and 3): magic ``GGUF``, version, tensor and
key-value counts, the key-values (skipped, but each one's length checked against the
file), then each tensor's name, shape, ggml type and data offset; the data starts at
the next multiple of ``general.alignment`` (32 by default). It reads only the header:
SmolLM2-135M's (a 49,152-token vocabulary) takes ~0.1 s.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

from kiln.errors import UnsupportedModelError

# What kiln reads, and how (kiln.llm.gguf_keep): blocks kept on a kernel, or float.
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
READABLE = KEPT_TYPES + FLOAT_TYPES
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class GGUFFileError(UnsupportedModelError):
    """The file is not a GGUF file kiln can read: wrong magic, truncated, or a header
    that does not hold together."""


class GGUFTypeError(GGUFFileError):
    """A tensor is stored in a ggml type kiln does not read."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str          # the ggml type's name (Q4_K ...), or "type id N" for one gguf does not know
    shape: tuple       # GGUF order: innermost (the input dim of a matrix) first
    offset: int        # from the start of the data section


def check(path: str) -> list:
    """The tensors of the GGUF file at ``path`` (a list of :class:`TensorInfo`), after
    checking that the header holds together, that every tensor's bytes lie in the file
    and that each tensor's type is one kiln reads (:data:`READABLE`)."""
    return read(path)[0]


def read(path: str) -> tuple:
    """``(tensors, data_start)``: :func:`check`'s tensors and the byte where their data
    starts (a tensor's bytes are at ``data_start + offset``)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 24:
            raise GGUFFileError(f"{path}: {size} bytes is too short for a GGUF file (truncated?); "
                                "download it again")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            tensors, data_start, alignment = _walk(path, data, size)
    _check_data(path, tensors, data_start, size, alignment)
    return tensors, data_start


def row_bytes(t: TensorInfo) -> int:
    """Bytes per row (``t.shape[0]`` values) of tensor ``t``."""
    import gguf
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.type]]
    return t.shape[0] // block * type_size


def _walk(path, data, size):
    if data[:4] != b"GGUF":
        raise GGUFFileError(f"{path}: not a GGUF file (it starts with {bytes(data[:4])!r}, not b'GGUF'); "
                            "give a .gguf model file or a Hugging Face checkpoint directory")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        if version & 0xFFFF == 0 and (version >> 24) in (2, 3):   # the version's bytes read backwards
            raise GGUFFileError(f"{path}: a big-endian GGUF file (version {version >> 24}); kiln reads "
                                "little-endian GGUF files, as llama.cpp on this CPU does: convert it with "
                                "the gguf package, or export the checkpoint again without --bigendian")
        raise GGUFFileError(f"{path}: GGUF version {version}; kiln reads versions 2 and 3")
    reader = _Reader(path, data, size, 24)
    alignment = 32
    for _ in range(n_kv):
        key = reader.string()
        kind = reader.unpack("<I")
        if key == "general.alignment" and kind == 4:
            alignment = reader.unpack("<I")
        else:
            reader.skip_value(kind)
    tensors = []
    for _ in range(n_tensors):
        name = reader.string()
        dims = reader.unpack("<I")
        if dims > 8:
            raise GGUFFileError(f"{path}: tensor {name!r} has {dims} dimensions (a corrupt header); "
                                "download the file again")
        shape = tuple(reader.unpack("<Q") for _ in range(dims))
        type_id, offset = reader.unpack("<I"), reader.unpack("<Q")
        tensors.append(TensorInfo(name, _type_name(type_id), shape, offset))
    if not alignment:
        raise GGUFFileError(f"{path}: general.alignment is 0 (a corrupt header); download the file again")
    start = -(-reader.at // alignment) * alignment
    return tensors, start, alignment


def _type_name(type_id: int) -> str:
    import gguf
    try:
        return gguf.GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type id {type_id}"


def _check_data(path, tensors, data_start, size, alignment) -> None:
    import gguf
    unreadable = [t for t in tensors if t.type not in READABLE]
    if unreadable:
        t = unreadable[0]
        kinds = sorted({u.type for u in unreadable})
        raise GGUFTypeError(
            f"{path}: tensor {t.name!r} is stored as {t.type}"
            + (f" ({len(unreadable)} tensors in {', '.join(kinds)})" if len(unreadable) > 1 else "")
            + f", which kiln does not read; kiln reads {', '.join(READABLE)}. Use a file of one of "
            "those types (llama.cpp's llama-quantize converts between them, e.g. to Q4_K_M or Q8_0) "
            "or the model's Hugging Face checkpoint directory")
    for t in tensors:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.type]]
        count = 1
        for d in t.shape:
            count *= d
        if t.shape and t.shape[0] % block:
            raise GGUFFileError(f"{path}: tensor {t.name!r} ({t.type}) has rows of {t.shape[0]} values, not a "
                                f"multiple of the type's {block}-value blocks (a corrupt header)")
        end = data_start + t.offset + count // block * type_size
        if end > size:
            raise GGUFFileError(f"{path}: tensor {t.name!r} ends at byte {end} but the file has {size} bytes: "
                                "the file is truncated (an interrupted download?); download it again")
    # The tensors lie one after another in header order, each padded to the alignment, as
    # gguf's and llama.cpp's writers put them and llama.cpp's loader requires: a tensor
    # whose type or shape changed in a corrupt header then no longer meets the next one
    # (a smaller type read other tensors' bytes as its own, within the file, without a word).
    expected = 0
    for t in tensors:
        if t.offset != expected:
            raise GGUFFileError(f"{path}: tensor {t.name!r} starts at byte {t.offset} of the data, but the tensors "
                                f"before it end at byte {expected} (padded to {alignment}): a tensor's type or "
                                "shape in the header does not match its data (a corrupt header); download the "
                                "file again")
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.type]]
        count = 1
        for d in t.shape:
            count *= d
        expected += -(-(count // block * type_size) // alignment) * alignment


class _Reader:
    """Little-endian reads from the header, each checked against the file's end."""

    def __init__(self, path, data, size, at):
        self.path, self.data, self.size, self.at = path, data, size, at

    def _need(self, n):
        if n < 0 or self.at + n > self.size:
            raise GGUFFileError(f"{self.path}: the header ends past the end of the file (byte {self.at} + {n} of "
                                f"{self.size}): the file is truncated or corrupt; download it again")

    def unpack(self, fmt):
        n = struct.calcsize(fmt)
        self._need(n)
        value = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += n
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self._need(n)
        raw = bytes(self.data[self.at:self.at + n])
        self.at += n
        return raw.decode("utf-8", errors="replace")

    def skip_value(self, kind):
        if kind in _SCALARS:
            self._need(_SCALARS[kind])
            self.at += _SCALARS[kind]
        elif kind == _STRING:
            self._need(8)
            n = struct.unpack_from("<Q", self.data, self.at)[0]
            self._need(8 + n)
            self.at += 8 + n
        elif kind == _ARRAY:
            inner, count = self.unpack("<I"), self.unpack("<Q")
            if inner in _SCALARS:
                self._need(count * _SCALARS[inner])
                self.at += count * _SCALARS[inner]
            else:
                for _ in range(count):
                    self.skip_value(inner)
        else:
            raise GGUFFileError(f"{self.path}: a metadata value of unknown type {kind} at byte {self.at}: "
                                "the file is corrupt or from a newer GGUF version")
