"""GGUF test files written with the ``gguf`` package's own writer (``GGUFWriter``), in
any of the types kiln reads.

``gguf.quants.quantize`` covers Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 and the float types but
not the K-quants, so :func:`quantize` adds small numpy quantizers for Q4_K, Q5_K and
Q6_K: plain min/max (Q4_K, Q5_K) and absmax (Q6_K) per sub-block, no search (llama.cpp's
quantizer searches for better scales; the blocks' layout, which is what kiln reads, is
the same). Every block they write is checked by reading it back with ``gguf``'s own
dequantizer in the tests that use them.
"""
from __future__ import annotations

import numpy as np

QK_K = 256


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """``x`` ``[rows, K]`` float32 as ``type_name``'s bytes ``[rows, bytes per row]``."""
    import gguf
    if type_name in ("Q4_K", "Q5_K"):
        return _q45_k(x, 4 if type_name == "Q4_K" else 5)
    if type_name == "Q6_K":
        return _q6_k(x)
    return gguf.quants.quantize(x.astype(np.float32), gguf.GGMLQuantizationType[type_name])


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)[..., None].view(np.uint8)


def _q45_k(x, bits):
    """Super-blocks of 256: ``d, dmin`` fp16, twelve bytes of 6-bit sub-block scales and
    minimums, (Q5_K: 32 bytes of fifth bits), 128 bytes of low nibbles."""
    rows, k = x.shape
    top = (1 << bits) - 1
    sub = x.reshape(rows, k // QK_K, 8, 32).astype(np.float32)
    low = np.minimum(sub.min(-1), 0)                        # the minimum is subtracted: mn >= 0
    scale = (sub.max(-1) - low) / top
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-low).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1, d)[..., None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / np.where(dmin == 0, 1, dmin)[..., None]), 0, 63).astype(np.uint8)
    step = d[..., None] * sc
    q = np.rint((sub + (dmin[..., None] * mn)[..., None]) / np.where(step == 0, 1, step)[..., None])
    q = np.clip(q, 0, top).astype(np.uint8)                  # [rows, supers, 8, 32]
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)], -1)
    nibbles = q & 0xF
    qs = (nibbles[..., 0::2, :] | (nibbles[..., 1::2, :] << 4)).reshape(rows, k // QK_K, 128)
    parts = [_f16_bytes(d), _f16_bytes(dmin), scales]
    if bits == 5:
        high = (q >> 4) & 1                                   # [.., 8 sub-blocks, 32]
        qh = np.zeros((rows, k // QK_K, 32), np.uint8)
        for j in range(8):
            qh |= high[..., j, :] << j
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, -1).reshape(rows, -1)


def _q6_k(x):
    """Super-blocks of 256: 128 bytes of low nibbles, 64 of high bit pairs, sixteen int8
    sub-block scales, ``d`` fp16."""
    rows, k = x.shape
    sub = x.reshape(rows, k // QK_K, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1, d)[..., None]), -128, 127).astype(np.int8)
    step = d[..., None] * sc
    q = np.clip(np.rint(sub / np.where(step == 0, 1, step)[..., None]), -32, 31) + 32
    q = q.astype(np.uint8).reshape(rows, k // QK_K, 2, 128)
    ql = ((q[..., :64] & 0xF) | ((q[..., 64:] & 0xF) << 4)).reshape(rows, k // QK_K, 128)
    high = (q >> 4).reshape(rows, k // QK_K, 2, 4, 32)
    qh = (high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6))
    return np.concatenate([ql, qh.reshape(rows, k // QK_K, 64), sc.view(np.uint8), _f16_bytes(d)],
                          -1).reshape(rows, -1)


def llama_tensors(layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=256, seed=0) -> dict:
    """A tiny Llama's float32 weights under GGUF's tensor names (``[out, in]``)."""
    rng = np.random.default_rng(seed)
    head = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (heads * head, hidden),
                       f"blk.{i}.attn_k.weight": (kv_heads * head, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * head, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, heads * head),
                       f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            std = 1.0 if name == "token_embd.weight" else 2.0 / np.sqrt(shape[1])
            out[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return out


def write_llama(path, types: dict, layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=256,
                tensors=None) -> dict:
    """Write a tiny Llama GGUF at ``path`` with each matrix in ``types[name]`` (default
    F32); returns ``{name: type}`` as written."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    tensors = tensors or llama_tensors(layers, hidden, heads, kv_heads, ffn, vocab)
    written = {}
    for name, value in tensors.items():
        kind = types.get(name, "F32")
        written[name] = kind
        if kind == "F32":
            w.add_tensor(name, value)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            data = quantize(value, kind)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


# llama.cpp's fallbacks for rows that are not a multiple of a K-quant's 256-value super-block
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def q4_k_m(name: str, layers: int, columns: int) -> str:
    """A Q4_K_M-style choice per tensor (after llama.cpp's recipe, simplified): Q6_K for
    the head and embedding and for ``attn_v``/``ffn_down`` in the first and last eighth of
    the layers and every third between, Q4_K elsewhere; K-quants fall back where rows are
    not a multiple of 256 (SmolLM2's 576-wide rows: Q4_K -> Q5_0, Q6_K -> Q8_0)."""
    if name in ("token_embd.weight", "output.weight"):
        want = "Q6_K"
    elif ".attn_v." in name or ".ffn_down." in name:
        i = int(name.split(".")[1])
        want = "Q6_K" if (i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2) else "Q4_K"
    else:
        want = "Q4_K"
    return want if columns % QK_K == 0 else K_FALLBACK[want]


def requantize_file(source, path, choose) -> dict:
    """Write ``path``: the GGUF file ``source`` (metadata, tokenizer and all) with each
    matrix dequantized and quantized again into ``choose(name, layers, columns)``; vectors
    stay float32. Returns ``{name: type}`` for the matrices."""
    import gguf
    reader = gguf.GGUFReader(str(source))
    layers = int(reader.fields["llama.block_count"].contents())
    w = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    written = {}
    for t in reader.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type)
        if x.ndim == 1:
            w.add_tensor(t.name, x)
            continue
        kind = written[t.name] = choose(t.name, layers, x.shape[1])
        data = quantize(x, kind)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
