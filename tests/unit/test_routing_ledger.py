"""The router's placement decision and its ledger (widebeam/routing/ledger.py) against a scripted set of
replicas: no Ray. Two requests placed between two reports, reports that lag or come out of order, work
the ledger does not size, a replica that dies, and a random trace that never over-commits a pool."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from widebeam.routing.ledger import PlacementLedger, ReplicaReport


def report(capacity: dict, headroom: dict | None = None, at: float = 0.0) -> ReplicaReport:
    return ReplicaReport(capacity, dict(capacity) if headroom is None else headroom, at)


def two_replicas(capacity_a: dict, capacity_b: dict | None = None) -> PlacementLedger:
    ledger = PlacementLedger()
    ledger.set_replicas(["a", "b"])
    ledger.report("a", report(capacity_a))
    ledger.report("b", report(capacity_b or capacity_a))
    return ledger


def test_two_requests_placed_between_two_reports_are_not_counted_against_the_same_blocks():
    ledger = two_replicas({"self": 100})
    first = ledger.choose({"self": 60})
    ledger.place("r1", first, {"self": 60}, now_s=1.0)
    second = ledger.choose({"self": 60})  # no report since: the ledger alone knows `first` holds 60
    assert second is not None and second != first
    ledger.place("r2", second, {"self": 60}, now_s=1.1)
    assert ledger.choose({"self": 60}) is None  # held at the router: 40 left on each
    assert ledger.choose({"self": 40}) in ("a", "b")
    ledger.release("r1")
    assert ledger.choose({"self": 60}) == first


def test_a_report_taken_after_a_placement_is_not_charged_for_it_twice():
    ledger = two_replicas({"self": 100})
    ledger.place("r1", "a", {"self": 60}, now_s=1.0)
    ledger.report("a", report({"self": 100}, {"self": 40}, at=2.0))  # counts r1 already
    assert ledger.headroom_blocks("a") == {"self": 40}
    ledger.report("a", report({"self": 100}, {"self": 100}, at=0.5))  # older: ignored
    assert ledger.headroom_blocks("a") == {"self": 40}


def test_a_request_still_on_its_way_when_the_replica_counted_is_charged_by_the_ledger():
    ledger = two_replicas({"self": 100})
    ledger.place("r1", "a", {"self": 60}, now_s=1.0)
    ledger.report("a", report({"self": 100}, {"self": 100}, at=2.0))  # r1 had not reached its engine
    assert ledger.headroom_blocks("a") == {"self": 40}
    assert ledger.choose({"self": 50}) == "b"


def test_blocks_held_by_work_the_ledger_does_not_size_come_from_the_report():
    ledger = two_replicas({"self": 100})
    ledger.report("a", report({"self": 100}, {"self": 30}, at=1.0))  # e.g. a catalogue search there
    assert ledger.choose({"self": 50}) == "b"
    ledger.place("r1", "b", {"self": 50}, now_s=2.0)
    ledger.place("r2", "a", {"self": 20}, now_s=2.0)  # after a's report: charged against it
    assert ledger.headroom_blocks("a") == {"self": 10}
    assert ledger.choose({"self": 50}) == "b"  # b: 50 left


CASES = [  # (capacity a, capacity b, need, chosen)
    ({"self": 100}, {"self": 50}, {"self": 40}, "a"),  # the most room after placing
    ({"self": 100}, {"self": 50}, {"self": 60}, "a"),  # fits a only
    ({"self": 10}, {"self": 50}, {"self": 40}, "b"),
    ({"self": 100, "cross": 4}, {"self": 50, "cross": 40}, {"self": 10, "cross": 8}, "b"),  # every pool
    ({"self": 100}, {"self": 100}, {"self": 101}, None),
    ({"self": 100}, {"self": 30}, None, "a"),  # unsized: the most room
]


def test_choice_table():
    for capacity_a, capacity_b, need, chosen in CASES:
        assert two_replicas(capacity_a, capacity_b).choose(need) == chosen, (capacity_a, capacity_b, need)


def test_a_dead_replica_drops_its_placements_and_gets_nothing_new():
    ledger = two_replicas({"self": 100})
    ledger.place("r1", "a", {"self": 10}, now_s=1.0)
    ledger.place("r2", "b", {"self": 10}, now_s=1.0)
    assert ledger.remove_replica("a") == ["r1"]
    assert {ledger.choose({"self": 10}) for _ in range(3)} == {"b"}
    assert ledger.release("r1") is None  # its finish comes after: nothing to release
    ledger.set_replicas(["b", "c"])  # Serve restarted it under a new id
    ledger.report("c", report({"self": 100}))
    assert ledger.choose({"self": 95}) == "c"  # b holds r2's 10
    assert ledger.set_replicas(["c"]) == ["r2"] and ledger.choose({"self": 1}) == "c"


def test_held_requests_are_counted_until_placed():
    ledger = two_replicas({"self": 10})
    ledger.hold("h1")
    ledger.hold("h2")
    assert ledger.num_held == 2
    ledger.place("r1", "a", {"self": 1}, held_id="h1")
    ledger.unhold("h2")
    assert ledger.num_held == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["place", "release", "report"]),
                          st.integers(1, 64), st.integers(0, 1000)), max_size=60))
def test_placements_through_choose_never_over_commit_a_pool(trace):
    """Whatever the order of placements, finishes and (lagging) reports, the needs placed on a replica
    and not finished never pass its capacity: each could hold all its blocks at once."""
    capacity = {"a": 100, "b": 64}
    ledger = PlacementLedger()
    ledger.set_replicas(capacity)
    for name, blocks in capacity.items():
        ledger.report(name, report({"self": blocks}))
    open_ids, clock = [], 1.0
    for k, (op, blocks, pick) in enumerate(trace):
        clock += 0.1
        if op == "place":
            where = ledger.choose({"self": blocks})
            if where is not None:
                ledger.place(f"r{k}", where, {"self": blocks}, now_s=clock)
                open_ids.append(f"r{k}")
        elif op == "release" and open_ids:
            ledger.release(open_ids.pop(pick % len(open_ids)), now_s=clock)
        elif op == "report":  # a lagging report that already counts some of the placements
            name = "ab"[pick % 2]
            held = sum(p.need["self"] for p in ledger.placements.values()
                       if p.replica_id == name and p.placed_at_s <= clock - 0.25)
            ledger.report(name, report({"self": capacity[name]}, {"self": capacity[name] - held},
                                       at=clock - 0.25))
        for name, blocks in capacity.items():
            placed = sum(p.need["self"] for p in ledger.placements.values() if p.replica_id == name)
            assert placed <= blocks
            room = ledger.headroom_blocks(name)["self"]
            assert room <= blocks - placed
            if op == "report" and name == "ab"[pick % 2]:
                assert room == blocks - placed  # a fresh report: the count is tight


def test_a_call_of_many_requests_books_at_most_the_largest_pool():
    ledger = two_replicas({"self": 100, "cross": 10}, {"self": 60, "cross": 40})
    assert ledger.clip_to_capacity({"self": 150, "cross": 5}) == {"self": 100, "cross": 5}
    assert ledger.choose(ledger.clip_to_capacity({"self": 150})) == "a"


def test_a_replica_that_has_not_reported_is_counted_with_the_shared_pools():
    ledger = PlacementLedger()
    ledger.set_replicas(["a", "b"])
    ledger.report("a", report({"self": 100}))
    assert ledger.choose({"self": 10}) == "a"  # b unknown: not placed on
    ledger.default_capacity_blocks = {"self": 100}
    ledger.place("r1", "a", {"self": 10}, now_s=1.0)
    assert ledger.choose({"self": 10}) == "b"
    ledger.place("r2", "b", {"self": 95}, now_s=1.0)
    assert ledger.headroom_blocks("b") == {"self": 5}  # the ledger alone counts it
    assert ledger.choose({"self": 6}) == "a"


def test_a_finish_after_the_report_gives_its_blocks_back_at_once():
    ledger = two_replicas({"self": 100})
    ledger.place("r1", "a", {"self": 60}, now_s=1.0)
    ledger.report("a", report({"self": 100}, {"self": 40}, at=2.0))  # counts r1
    ledger.release("r1", now_s=3.0)  # before a's next report
    assert ledger.headroom_blocks("a") == {"self": 100}
    ledger.report("a", report({"self": 100}, {"self": 100}, at=4.0))
    ledger.report("b", report({"self": 100}, {"self": 100}, at=4.0))
    assert ledger.released == [] and ledger.headroom_blocks("a") == {"self": 100}


def test_the_starvation_guard_lets_an_old_held_request_be_overtaken_only_so_often():
    from widebeam.sched.scheduler import MAX_OVERTAKES

    ledger = two_replicas({"self": 100})
    ledger.hold("wide")  # waits for room
    for k in range(MAX_OVERTAKES):
        ledger.hold(f"small{k}")
        assert ledger.may_place(f"small{k}")
        ledger.place(f"small{k}", "a", {"self": 1}, held_id=f"small{k}")
    assert ledger.held == {"wide": MAX_OVERTAKES}
    ledger.hold("late")
    assert not ledger.may_place("late") and ledger.may_place("wide")
    ledger.place("wide", "b", {"self": 90}, held_id="wide")
    assert ledger.may_place("late")
