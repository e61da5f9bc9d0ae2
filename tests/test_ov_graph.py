"""kiln.engines.ov_graph: OpenVINO's copy of a partition with grouped-query attention
gets torch's decomposition of each SDPA node in its place, every other node kept, and the
same answers. (The OpenVINO build of such a graph against eager:
tests/test_llm_decoder.py::test_every_engine_builds_a_prefill_step_that_holds_beyond_its_example.)"""
import collections

import pytest
import torch

pytest.importorskip("openvino")
pytest.importorskip("transformers")

from kiln.engines import ov_graph  # noqa: E402
from kiln.graph.capture import capture  # noqa: E402


def test_grouped_query_attention_is_decomposed_node_by_node():
    from kiln.llm import decoder
    from tests.test_llm_decoder import _model
    step = decoder.DecoderStep(_model("llama"), with_cache=False, last_only=True).eval()   # 4 heads, 2 for k/v
    example = (torch.tensor([[3, 1, 4, 0, 9, 8]]), torch.arange(6).unsqueeze(0), torch.tensor([5]))
    graph = capture(step, example).graph_module
    sdpa = [n for n in graph.graph.nodes if ov_graph.is_sdpa(n)]
    assert len(sdpa) == 2 and all(ov_graph.repeated_heads(n) for n in sdpa)

    converted = ov_graph.prepared(graph)
    aten = torch.ops.aten

    def ops(gm):
        return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")
    before, after = ops(graph), ops(converted)
    assert after[aten.scaled_dot_product_attention.default] == 0
    assert after[aten.reshape.default] == 0                         # spelled view for the frontend
    for op, count in before.items():                                # every other node kept
        if op not in (aten.scaled_dot_product_attention.default, aten.reshape.default, aten.view.default):
            assert after[op] >= count, op
    assert graph.graph is not converted.graph and ops(graph) == before     # the partition itself unchanged
    tokens = (torch.tensor([[7, 7, 2, 5, 1, 3]]), torch.arange(6).unsqueeze(0), torch.tensor([4]))
    with torch.no_grad():
        for got, want in zip(converted(*tokens), graph(*tokens)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
