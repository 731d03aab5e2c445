"""`widebeam bench --repeats R`: every side runs R times at a point, the order reversed every other
repeat, and each keeps its fastest run (widebeam/bench.py: fastest_runs)."""

from __future__ import annotations

from widebeam.bench import fastest_runs


def test_each_side_keeps_its_fastest_run_and_the_order_alternates():
    calls: list[str] = []
    times = {"widebeam": iter([1.4, 1.1, 1.3]), "transformers": iter([2.0, 2.5, 1.9]),
             "ctranslate2 float32": iter([1.2, 1.25, 1.3])}

    def side(name: str):
        def run() -> dict:
            calls.append(name)
            return {"wall_s": next(times[name]), "best": [len(calls)]}
        return run

    best = fastest_runs({name: side(name) for name in times}, repeats=3, settle_s=0.0)
    assert {name: result["wall_s"] for name, result in best.items()} == {
        "widebeam": 1.1, "transformers": 1.9, "ctranslate2 float32": 1.2}
    assert best["widebeam"]["best"] == [6]  # the result of the fastest run itself, not the last one
    assert best["widebeam"]["runs_s"] == [1.4, 1.1, 1.3]  # every run, in run order
    assert best["transformers"]["runs_s"] == [2.0, 2.5, 1.9]
    order = ["widebeam", "transformers", "ctranslate2 float32"]
    assert calls == order + order[::-1] + order


def test_one_repeat_is_one_run_of_each_in_order():
    calls: list[str] = []
    best = fastest_runs({name: (lambda name=name: calls.append(name) or {"wall_s": 1.0}) for name in "abc"},
                        repeats=1, settle_s=0.0)
    assert calls == ["a", "b", "c"] and set(best) == {"a", "b", "c"}
