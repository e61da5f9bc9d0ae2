"""4-bit weights handed to OpenVINO one value per byte (kiln.engines.ov_widen): the same
values, and OpenVINO's answers bit for bit those of the 4-bit product, with float, packed
integer and implied zero points, in f32 and (where the CPU computes it) bf16."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ov = pytest.importorskip("openvino")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from kiln.engines import ov_widen  # noqa: E402
from kiln.host import target  # noqa: E402

RNG = np.random.default_rng(0)


def _product(k, n, zero, shared=False):
    """A model of one 4-bit ``MatMulNBits`` ``[1, 16, k] -> [1, 16, n]`` (two reading the same
    weights, summed, when ``shared``), its 4-bit values and its zero points per block."""
    blocks = k // 32
    values = RNG.integers(0, 16, size=(n, blocks, 32), dtype=np.uint8)
    scales = (RNG.random((n, blocks), dtype=np.float32) * 0.01 + 0.001).reshape(-1)
    packed = values[..., 0::2] | (values[..., 1::2] << 4)
    inits = [numpy_helper.from_array(packed, "q"), numpy_helper.from_array(scales, "s")]
    inputs = ["x", "q", "s"]
    points = np.full((n, blocks), 8.0, np.float32)
    if zero == "float":
        points = (8 - RNG.standard_normal((n, blocks))).astype(np.float32)
        inits.append(numpy_helper.from_array(points.reshape(-1), "z"))
        inputs.append("z")
    elif zero == "uint8":
        ints = RNG.integers(0, 16, size=(n, blocks), dtype=np.uint8)
        padded = np.concatenate([ints, np.zeros((n, blocks % 2), np.uint8)], 1)
        inits.append(numpy_helper.from_array((padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(-1), "z"))
        inputs.append("z")
        points = ints.astype(np.float32)
    attrs = dict(K=k, N=n, bits=4, block_size=32, accuracy_level=4)
    nodes = [helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", **attrs)]
    if shared:
        nodes = [helper.make_node("MatMulNBits", inputs, ["a"], name="a", domain="com.microsoft", **attrs),
                 helper.make_node("MatMulNBits", inputs, ["b"], name="b", domain="com.microsoft", **attrs),
                 helper.make_node("Add", ["a", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return model, values, points, scales.reshape(n, blocks)


def _run(model, x, precision):
    core = ov.Core()
    config = {"INFERENCE_PRECISION_HINT": precision, "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32",
              "INFERENCE_NUM_THREADS": "1"}
    return core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU", config)([x])[0]


PRECISIONS = ["f32"] + (["bf16"] if target.native("bf16") else [])


@pytest.mark.parametrize("zero", ["float", "uint8", "none"])
@pytest.mark.parametrize("k", [96, 576])           # 3 blocks a row (packed zero points padded) and 18
def test_widened_products_hold_the_same_values_and_answer_bit_for_bit(zero, k):
    model, values, points, scales = _product(k, 64, zero)
    if zero == "uint8" and k == 96:     # packed zero points, a padded byte a row: left 4-bit
        assert ov_widen.widen(model) == 0           # (OpenVINO computed it in float, 8-bit not)
        return
    x = RNG.standard_normal((1, 16, k)).astype(np.float32)
    before = {p: _run(model, x, p) for p in PRECISIONS}
    assert ov_widen.widen(model) == 1
    node = model.graph.node[0]
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["bits"] == 8
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert np.array_equal(inits[node.input[1]], values)
    got = inits[node.input[3]].astype(np.float32).reshape(points.shape)
    assert np.array_equal(got, points)
    if zero != "float":
        assert inits[node.input[3]].dtype == np.uint8
    weights = (scales[..., None] * (values - points[..., None])).reshape(64, k).astype(np.float64)
    exact = x.astype(np.float64) @ weights.T
    for p in PRECISIONS:
        after = _run(model, x, p)
        assert np.array_equal(after, before[p]), p
        assert np.abs(after - exact).max() <= (1e-5 if p == "f32" and zero == "float" else 2e-2) * np.abs(exact).max()


def test_a_weight_two_products_read_is_widened_once():
    model, values, _, _ = _product(576, 32, "float", shared=True)
    x = RNG.standard_normal((1, 16, 576)).astype(np.float32)
    before = _run(model, x, "f32")
    assert ov_widen.widen(model) == 2
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert np.array_equal(inits["q"], values)
    assert np.array_equal(_run(model, x, "f32"), before)


def test_products_of_other_widths_are_left_alone():
    model, _, _, _ = _product(576, 32, "float")
    for a in model.graph.node[0].attribute:
        if a.name == "bits":
            a.i = 8
    assert ov_widen.widen(model) == 0
