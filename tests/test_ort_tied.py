"""A token embedding read from the output projection's 8-bit blocks (kiln.engines.ort_tied):
only where the blocks hold the float matrix bit for bit, and then with the same answers."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from kiln.engines import ort_tied  # noqa: E402

ROWS, WIDTH, BLOCK = 96, 64, 32


def _model(table, q, scales):
    """ids -> Gather(table); x -> MatMulNBits(q, scales): an embedding and a tied output
    projection, as a quantized Llama step holds them."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0),
             helper.make_node("MatMulNBits", ["x", "q", "scales"], ["logits"], domain="com.microsoft",
                              K=WIDTH, N=ROWS, bits=8, block_size=BLOCK, accuracy_level=4)]
    graph = helper.make_graph(
        nodes, "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 5]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, [1, 5, WIDTH]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, ROWS])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(q, "q"),
         numpy_helper.from_array(scales, "scales")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _blocks(seed):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, (ROWS, WIDTH // BLOCK, BLOCK), dtype=np.uint8)
    scales = (rng.random((ROWS, WIDTH // BLOCK), dtype=np.float32) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    table = ((q.astype(np.float32) - 128.0) * scales[..., None]).reshape(ROWS, WIDTH)
    return table, q, scales


def _run(model, ids, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"ids": ids, "x": x})


@pytest.mark.parametrize("flat", [False, True], ids=["scales-2d", "scales-flat"])
def test_the_gather_reads_the_blocks_and_answers_the_same_to_the_bit(flat):
    table, q, scales = _blocks(0)
    model = _model(table, q, scales.reshape(-1) if flat else scales)
    ids = np.array([[0, 95, 7, 7, 40]], np.int64)
    x = np.random.default_rng(1).standard_normal((1, WIDTH)).astype(np.float32)
    before = _run(model, ids, x)
    assert ort_tied.share_embedding(model) == 1
    assert [n.op_type for n in model.graph.node] == ["GatherBlockQuantized", "MatMulNBits"]
    names = {i.name for i in model.graph.initializer}
    assert "table" not in names                                           # the float matrix is gone
    assert (model.graph.node[0].input[2] == "scales") is not flat         # 2-D scales are shared
    after = _run(model, ids, x)
    for b, a in zip(before, after):
        assert np.array_equal(b.view(np.uint32), a.view(np.uint32))


def test_blocks_that_only_approximate_the_matrix_leave_the_gather_alone():
    table, q, scales = _blocks(2)
    nudged = table.copy()
    nudged[3, 5] = np.nextafter(nudged[3, 5], np.float32(np.inf))     # one element one ulp off
    model = _model(nudged, q, scales)
    assert ort_tied.share_embedding(model) == 0
    assert [n.op_type for n in model.graph.node] == ["Gather", "MatMulNBits"]
    wider = _blocks(3)[0][:, :WIDTH // 2].copy()                          # another shape
    assert ort_tied.share_embedding(_model(wider, q, scales)) == 0


def test_q8_0_gives_back_a_q8_0_files_blocks_where_onnx_runtimes_grid_does_not():
    from kiln.engines import ort_blocks
    rng = np.random.default_rng(5)
    k = rng.integers(-127, 128, (40, 3, 32))
    k[:, :, 7] = -127                                      # every block reaches its scale's end
    d = rng.uniform(1e-3, 5e-2, (40, 3, 1)).astype(np.float16).astype(np.float32)
    weight = (k * d).astype(np.float32).reshape(40, 96).T  # [K, N], as the exported graph holds it
    kept = ort_blocks.q8_0(weight)
    assert np.array_equal(kept.dequantized().view(np.uint32), weight.view(np.uint32))
    ort_grid = np.abs(weight.T.reshape(40, 3, 32)).max(-1, keepdims=True) / 128   # max|w| / 128
    requantized = np.rint(weight.T.reshape(40, 3, 32) / ort_grid) * ort_grid
    assert not np.array_equal(requantized.reshape(40, 96), weight.T)
