"""kiln's cached attention at one new token per row on ONNX Runtime's
``com.microsoft.GroupQueryAttention`` (the ``attention`` rewrite of
:mod:`kiln.engines.ort_decoder`, whose docstring says why and what is proven).

Two spellings are matched, as ORT's optimiser leaves them: score products as
``FusedMatMul`` (level ``all``) or ``MatMul`` of a scaled query and a transposed key, and
the probabilities cut by one ``Split`` or two ``Slice`` nodes. The operator takes the
query, key and value as ``[B, 1, heads * D]``, which at one token is the same memory as
the ``[B, heads, 1, D]`` the step computes, so where the step made them from those
products (reshape and transpose) the products are read directly.

**The one assumption, and where it holds.** The operator attends over the first
``seqlens[b] + 1`` slots of row ``b`` and writes the new key and value at slot
``seqlens[b]``; kiln passes each row's count of valid slots. That equals the step's mask
exactly when a row's valid slots are a prefix, which is how :class:`kiln.runtime.kv.KVCache`
makes every mask (a row's first ``length`` slots); the mask must also come from the
valid-slot input alone (no sliding window), which the match checks. Decode graphs compiled
by kiln are only called so; the compile-time check against eager PyTorch uses such a mask
too. The present outputs are named ``kiln_inplace/<cache input>``: the runner
(:class:`kiln.engines.onnxruntime.OrtRunner`) binds them to the cache inputs' memory, so
ORT writes the step's keys into the runtime's cache (where the runtime writes them again)
instead of copying the window every step: at 8 rows and 256 slots the copy made the step
10 % slower than the unfused one.
"""
from __future__ import annotations

import numpy as np

from kiln.engines.ort_graph import MS, attr, scalar, single_user, target


INPLACE = "kiln_inplace/"   # an output named so is written over the input named by the rest


def fuse(g) -> int:
    """kiln's cached attention at one token per row -> ``GroupQueryAttention`` (module doc)."""
    count, lengths = 0, {}
    for softmax in [n for n in g.nodes if n.op_type == "Softmax"]:
        m = _match_attention(g, softmax)
        if m is None:
            continue
        b, kv_heads, window, dim = m["cache_shape"]
        heads = kv_heads * m["groups"]
        if m["valid"] not in lengths:
            lengths[m["valid"]] = _lengths(g, m["valid"], window)
        q = _rows_of(g, m["q4"], b, heads, dim)
        k = _rows_of(g, m["k4"], b, kv_heads, dim, keep_4d=True)
        v = _rows_of(g, m["v4"], b, kv_heads, dim)
        out = g.fresh("attention")
        presents = [_present(g, m[c], m["cache_shape"]) for c in ("k_cache", "v_cache")]
        g.add("GroupQueryAttention", [q, k, v, m["k_cache"], m["v_cache"], *lengths[m["valid"]]],
              [out, *presents], domain=MS, num_heads=heads, kv_num_heads=kv_heads, scale=m["scale"])
        g.remove(*m["nodes"])
        _write_back(g, m["out4"], out, (b, heads, 1, dim))
        count += 1
    return count


def _lengths(g, valid, window) -> tuple:
    """``(seqlens, total)`` for the operator from the ``[B, W]`` valid-slot mask: each row's
    count of valid slots (the runtime's masks are prefixes), and an empty row (a free slot
    riding along) parked on the last slot, so its write lands where no held prefix is read
    (:meth:`kiln.runtime.kv.KVCache.parked`); a full row (one riding along, its output
    unused) is held to the last slot too, never written past the buffer."""
    as_int, count, empty, seqlens, longest, total = (g.fresh(n) for n in
                                                     ("valid_int", "count", "empty", "seqlens", "longest", "total"))
    g.add("Cast", [valid], [as_int], to=6)                                   # int32
    g.add("ReduceSum", [as_int, g.constant(np.array([1], np.int64), "axis")], [count], keepdims=0)
    g.add("Equal", [count, g.constant(np.array(0, np.int32), "zero")], [empty])
    last = g.constant(np.array(window - 1, np.int32), "last")
    within = g.fresh("within")
    g.add("Min", [count, last], [within])                                    # a full row: never past the buffer
    g.add("Where", [empty, last, within], [seqlens])
    g.add("ReduceMax", [seqlens], [longest], keepdims=0)
    g.add("Add", [longest, g.constant(np.array(1, np.int32), "one")], [total])
    return seqlens, total


def _present(g, cache, shape) -> str:
    """The operator's present output for ``cache``: a graph output the runner binds to the
    cache input's own memory (so the step's keys are written in place, not the window
    copied), when ``cache`` is a graph input; else a value nothing reads."""
    if cache not in g.inputs:
        return g.fresh("present")
    name = INPLACE + cache
    g.add_output(name, shape)
    return name


def _match_attention(g, softmax):
    """The parts of one cached attention (:func:`kiln.llm.decoder.cached_attention`) ending
    in ``softmax``, at one new token, or None."""
    where = g.op(softmax.input[0], "Where")
    if where is None or attr(softmax, "axis") not in (-1, 2):
        return None
    cond, scores_in, fill = where.input       # visible where the mask is true
    cat = g.op(scores_in, "Concat")
    if cat is None or scalar(g, fill) != float("-inf"):
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
    if dim % 8:
        # ORT's CPU kernel refuses other head sizes when it runs ("head_size must be a
        # multiple of 8"), after the build: such a graph keeps the unfused attention
        return None
    q_rows, kn_rows = (target(g, v) for v in (views[0], views[2]))
    if q_rows is None or kn_rows is None or list(kn_rows) != [b * kv_heads, 1, dim] \
            or len(q_rows) != 3 or q_rows[0] != b * kv_heads or q_rows[2] != dim:
        return None
    tail = _value_side(g, softmax, window, b * kv_heads, dim)
    if tail is None or g.shapes.get(tail["v_cache"]) != cache_shape or g.shapes.get(cond) != \
            [b * kv_heads, int(q_rows[1]), window + 1]:
        return None
    valid = _mask_source(g, cond, [b, window])
    if valid is None:
        return None
    nodes = [where, cat, *scores[0]["nodes"], *scores[1]["nodes"], *views, softmax, *tail["nodes"]]
    return dict(cache_shape=cache_shape, groups=int(q_rows[1]), valid=valid,
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


def _mask_source(g, cond, shape):
    """The ``[B, W]`` bool graph input the mask ``cond`` is laid out from by shape ops alone
    (``Unsqueeze``, ``Expand``, ``Reshape``, ``Concat`` with constants: the cache slots a
    row has, and the new token seeing itself), or None. A mask that also depends on the
    positions (a sliding window) or anything else is not a count of valid slots."""
    leaves, stack, seen = set(), [cond], set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        if value in g.inputs:
            leaves.add(value)
            continue
        if value in g.inits:
            continue
        node = g.producer.get(value)
        if node is None or node.op_type not in ("Unsqueeze", "Expand", "Reshape", "Concat", "Identity"):
            return None
        stack.extend(i for i in node.input if i)
    if len(leaves) != 1:
        return None
    (valid,) = leaves
    return valid if g.inputs[valid] == list(shape) and g.input_types.get(valid) == 9 else None   # bool


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
