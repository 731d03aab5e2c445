"""The adaptive draft length: a request drafts D nodes while its drafts pay, backs off (1, 2, 4, ...
16 rounds without drafting, or as long as keeps its probes a small share of its time once their loss
is known) while they do not, and drafts in full again as soon as a probe pays; with `adaptive=False`
it always drafts D."""

from __future__ import annotations

import itertools

from widebeam.speculative.policy import DraftLength, StepShare


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


def timed_rounds(policy: DraftLength, steps_when_drafting: int, draft_round_s: float, plain_round_s: float,
                 num_rounds: int) -> list[int]:
    """Rounds with wall times: a drafting round takes `draft_round_s`, a plain one `plain_round_s`."""
    nodes = []
    for _ in range(num_rounds):
        n = policy.next_num_nodes()
        nodes.append(n)
        policy.record(n, steps_when_drafting if n else 1, draft_round_s if n else plain_round_s)
    return nodes


def test_accepted_drafts_that_cost_more_than_they_save_stop():
    """2 steps per round at 2.5x a plain round's time: 0.8x the tokens per second, so it backs off,
    although the acceptance alone (1 gained step) would keep it drafting."""
    nodes = timed_rounds(DraftLength(4), steps_when_drafting=2, draft_round_s=0.025, plain_round_s=0.010,
                         num_rounds=200)
    assert sum(1 for n in nodes if n) < 20
    assert nodes[:2] == [4, 4] and nodes[2] == 0  # two drafting rounds, then a plain one is measured


def test_accepted_drafts_that_pay_keep_drafting_but_for_the_plain_refresh():
    """2 steps per round at 1.5x a plain round: 1.33x, it keeps drafting; one plain round in 33."""
    nodes = timed_rounds(DraftLength(4), steps_when_drafting=2, draft_round_s=0.015, plain_round_s=0.010,
                         num_rounds=200)
    plain = [i for i, n in enumerate(nodes) if n == 0]
    assert plain[0] == 2 and all(b - a == 33 for a, b in itertools.pairwise(plain))


def test_drafting_comes_back_when_it_pays_again():
    policy = DraftLength(4)
    timed_rounds(policy, steps_when_drafting=1, draft_round_s=0.02, plain_round_s=0.01, num_rounds=60)
    nodes = timed_rounds(policy, steps_when_drafting=4, draft_round_s=0.02, plain_round_s=0.01, num_rounds=80)
    # the averaged acceptance climbs back within two probes (16 rounds apart), then it drafts on
    resumed = next(i for i in range(len(nodes) - 1) if nodes[i] == nodes[i + 1] == 4)
    assert resumed <= 34 and sum(1 for n in nodes[resumed:] if n == 0) <= 2


def test_untimed_rounds_never_probe_a_plain_round():
    """Without times (steps that also ran prompt chunks) only the acceptance floor decides."""
    policy = DraftLength(4)
    nodes = [policy.next_num_nodes() for _ in range(1)]
    for _ in range(40):
        policy.record(4, 3, None)
        nodes.append(policy.next_num_nodes())
    assert set(nodes) == {4}


def test_a_losing_drafter_probes_so_rarely_that_probes_cost_a_few_percent():
    """A draft model as big as the target: every draft is accepted (5 steps a round) but a round costs
    6.3 plain rounds. Its probes lose 1.3 plain rounds each, so they come far apart (speculative/policy.py:
    `_PROBE_COST_SHARE`): over 2,000 steps the policy costs at most a few percent over plain decoding."""
    policy = DraftLength(4)
    plain_s, draft_s, steps, elapsed = 0.040, 0.252, 0, 0.0
    while steps < 2000:
        n = policy.next_num_nodes()
        policy.record(n, 5 if n else 1, draft_s if n else plain_s)
        steps += 5 if n else 1
        elapsed += draft_s if n else plain_s
    assert elapsed <= 1.03 * steps * plain_s  # the 0.97x the speculative benchmark holds it to


def test_in_a_batch_a_request_weighs_its_gain_against_everyones_step():
    """A round gaining a step at 1.35x a plain step's time pays for a request alone in its steps, and
    for six alike drafting together, not for one of six drafting alone: the step slows for all six,
    only one goes faster."""
    def num_drafting(share: StepShare) -> int:
        policy = DraftLength(4)
        nodes = []
        for _ in range(100):
            n = policy.next_num_nodes()
            nodes.append(n)
            policy.record(n, 2 if n else 1, 0.0135 if n else 0.010, share)
        return sum(1 for n in nodes if n)

    assert num_drafting(StepShare(1.0, 1.0)) > 90
    assert num_drafting(StepShare(1 / 6, 1 / 6)) > 90
    assert num_drafting(StepShare(1 / 6, 1.0)) < 20  # probes only


def test_in_a_batch_probes_come_as_much_rarer_as_the_request_is_a_smaller_share():
    """Drafting that gains nothing at 1.35x a plain step: a lone request's probes lose 0.35 of its
    step each; one of six requests in the step loses as much of everyone's step, six times its own
    share of it, so its probes come about six times rarer (each of the six probing so, the batch loses
    what a lone request would)."""
    def num_probes(share: StepShare) -> int:
        policy = DraftLength(4)
        probes = 0
        for _ in range(1200):
            n = policy.next_num_nodes()
            probes += bool(n)
            policy.record(n, 1, 0.0135 if n else 0.010, share)
        return probes

    alone, one_of_six = num_probes(StepShare(1.0, 1.0)), num_probes(StepShare(1 / 6, 1.0))
    assert alone > 40 and one_of_six * 4 < alone, (alone, one_of_six)
