"""benchmarks/train.py's step bookkeeping: the i-th loss of every runner is step i, so its
"loss diff" column compares the same batch, model state and dropout draws."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_timed_steps_go_on_from_where_the_warm_up_stopped():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import train
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    seen = []

    def step(i):
        seen.append(i)
        return float(i)
    # kiln_device: the warm-up also waits for background compiles, stepping until two steps
    # find nothing compiling (none here), before the timed steps
    res = train._timed(step, warmup=3, steps=4, compiles=lambda: 0, kiln_device=True)
    assert seen == list(range(len(seen))) and len(seen) >= 3 + 4 + 2
    assert res["losses"] == [float(i) for i in seen]
    plain = train._timed(lambda i: float(i), warmup=3, steps=4, compiles=lambda: 0)
    assert plain["losses"] == [float(i) for i in range(7)]


def test_rounds_report_the_median_round_and_ratios_paired_round_by_round():
    """``--rounds``: each runner's reported round is its median one, its first-step time the
    first round's (later rounds find the compile cache warm), and its ratio to eager is taken
    within each round, so a machine that slows between rounds does not move it."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import train
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))

    def res(sps, first):
        return {"steps_per_s": sps, "median_step_ms": 1e3 / sps, "best_step_ms": 1e3 / sps,
                "losses": [1.0], "first_step_s": first, "warmup_s": first}
    # the machine halves its speed in round 2: kiln is 1.2x eager in every round
    rounds = [{"m/fp32/eager": res(10.0, 0.1), "m/fp32/kiln-lazy": res(12.0, 30.0)},
              {"m/fp32/eager": res(5.0, 0.1), "m/fp32/kiln-lazy": res(6.0, 2.0)},
              {"m/fp32/eager": res(9.0, 0.1), "m/fp32/kiln-lazy": res(10.8, 2.0)}]
    merged = train.merge_rounds(rounds)
    lazy = merged["m/fp32/kiln-lazy"]
    assert lazy["steps_per_s"] == 10.8 and lazy["steps_per_s_by_round"] == [12.0, 6.0, 10.8]
    assert [round(x, 6) for x in lazy["x_eager_by_round"]] == [1.2, 1.2, 1.2]
    assert round(lazy["x_eager_median_of_rounds"], 6) == 1.2 and lazy["first_step_s"] == 30.0
    assert round(lazy["vs_eager"], 6) == 1.2          # 10.8 against eager's median round, 9.0
    assert "1.20" in train.rounds_table(merged)
    assert train.merge_rounds(rounds[:1]) is rounds[0]
