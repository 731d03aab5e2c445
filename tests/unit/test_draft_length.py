"""The adaptive draft length: a request drafts D nodes while its drafts are accepted, backs off
(1, 2, 4, ... 16 rounds without drafting) while they are not, and drafts in full again as soon as
a probe pays; with `adaptive=False` it always drafts D."""

from __future__ import annotations

import itertools

from widebeam.speculative.policy import DraftLength


def drafted_rounds(policy: DraftLength, steps_when_drafting: int, num_rounds: int) -> list[int]:
    """Run `num_rounds` rounds; a drafting round takes `steps_when_drafting` steps, else 1."""
    nodes = []
    for _ in range(num_rounds):
        n = policy.next_num_nodes()
        nodes.append(n)
        policy.record(n, steps_when_drafting if n else 1)
    return nodes


def test_drafts_that_pay_keep_drafting():
    assert drafted_rounds(DraftLength(4), steps_when_drafting=3, num_rounds=50) == [4] * 50


def test_drafts_that_never_pay_back_off_exponentially_to_16_rounds():
    nodes = drafted_rounds(DraftLength(4), steps_when_drafting=1, num_rounds=200)
    probes = [i for i, n in enumerate(nodes) if n]
    gaps = [b - a - 1 for a, b in itertools.pairwise(probes)]
    assert gaps[:2] == [0, 1]  # optimistic start: two full rounds, then the first back-off
    assert gaps[1:6] == [1, 2, 4, 8, 16] and set(gaps[5:]) == {16}
    assert sum(1 for n in nodes if n) < 20  # of 200 rounds


def test_a_probe_that_pays_resumes_full_drafting():
    policy = DraftLength(4)
    drafted_rounds(policy, steps_when_drafting=1, num_rounds=40)  # backed off
    nodes = []
    for _ in range(40):
        n = policy.next_num_nodes()
        nodes.append(n)
        policy.record(n, 5 if n else 1)
    first = nodes.index(4)
    assert nodes[first:] == [4] * (40 - first)


def test_not_adaptive_always_drafts():
    assert drafted_rounds(DraftLength(3, adaptive=False), steps_when_drafting=1, num_rounds=30) == [3] * 30
