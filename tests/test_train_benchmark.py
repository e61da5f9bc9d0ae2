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
