"""benchmarks/llm.py's interleaved rounds: every single-stream row runs again and keeps its
best, taken in the same stretch of minutes as the others'."""
from benchmarks.llm_parts import rounds


def test_every_single_stream_row_runs_each_round_and_keeps_its_best():
    res = {"peers": {"hf-fp32": {"decode_tok_s": 20.0, "ttft_s": 0.2},
                     "llama.cpp": {"decode_tok_s": 100.0, "ttft_s": 0.40},
                     "ort-genai": None,                                   # not installed: no row
                     "llama-server": {"tok_s": 130.0}},
           "kiln": {"int4": {"single": {"decode_tok_s": 90.0, "ttft_s": 0.09, "step_ms": 1e3 / 90},
                             "weights_mb": 112.0}}}
    order = []
    peer_runs = iter([{"decode_tok_s": 110.0, "ttft_s": 0.45}, {"decode_tok_s": 95.0, "ttft_s": 0.38}])
    kiln_runs = iter([{"decode_tok_s": 120.0, "ttft_s": 0.10}, {"decode_tok_s": 80.0, "ttft_s": 0.08}])

    def peer(p):
        order.append(p)
        return next(peer_runs)

    def kiln(v):
        order.append(v)
        return next(kiln_runs)
    rounds.interleave(res, 3, peer, kiln, lambda _msg: None)
    assert order == ["llama.cpp", "int4", "llama.cpp", "int4"]          # interleaved, hf and the server not rerun
    llama, k = res["peers"]["llama.cpp"], res["kiln"]["int4"]
    assert (llama["decode_tok_s"], llama["ttft_s"], llama["decode_tok_s_median"]) == (110.0, 0.38, 100.0)
    assert (k["single"]["decode_tok_s"], k["single"]["ttft_s"]) == (120.0, 0.08)
    assert len(k["single"]["rounds"]) == 3 and abs(k["single"]["step_ms"] - 1e3 / 120) < 1e-9
    assert abs(k["achieved_gbs"] - 0.112 * 120) < 1e-9
    assert res["peers"]["hf-fp32"]["decode_tok_s"] == 20.0 and res["rounds"] == 3


def test_one_round_changes_nothing():
    res = {"peers": {"llama.cpp": {"decode_tok_s": 100.0, "ttft_s": 0.4}}, "kiln": {}}
    rounds.interleave(res, 1, None, None, None)
    assert res == {"peers": {"llama.cpp": {"decode_tok_s": 100.0, "ttft_s": 0.4}}, "kiln": {}}
