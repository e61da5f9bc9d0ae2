"""A GGUF tensor's blocks as :class:`kiln.engines.ort_blocks.Kept`: the same integers
and scales, in the layouts ``MatMulNBits`` multiplies.

Per type (GGUF block layouts as ``gguf.quants`` dequantizes them; ``q`` the stored
integers, ``d``/``dmin``/``m`` fp16, ``sc``/``mn`` the K-quants' 6-bit sub-block scales):

====== ================================= ===========================================
type   weight                            kept as
====== ================================= ===========================================
Q8_0   ``d * q``, q int8, 32 per block   8-bit, blocks of 32, scale ``d``
Q4_0   ``d * (q - 8)``, q 0..15          4-bit, blocks of 32, scale ``d``
Q5_0   ``d * (q - 16)``, q 0..31         8-bit (``u = q + 112``), blocks of 32
Q6_K   ``d*sc * (q - 32)``, 16 per sub   8-bit (``u = q + 96``), blocks of 16, ``d*sc``
Q4_1   ``d * q + m``                     4-bit + offset ``m + 8d`` per block of 32
Q5_1   ``d * q + m``                     8-bit (``u = q + 112``) + offset ``m + 16d``
Q4_K   ``d*sc * q - dmin*mn``, 32 per    4-bit + offset ``8 d*sc - dmin*mn``
Q5_K   as Q4_K, q 0..31                  8-bit (``u = q + 112``) + offset ``16 d*sc - dmin*mn``
====== ================================= ===========================================

The first four are exact: ``d * sc`` is exact in float32 (an fp16 times a small
integer), so every kept weight equals the file's dequantized weight bit for bit. The
offset forms keep the same integers and scales; the offset is one float32 rounding of
``m + 8d`` (or the K-quants' equivalent), so ``scale * (u - 8) + offset`` may differ from
``d * q + m`` in the last bit of the weight (:func:`kiln.llm.gguf_keep` records each
tensor's largest difference).

The integers are recovered with ``gguf``'s own dequantizer on a copy of the blocks
whose scales are set to 1 and minimums to 0 (then divided by the sub-block scale for
the K-quants), so the bit layouts are ``gguf``'s, not a second implementation here.
"""
from __future__ import annotations

import numpy as np

from kiln.engines.ort_blocks import Kept

_ONE = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
_ZERO = np.zeros(2, np.uint8)
# how each kept type is laid out: (bits kiln stores, source bits, block, has an offset)
LAYOUT = {"Q8_0": (8, 8, 32, False), "Q4_0": (4, 4, 32, False), "Q5_0": (8, 5, 32, False),
          "Q6_K": (8, 6, 16, False), "Q4_1": (4, 4, 32, True), "Q5_1": (8, 5, 32, True),
          "Q4_K": (4, 4, 32, True), "Q5_K": (8, 5, 32, True)}


def describe(type_name: str) -> str:
    """How a tensor of ``type_name`` is kept, in words (for notes and the manifest)."""
    bits, source, block, offset = LAYOUT[type_name]
    held = "" if bits == source else f" ({source}-bit values held in 8 bits)"
    return (f"int{bits} blocks of {block}" + (" + float offset" if offset else "") + held)


def kept(raw: np.ndarray, type_name: str, columns: int) -> Kept:
    """``raw``: the tensor's bytes ``[rows, bytes per row]`` as ``GGUFReader`` gives them;
    ``columns`` values per row (the matrix's input dim K). Its blocks as a :class:`Kept`
    for the ``[K, rows]`` weight a graph multiplies by."""
    import gguf
    qtype = gguf.GGMLQuantizationType[type_name]
    block_values, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, columns // block_values, type_size)
    bits, source, block, offset = LAYOUT[type_name]
    if type_name == "Q8_0":
        u = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Kept(8, 32, u, _f16(blocks, 0), None, type_name)
    if type_name in ("Q4_0", "Q5_0"):
        values = _integers(blocks, qtype, [(0, _ONE)])           # q - 8 or q - 16
        u = values + (8 if bits == 4 else 128)
        return _kept(u, _f16(blocks, 0), None, type_name, rows)
    if type_name in ("Q4_1", "Q5_1"):
        q = _integers(blocks, qtype, [(0, _ONE), (2, _ZERO)])
        d, m = _f16(blocks, 0), _f16(blocks, 2)
        return _with_offset(q, d, m, type_name, rows)
    if type_name in ("Q4_K", "Q5_K"):
        sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        sc = sc.reshape(rows, -1).astype(np.float32)                 # [rows, sub-blocks of 32]
        scaled = _integers(blocks, qtype, [(0, _ONE), (2, _ZERO)])   # sc * q
        q = _divide(scaled, sc)
        d = np.repeat(_f16(blocks, 0), 8, axis=1) * sc
        m = -(np.repeat(_f16(blocks, 2), 8, axis=1) * mn.reshape(rows, -1).astype(np.float32))
        return _with_offset(q, d, m, type_name, rows)
    if type_name == "Q6_K":
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(rows, -1).astype(np.float32)
        scaled = _integers(blocks, qtype, [(208, _ONE)])             # sc * (q - 32)
        u = _divide(scaled, sc) + 128
        return _kept(u, np.repeat(_f16(blocks, 208), 16, axis=1) * sc, None, type_name, rows)
    raise KeyError(type_name)


def _f16(blocks, at) -> np.ndarray:
    """The fp16 at byte ``at`` of each block, as float32 ``[rows, blocks]``."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _integers(blocks, qtype, patches) -> np.ndarray:
    """``gguf``'s dequantization of ``blocks`` with the fp16 fields in ``patches``
    (byte offset, new bytes) replaced: with scale 1 and minimum 0, the stored integers
    (times the K-quants' sub-block scales), as float32 ``[rows, K]``."""
    import gguf
    patched = blocks.copy()
    for at, value in patches:
        patched[..., at:at + 2] = value
    return gguf.quants.dequantize(patched.reshape(blocks.shape[0], -1), qtype)


def _divide(scaled, sc) -> np.ndarray:
    """``scaled / sc`` per sub-block (``sc`` ``[rows, sub-blocks]``): exact, the quotient an
    integer; a sub-block with scale 0 holds 0 whatever its integers, so they become 0."""
    rows, width = scaled.shape[0], scaled.shape[1] // sc.shape[1]
    s = scaled.reshape(rows, sc.shape[1], width)
    safe = np.where(sc == 0, 1.0, sc)[..., None]
    return np.where(sc[..., None] == 0, 0.0, s / safe).reshape(rows, -1)


def _kept(u, scales, offsets, type_name, rows) -> Kept:
    bits, _, block, _ = LAYOUT[type_name]
    u = np.rint(u).astype(np.uint8).reshape(rows, -1, block)
    return Kept(bits, block, u, scales.astype(np.float32), offsets, type_name)


def _with_offset(q, d, m, type_name, rows) -> Kept:
    """``w = d * q + m`` per block as ``d * (u - zero) + offset``: ``u = q + zero - half``
    with ``half`` the middle of the source's range, so the offset is the block's middle
    value ``m + half * d`` (small, like the weights)."""
    bits, source, _, _ = LAYOUT[type_name]
    half = 1 << (source - 1)
    zero = 1 << (bits - 1)
    offsets = (m + np.float32(half) * d).astype(np.float32).T.copy()
    return _kept(q + (zero - half), d, offsets, type_name, rows)
