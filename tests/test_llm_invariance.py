"""Batch invariance (kiln.runtime.invariance): a request's tokens never depend on what else
is in its batch, even when a decode graph computes a row differently for another batch."""
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from kiln.llm.build import compile_llm  # noqa: E402
from kiln.runtime.llm import LLM  # noqa: E402
from tests.test_llm_decoder import _model  # noqa: E402

PROMPTS = [[5, 17, 3, 88], [11, 2], [60, 61, 62], [9, 9, 9, 9, 9]]
BIASED = 7          # the token a batch-dependent graph favours


class BatchDependent:
    """A decode graph whose rows depend on the batch: ``by_rows`` ids get a large bonus
    when the graph runs more than one row (as a kernel with a one-row special case
    would differ, only louder); ``by_company``: a row's bonus grows with the number of
    other running rows (no graph size gives a row its solo answer)."""

    def __init__(self, step, rows, by_company=False):
        self.step, self.rows, self.by_company = step, rows, by_company

    def __call__(self, tokens, positions, *cache):
        logits, k, v = self.step(tokens, positions, *cache)
        logits = logits.clone()
        running = int(cache[-1].any(1).sum())
        if self.by_company:
            logits[..., BIASED] += 100.0 * (running - 1)
        elif self.rows > 1:
            logits[..., BIASED] += 100.0
        return logits, k, v


def _llm_with(tiny_llm, **kind):
    _, llm, _ = tiny_llm
    decode = {rows: BatchDependent(step, rows, **kind) for rows, step in llm.decode.items()}
    return LLM(llm.prefill, decode, llm.meta, {}, manifest=llm.manifest)


def _together_and_alone(llm, n=8):
    together = llm.generate(PROMPTS, n, stop_at_eos=False)
    alone = [llm.generate([p], n, stop_at_eos=False)[0] for p in PROMPTS]
    return together, alone


def test_a_graph_that_computes_one_row_differently_is_not_used(tiny_llm):
    """Fails without the check: alone a request ran the 1-row graph, batched the 3-row one."""
    llm = _llm_with(tiny_llm)
    with pytest.warns(RuntimeWarning, match=r"decode graphs for \[1\] rows compute a row differently"):
        together, alone = _together_and_alone(llm)
    assert together == alone
    assert any(BIASED in t for t in together)              # the 3-row graph really ran for both
    report = llm.batch_invariance
    assert report["decode_rows"] == [3] and report["dropped"] == [1] and not report["invariant"]
    assert not report["row_by_row"]


def test_rows_that_depend_on_their_company_run_one_at_a_time(tiny_llm):
    llm = _llm_with(tiny_llm, by_company=True)
    with pytest.warns(RuntimeWarning, match="decode runs one row at a time"):
        together, alone = _together_and_alone(llm)
    assert together == alone
    assert not any(BIASED in t for t in together)          # each row ran with no company
    assert llm.batch_invariance["row_by_row"]


def test_invariant_graphs_are_all_kept_and_checked_once(tiny_llm):
    _, llm, _ = tiny_llm
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        report = llm.batch_invariance
    assert report == {**report, "invariant": True, "decode_rows": [1, 3], "dropped": [], "row_by_row": False}
    assert report["probe_calls"] == 2 + 3                  # each graph once, each row alone once
    assert llm.batch_invariance is report                  # checked once per loaded model


def _rows_match_alone(llm):
    """Each decode graph the scheduler may run gives each row, bit for bit, what the graph a
    lone request runs gives it (the graphs' logits, and the keys they write)."""
    sched = llm.scheduler()
    graphs = sched.graphs[sched.cache.capacity][0]
    layers, batch, heads, window, dim = llm.meta["cache_shape"]
    g = torch.Generator().manual_seed(3)
    cache = [torch.randn(batch, heads, window, dim, generator=g) for _ in range(2 * layers)]
    lengths = torch.tensor([5, 1, 9, 3, 12, 7, 2, 10][:batch])
    cache.append(torch.arange(window).unsqueeze(0) < lengths.unsqueeze(1))
    tokens, positions = torch.arange(10, 10 + batch).unsqueeze(1), lengths.unsqueeze(1)
    smallest = min(graphs)
    with torch.no_grad():
        for rows, step in graphs.items():
            logits, k, _ = step(tokens[:rows], positions[:rows], *(c[:rows] for c in cache))
            for r in range(rows):
                pad = lambda t: torch.cat([t[r:r + 1], torch.zeros_like(t[:smallest - 1])])  # noqa: E731
                one, k1, _ = graphs[smallest](pad(tokens), pad(positions), *(pad(c) for c in cache))
                if not (torch.equal(logits[r], one[0]) and torch.equal(k[:, r], k1[:, 0])):
                    return False
    return True


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_decode_rows_do_not_depend_on_the_batch(mode):
    """The real engines' graphs: on a machine where ONNX Runtime's kernel for one row
    differs from its kernel for several (int8 with 128-wide blocks on AVX-512 VNNI; AVX2 has a one-row kernel of its own), the
    scheduler must not mix them."""
    llm = compile_llm(_model("llama"), quantize=mode, batch_size=4, context_buckets=(8,), cache_length=32,
                      optlevel=1, min_agreement=0.0, max_ppl_ratio=100.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert _rows_match_alone(llm), llm.batch_invariance
        together, alone = _together_and_alone(llm, 12)
    assert together == alone


def test_where_the_one_row_graph_is_dropped_a_two_row_graph_is_compiled_for_lone_streams(monkeypatch, tmp_path):
    """Where the compiling machine's kernels compute one row differently from several (ONNX
    Runtime's 4-bit product on an AVX2 EPYC; here the 1-row graph is made to differ), a lone
    stream ran the batch_size-row graph (SmolLM2 int4 18 tok/s instead of 34 through a
    2-row graph). compile_llm now adds a 2-row decode graph (and its window graphs), which
    the scheduler runs for a lone stream; answers stay each request's own, and the graph
    travels in the artifact."""
    from kiln.runtime import invariance
    probe = invariance.probe

    def one_row_differs(steps, *args, **kwargs):
        steps = dict(steps)
        if 1 in steps:
            steps[1] = BatchDependent(steps[1], 2)            # the bonus as if it ran several rows
        return probe(steps, *args, **kwargs)
    monkeypatch.setattr(invariance, "probe", one_row_differs)
    model = _model("llama")
    built = []
    llm = compile_llm(model, batch_size=4, context_buckets=(8,), cache_length=32, sequence_buckets=(16,),
                      optlevel=1, cache=False, on_graph=lambda name, *_: built.append(name))
    assert built == ["prefill 8", "decode 1x32", "decode 4x32", "decode 1x16", "decode 4x16",
                     "decode 2x32", "decode 2x16"]
    report = llm.batch_invariance
    assert report["decode_rows"] == [2, 4] and report["dropped"] == [1], report
    assert llm.meta["decode_batches"] == [1, 2, 4] and set(llm.windows[16]["decode"]) == {1, 2, 4}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        together, alone = _together_and_alone(llm)
    assert together == alone
    ids = torch.tensor([PROMPTS[0]])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          min_new_tokens=8, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert alone[0] == want
    import kiln
    again = kiln.load(llm.save(tmp_path / "pair.kiln"))
    assert set(again.decode) == {1, 2, 4} and again.batch_invariance["decode_rows"] == [2, 4]
