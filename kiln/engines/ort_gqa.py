"""kiln's cached attention at one new token per row on ONNX Runtime's
``com.microsoft.GroupQueryAttention`` (the ``attention`` rewrite of
:mod:`kiln.engines.ort_decoder`, whose docstring says why and what is proven).

Two spellings are matched, as ORT's optimiser leaves them: score products as
``FusedMatMul`` (level ``all``) or ``MatMul`` of a scaled query and a transposed key, and
the probabilities cut by one ``Split`` or two ``Slice`` nodes. The operator takes the
query, key and value as ``[B, 1, heads * D]``, which at one token is the same memory as
the ``[B, heads, 1, D]`` the step computes, so where the step made them from those
products (reshape and transpose) the products are read directly.
"""
from __future__ import annotations

import numpy as np

from kiln.engines.ort_graph import MS, attr, scalar, single_user, target


def fuse(g) -> int:
    """kiln's cached attention at one token per row -> ``GroupQueryAttention`` (module doc)."""
    count, biases = 0, {}
    for softmax in [n for n in g.nodes if n.op_type == "Softmax"]:
        m = _match_attention(g, softmax)
        if m is None:
            continue
        b, kv_heads, window, dim = m["cache_shape"]
        heads = kv_heads * m["groups"]
        key = (m["mask"], m["masked_is_true"])
        if key not in biases:
            biases[key] = _bias(g, m, (b, heads, 1, window + 1))
        q = _rows_of(g, m["q4"], b, heads, dim)
        k = _rows_of(g, m["k4"], b, kv_heads, dim, keep_4d=True)
        v = _rows_of(g, m["v4"], b, kv_heads, dim)
        seqlens = g.constant(np.full(b, window, np.int32), "seqlens")
        total = g.constant(np.array(window + 1, np.int32), "total")
        out = g.fresh("attention")
        g.add("GroupQueryAttention", [q, k, v, m["k_cache"], m["v_cache"], seqlens, total, "", "", "", biases[key]],
              [out, g.fresh("present_key"), g.fresh("present_value")], domain=MS,
              num_heads=heads, kv_num_heads=kv_heads, scale=m["scale"])
        g.remove(*m["nodes"])
        _write_back(g, m["out4"], out, (b, heads, 1, dim))
        count += 1
    return count


def _match_attention(g, softmax):
    """The parts of one cached attention (:func:`kiln.llm.decoder.cached_attention`) ending
    in ``softmax``, at one new token, or None."""
    where = g.op(softmax.input[0], "Where")
    if where is None or attr(softmax, "axis") not in (-1, 2):
        return None
    cond, a, b = where.input
    if g.op(a, "Concat") is not None and scalar(g, b) == float("-inf"):
        cat, masked_is_true = g.op(a, "Concat"), False
    elif g.op(b, "Concat") is not None and scalar(g, a) == float("-inf"):
        cat, masked_is_true = g.op(b, "Concat"), True
    else:
        return None
    if len(cat.input) != 2 or attr(cat, "axis") not in (-1, 2):
        return None
    scores = [_score_product(g, i) for i in cat.input]
    if None in scores or scores[0]["q"] != scores[1]["q"] or scores[0]["scale"] != scores[1]["scale"]:
        return None
    views = [g.op(i, "Reshape") for i in (scores[0]["q"], scores[0]["k"], scores[1]["k"])]
    if None in views:
        return None
    q4, k_cache, k4 = (v.input[0] for v in views)
    cache_shape = g.shapes.get(k_cache)
    if cache_shape is None or len(cache_shape) != 4:
        return None
    b, kv_heads, window, dim = cache_shape
    q_rows, kn_rows = (target(g, v) for v in (views[0], views[2]))
    if q_rows is None or kn_rows is None or list(kn_rows) != [b * kv_heads, 1, dim] \
            or len(q_rows) != 3 or q_rows[0] != b * kv_heads or q_rows[2] != dim:
        return None
    tail = _value_side(g, softmax, window, b * kv_heads, dim)
    if tail is None or g.shapes.get(tail["v_cache"]) != cache_shape or g.shapes.get(cond) != \
            [b * kv_heads, int(q_rows[1]), window + 1]:
        return None
    nodes = [where, cat, *scores[0]["nodes"], *scores[1]["nodes"], *views, softmax, *tail["nodes"]]
    return dict(cache_shape=cache_shape, groups=int(q_rows[1]), mask=cond, masked_is_true=masked_is_true,
                scale=scores[0]["scale"], q4=q4, k4=k4, k_cache=k_cache,
                v_cache=tail["v_cache"], v4=tail["v4"], out4=tail["out4"], nodes=nodes)


def _score_product(g, value):
    """``q @ k^T * scale`` as ORT's optimiser leaves it: ``FusedMatMul(q, k, transB, alpha)``
    (level ``all``) or ``MatMul([Mul(]q[, scale)], Transpose(k, [0, 2, 1]))``; its parts."""
    fused = g.op(value, "FusedMatMul", MS)
    if fused is not None:
        if (attr(fused, "transB", 0) != 1 or attr(fused, "transA", 0) or attr(fused, "transBatchA", 0)
                or attr(fused, "transBatchB", 0)):
            return None
        return dict(q=fused.input[0], k=fused.input[1], scale=float(attr(fused, "alpha", 1.0)), nodes=[fused])
    product = g.op(value, "MatMul")
    transpose = g.op(product.input[1], "Transpose") if product is not None else None
    if transpose is None or list(attr(transpose, "perm", [])) != [0, 2, 1]:
        return None
    q, scale, nodes = product.input[0], 1.0, [product, transpose]
    mul = g.op(q, "Mul")
    if mul is not None:
        factor = [i for i in mul.input if scalar(g, i) is not None]
        if len(factor) != 1:
            return None
        scale = scalar(g, factor[0])
        q = next(i for i in mul.input if i != factor[0])
        nodes.append(mul)
    return dict(q=q, k=transpose.input[0], scale=scale, nodes=nodes)


def _value_side(g, softmax, window, rows, dim):
    """``Split(probs, [W, 1])`` -> two value products -> ``Add`` -> ``Reshape`` to heads."""
    parts = _probability_parts(g, softmax.output[0], window)
    if parts is None:
        return None
    probs, split = parts
    products = [single_user(g, o, "MatMul") for o in probs]
    if None in products or [p.input[0] for p in products] != probs:
        return None
    views = [g.op(p.input[1], "Reshape") for p in products]
    if None in views or target(g, views[0]) != [rows, window, dim] or target(g, views[1]) != [rows, 1, dim]:
        return None
    add = single_user(g, products[0].output[0], "Add")
    if add is None or set(add.input) != {p.output[0] for p in products}:
        return None
    out = single_user(g, add.output[0], "Reshape")
    if out is None:
        return None
    return dict(nodes=[*split, *products, *views, add, out], v_cache=views[0].input[0], v4=views[1].input[0],
                out4=out.output[0])


def _probability_parts(g, probs, window):
    """``([cached, new], nodes)``: the probabilities cut at ``window`` along the last axis,
    by one ``Split`` (level ``all``) or two ``Slice`` nodes."""
    users = g.users(probs)
    if len(users) == 1 and users[0].op_type == "Split" and len(users[0].output) == 2:
        sizes = g.const(users[0].input[1]) if len(users[0].input) > 1 else None
        if sizes is None or [int(s) for s in sizes] != [window, 1] or attr(users[0], "axis") not in (-1, 2):
            return None
        return list(users[0].output), [users[0]]
    if len(users) != 2 or any(u.op_type != "Slice" for u in users):
        return None
    spans = {}
    for u in users:
        starts, ends, axes = (g.const(u.input[k]) if len(u.input) > k else None for k in (1, 2, 3))
        steps = g.const(u.input[4]) if len(u.input) > 4 and u.input[4] else np.ones(1)
        if starts is None or ends is None or axes is None or starts.size != 1 or int(steps.reshape(-1)[0]) != 1 \
                or int(axes.reshape(-1)[0]) not in (-1, 2):
            return None
        spans[(int(starts.reshape(-1)[0]), min(int(ends.reshape(-1)[0]), window + 1))] = u
    if set(spans) != {(0, window), (window, window + 1)}:
        return None
    cached, new = spans[(0, window)], spans[(window, window + 1)]
    return [cached.output[0], new.output[0]], [cached, new]


def _bias(g, m, shape) -> str:
    """``[B, H, 1, W + 1]`` float: 0 where a slot may be seen, -inf where not (once per mask)."""
    cond = m["mask"]
    shaped = g.fresh("mask")
    g.add("Reshape", [cond, g.constant(np.array(shape, np.int64), "mask_shape")], [shaped])
    zero, ninf = g.constant(np.array(0, np.float32), "zero"), g.constant(np.array(-np.inf, np.float32), "ninf")
    bias = g.fresh("bias")
    g.add("Where", [shaped, ninf, zero] if m["masked_is_true"] else [shaped, zero, ninf], [bias])
    return bias


def _rows_of(g, x4, b, heads, dim, keep_4d=False) -> str:
    """``[B, heads, 1, D]`` as the ``[B, 1, heads * D]`` the operator takes. Where ``x4`` is
    ``[RotaryEmbedding(]Transpose(Reshape(x3)))[)]`` the 3-D ``x3`` is used directly
    (rotary on it, with ``num_heads``); ``keep_4d``: ``x4`` still has other readers (the
    step's new keys), so it is rewritten as a view of the 3-D result."""
    rotary = g.op(x4, "RotaryEmbedding")
    inner = rotary.input[0] if rotary is not None else x4
    x3 = _unheaded(g, inner, b, heads, dim)
    if x3 is None or (rotary is not None and (attr(rotary, "interleaved", 0) or
                                              attr(rotary, "rotary_embedding_dim", 0) not in (0, dim)
                                              or len(rotary.input) != 3)):
        out = g.fresh("rows")
        g.add("Reshape", [x4, g.constant(np.array([b, 1, heads * dim], np.int64), "rows_shape")], [out])
        return out
    if rotary is None:
        return x3
    out = g.fresh("rotary")
    g.add("RotaryEmbedding", [x3, rotary.input[1], rotary.input[2]], [out], interleaved=0, num_heads=heads)
    if keep_4d and g.users(x4):
        g.remove(rotary)
        g.add("Reshape", [out, g.constant(np.array([b, heads, 1, dim], np.int64), "heads_shape")], [x4])
    return out


def _unheaded(g, x4, b, heads, dim):
    """``x3`` where ``x4 = Transpose(Reshape(x3, [B, 1, heads, D]), [0, 2, 1, 3])``, else None."""
    t = g.op(x4, "Transpose")
    r = g.op(t.input[0], "Reshape") if t is not None else None
    if r is None or list(attr(t, "perm", [])) != [0, 2, 1, 3]:
        return None
    if target(g, r) != [b, 1, heads, dim] or g.shapes.get(r.input[0]) != [b, 1, heads * dim]:
        return None
    return r.input[0]


def _write_back(g, out4, out3, shape):
    """Give ``out4`` (``[B, H, 1, D]``) its value from the ``[B, 1, H * D]`` result: where it
    only goes on to ``Transpose([0, 2, 1, 3]) -> Reshape``, that reshape reads the result."""
    users = g.users(out4)
    if len(users) == 1 and users[0].op_type == "Transpose" and list(attr(users[0], "perm", [])) == [0, 2, 1, 3]:
        after = g.users(users[0].output[0])
        if len(after) == 1 and after[0].op_type == "Reshape" and users[0].output[0] not in g.outputs:
            g.remove(users[0], after[0])
            g.add("Reshape", [out3, after[0].input[1]], [after[0].output[0]])
            return
    g.add("Reshape", [out3, g.constant(np.array(shape, np.int64), "heads_shape")], [out4])
