"""kiln.engines.ort_merge: weight products sharing an activation, joined into one before
weight-only quantization (a Llama layer's query/key/value and gate/up). The join must be
exact: the same bits out of ONNX Runtime as the products quantized one by one, at one row
(a decode step) and at several."""
import copy

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kiln.engines import ort_int4, ort_merge
from tests.test_ort_int4 import q4_1_weight


def three_products():
    """``x`` times three Q4_1 weights (the first two share ``x``, as query and key do) and a
    product of another input that has no partner."""
    ws = {"wq": q4_1_weight(64, 48, 0), "wk": q4_1_weight(64, 16, 1), "wo": q4_1_weight(64, 32, 2)}
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
             helper.make_node("MatMul", ["y", "wo"], ["o"], name="o")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["r", 64]) for n in "xy"],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "qko"],
        [numpy_helper.from_array(w, n) for n, w in ws.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def run(model, feed):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return session.run(["q", "k", "o"], feed)


def test_products_sharing_an_input_become_one_with_the_same_bits():
    plain = three_products()
    merged = copy.deepcopy(plain)
    names = ort_merge.merge(merged, ["q", "k", "o"])
    assert sorted(names) == ["o", "q/kiln_merged"]
    assert [n.op_type for n in merged.graph.node] == ["MatMul", "Split", "MatMul"]
    assert not {"wq", "wk"} & {i.name for i in merged.graph.initializer}
    for rows in (1, 5):                          # a decode step's one row, and several
        rng = np.random.default_rng(rows)
        feed = {n: rng.standard_normal((rows, 64)).astype(np.float32) for n in "xy"}
        for a, b in zip(run(plain, feed), run(merged, feed)):
            np.testing.assert_array_equal(a, b)
        # quantized as int4 (Q4_1 blocks on MatMulNBits, int8 activations): still the same bits
        qa, qb = copy.deepcopy(plain), copy.deepcopy(merged)
        assert ort_int4.apply(qa, ["q", "k", "o"], 4) == []
        assert ort_int4.apply(qb, names, 4) == []
        assert sum(n.op_type == "MatMulNBits" for n in qb.graph.node) == 2
        for a, b in zip(run(qa, feed), run(qb, feed)):
            np.testing.assert_array_equal(a, b)


def test_nothing_to_merge_leaves_the_graph_alone():
    model = three_products()
    before = model.SerializeToString()
    assert ort_merge.merge(model, ["q", "o"]) == ["q", "o"]      # k not wanted: q has no partner
    assert model.SerializeToString() == before
