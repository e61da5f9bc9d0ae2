"""Next-token choice (kiln.runtime.sampling) against Hugging Face's logits processors, and
stop tokens and seeded sampling through the generation loop."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.errors import InputError  # noqa: E402
from kiln.llm import decoder  # noqa: E402
from kiln.runtime import sampling, scheduler  # noqa: E402
from tests.test_llm_decoder import PROMPTS, _model  # noqa: E402


def _hf_scores(logits, history, p):
    from transformers import generation as g
    procs = g.LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        procs.append(g.RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.do_sample:
        procs.append(g.TemperatureLogitsWarper(p.temperature))
        if p.top_k:
            procs.append(g.TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            procs.append(g.TopPLogitsWarper(p.top_p))
    return procs(history, logits.clone())


@pytest.mark.parametrize("params", [
    sampling.SamplingParams(),
    sampling.SamplingParams(repetition_penalty=1.3),
    sampling.SamplingParams(do_sample=True, temperature=0.7),
    sampling.SamplingParams(do_sample=True, top_k=5),
    sampling.SamplingParams(do_sample=True, top_p=0.8),
    sampling.SamplingParams(do_sample=True, temperature=1.3, top_k=20, top_p=0.9, repetition_penalty=1.2),
])
def test_scores_equal_hugging_face_processors(params):
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    history = torch.randint(0, 50, (4, 7))
    got = sampling.process(logits, params, history)
    want = _hf_scores(logits, history, params)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-5, rtol=1e-5)


def test_bad_parameters_are_clear_errors():
    """Values and types. Before: ``top_k=2.5`` was accepted and its first draw a TypeError
    in topk, ``seed=1.5`` cut to 1, ``seed=2**64`` an OverflowError at the first request,
    ``temperature="0.7"`` a TypeError comparing a str."""
    import numpy as np
    for kw, msg in [({"temperature": 0}, "temperature"), ({"top_k": -1}, "top_k"),
                    ({"top_p": 0}, "top_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                    ({"do_sample": True, "top_k": 2.5}, "top_k must be an integer"),
                    ({"top_k": True}, "top_k must be an integer"),
                    ({"seed": 1.5}, "seed must be an integer"), ({"seed": 2 ** 64}, "seed must be an integer"),
                    ({"seed": "1"}, "seed must be an integer"), ({"temperature": "0.7"}, "temperature must be a number"),
                    ({"top_p": None}, "top_p must be a number")]:
        with pytest.raises(InputError, match=msg):
            sampling.SamplingParams(**kw)
    # NumPy's integers are integers (as ints), and the widest seeds a torch.Generator takes still run
    p = sampling.SamplingParams(do_sample=True, top_k=np.int64(3), seed=np.int64(5))
    assert type(p.top_k) is int and type(p.seed) is int and p.top_k == 3 and p.seed == 5
    for seed in (2 ** 64 - 1, -2 ** 63):
        assert sampling.SamplingParams(seed=seed).generator() is not None


@pytest.mark.parametrize("extra", [{}, {"top_k": 5}, {"top_p": 0.5}, {"top_k": 5, "top_p": 0.5}])
def test_a_tiny_temperature_draws_the_most_likely_token(extra):
    """``logits / temperature`` overflowed to inf for ``temperature=1e-45``, the softmax was
    NaN, and the draw inverted a NaN CDF: the last id of the vocabulary (96 of 97), every
    time. The limit of a vanishing temperature is the most likely token; a merely small
    one that does not overflow (``0.01``) keeps transformers' arithmetic."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 97, generator=gen) * 3
    logits[3] -= 50                                           # all negative: every score overflows to -inf
    for temperature in (1e-45, 1e-38, 1e-30, 1e-46, 1e-300):     # the last two are 0 in float32 (12-03: NaN)
        params = sampling.SamplingParams(do_sample=True, temperature=temperature, seed=1, **extra)
        for _ in range(3):
            assert torch.equal(sampling.choose(logits, params, generator=params.generator()), logits.argmax(-1))
        index, probs = sampling.distribution(logits[:1], params)
        assert torch.isfinite(probs).all() and float(probs.max()) == 1.0
    small = sampling.SamplingParams(do_sample=True, temperature=0.01, **extra)
    index, probs = sampling.distribution(logits[:1], small)
    want = _hf_scores(logits[:1], None, small).softmax(-1)[0]
    torch.testing.assert_close(torch.zeros(97).index_put_((index,), probs), want)


def test_logits_with_no_distribution_are_an_error_not_the_last_token():
    """NaN logits (or all -inf) leave no distribution to draw from: an error, as transformers'
    torch.multinomial raises, where the search of a NaN CDF answered the last id."""
    from kiln.errors import KilnError
    params = sampling.SamplingParams(do_sample=True, seed=0)
    for bad in (torch.full((1, 97), float("nan")), torch.full((1, 97), float("-inf"))):
        with pytest.raises(KilnError, match="no token can be drawn"):
            sampling.choose(bad, params, generator=params.generator())


@pytest.fixture(scope="module")
def steps():
    model = _model("llama")
    return (model, decoder.DecoderStep(model, with_cache=False, last_only=True).eval(),
            decoder.DecoderStep(model, with_cache=True, last_only=False).eval(),
            decoder.cache_shape(model.config, len(PROMPTS), 40))


def test_stop_token_ends_each_row_as_hugging_face_does(steps):
    model, prefill, step, shape = steps
    eos = 2
    got = scheduler.generate(prefill, step, PROMPTS, 12, shape, eos_token_ids=[eos])
    for prompt, tokens in zip(PROMPTS, got):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 eos_token_id=eos, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == ref, prompt
    assert any(t[-1] == eos and len(t) < 12 for t in got)        # the case is exercised


def test_seeded_sampling_repeats_and_top_k_1_is_greedy(steps):
    _, prefill, step, shape = steps
    params = sampling.SamplingParams(do_sample=True, temperature=1.5, top_p=0.95, seed=7)
    first = scheduler.generate(prefill, step, PROMPTS, 10, shape, params=params)
    assert scheduler.generate(prefill, step, PROMPTS, 10, shape, params=params) == first
    other = scheduler.generate(prefill, step, PROMPTS, 10, shape, params=sampling.SamplingParams(
        do_sample=True, temperature=1.5, top_p=0.95, seed=8))
    assert other != first
    top1 = sampling.SamplingParams(do_sample=True, top_k=1, seed=1)
    assert scheduler.generate(prefill, step, PROMPTS, 10, shape, params=top1) == scheduler.greedy(prefill, step, PROMPTS, 10, shape)


@pytest.mark.parametrize("params", [
    sampling.SamplingParams(do_sample=True, temperature=0.7),
    sampling.SamplingParams(do_sample=True, top_k=5),
    sampling.SamplingParams(do_sample=True, top_p=0.8),
    sampling.SamplingParams(do_sample=True, top_p=0.999),                 # needs more than the first candidates
    sampling.SamplingParams(do_sample=True, temperature=1.3, top_k=20, top_p=0.9, repetition_penalty=1.2),
])
@pytest.mark.parametrize("vocab, spread", [(50, 3.0), (5000, 1.0), (5000, 8.0)])
def test_distribution_is_hugging_faces(params, vocab, spread):
    """The candidate-only distribution choose() draws from equals softmax of transformers'
    processed scores: same tokens kept, same probabilities."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen) * spread
    history = torch.randint(0, vocab, (6, 7), generator=gen)
    want = _hf_scores(logits, history, params).softmax(-1)
    for row in range(6):
        index, probs = sampling.distribution(logits[row:row + 1], params, history[row:row + 1])
        got = torch.zeros(vocab).index_put_((index,), probs)
        assert torch.equal(got > 0, want[row] > 0), row
        torch.testing.assert_close(got, want[row], atol=1e-6, rtol=1e-5)
        if params.top_k or params.top_p < 1:
            assert torch.all(probs[:-1] >= probs[1:])                      # candidates, most likely first


def test_top_k_ties_are_kept_as_hugging_face_keeps_them():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    index, probs = sampling.distribution(logits, sampling.SamplingParams(do_sample=True, top_k=2))
    assert sorted(index.tolist()) == [0, 2, 3]
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_draws_follow_the_distribution():
    """20,000 seeded draws: each token's frequency within 4 standard errors of its probability."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -8.0]])
    params = sampling.SamplingParams(do_sample=True, top_p=0.9, seed=3)
    gen = params.generator()
    n = 20000
    counts = torch.bincount(torch.cat([sampling.choose(logits, params, generator=gen) for _ in range(n)]),
                            minlength=6).double()
    want = _hf_scores(logits, None, params).softmax(-1)[0].double()
    assert counts[want == 0].sum() == 0
    err = 4 * (want * (1 - want) / n).sqrt() + 1e-12
    assert torch.all((counts / n - want).abs() <= err), (counts / n, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_greedy_is_torchs_argmax_ties_nan_and_infinities_included(dtype):
    """sampling.greedy reduces CPU logits with NumPy (27x faster than torch.argmax over a
    49,152-token vocabulary) and must pick what torch.argmax picks, everywhere."""
    from kiln.runtime.sampling import greedy
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(6, 97, generator=g),
            torch.randint(-3, 3, (6, 97), generator=g).float(),                  # many ties
            torch.full((2, 97), float("-inf")),                                   # nothing to choose
            torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [float("inf"), 2.0, float("inf"), 0.0]])]
    for x in rows:
        x = x.to(dtype)
        for view in (x, x.t().contiguous().t(), x[:, ::2], x[0], x[:1]):
            got, want = greedy(view), view.argmax(-1)
            assert got.dtype == torch.int64 and torch.equal(got, want), (view, got, want)
