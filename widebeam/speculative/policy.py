"""How many nodes a request drafts next round: only while drafting is faster than not drafting.

Drafted nodes cost whether or not they are accepted (the target scores each one, a draft model runs a
pass per tree level), so each request weighs tokens per second on its own rounds: it drafts while its
drafting rounds' steps per second beat its plain rounds' by `_MARGIN` and gain at least
`MIN_GAINED_STEPS` steps, else it backs off and probes again at a cost-bounded gap (`DraftLength`). In a
batch each side counts as the request's share of the step (`StepShare`); what earlier requests learned
stays with the engine per request shape (`DraftShapes`). Output never depends on this: a round without
drafts is a plain decode step.

The rule's derivation, the probe schedule and the measurements behind the constants:
docs/speculative-decoding.md, "How the draft policy decides".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from widebeam.speculative.tree import branching_for_width, max_tree_depth

# A floor on accepted steps per drafting round (an exponential average): below it the rejected nodes
# cost more than the steps saved (benchmarks/speculative.py, W=4 prompt lookup at 1.27 steps per
# round: 0.58x).
MIN_GAINED_STEPS = 0.5
# Drafting must beat plain decoding by this much: within it, timing noise would flip the choice.
_MARGIN = 0.03
_SMOOTHING = 0.3
_MAX_BACKOFF_ROUNDS = 16  # the doubling back-off's cap, where what a losing round costs is not known
# Where it is known, the probes of a losing drafter may cost this share of the time between them: a
# probe losing L plain rounds' time waits L / _PROBE_COST_SHARE rounds (a bfloat16 copy of the model
# as its own draft, W=1, on this CPU: a round of 6.3 plain rounds' time taking 5 steps, 65 rounds).
_PROBE_COST_SHARE = 0.02
_MAX_PROBE_GAP_ROUNDS = 256  # so a shape whose drafting lost long ago still comes back
_PROBE_PLAIN_AFTER = 2  # drafting rounds before the first plain round is measured
_REFRESH_PLAIN_EVERY = 32  # drafting rounds between plain measurements (the context grows)
# Where a request of a losing shape still tries: one round gaining nothing takes the average below
# MIN_GAINED_STEPS (0.6 -> 0.42), one that gains a step keeps it drafting (0.6 -> 0.72).
_TRY_GAINED_STEPS = 0.6


@dataclass(frozen=True)
class StepShare:
    """A request's share of a step: of its sequences (what a plain step advances) and of the nodes
    drafted in it (what drafting added to its time). Alone in its steps: 1 and 1."""

    sequences: float = 1.0
    drafted: float = 1.0

    def draft_round_s(self, draft_round_s: float, plain_round_s: float) -> float:
        """The step's time as far as this request's drafting made it: a plain step's and its share of
        what drafting added."""
        return plain_round_s + self.drafted * (draft_round_s - plain_round_s)


ALONE = StepShare()


def _probe_loss_steps(gained_steps: float, draft_round_s: float, plain_round_s: float,
                      share: StepShare = ALONE) -> float:
    """Plain steps' time a losing drafting round loses (0 if it does not lose)."""
    round_s = share.draft_round_s(draft_round_s, plain_round_s)
    return max(0.0, round_s / plain_round_s - (1 + gained_steps * share.sequences))


def _probe_gap_rounds(gained_steps: float, draft_round_s: float | None, plain_round_s: float | None,
                      share: StepShare = ALONE) -> int:
    """Plain rounds between probes of a losing drafter: so many that the probes cost at most
    `_PROBE_COST_SHARE` of the request's time (0 while a drafting round's loss is not known). In a
    batch a probe's loss is everyone's, while the request's own time is its share of each step: so
    with every request probing so, the probes cost that share of the batch's time."""
    if draft_round_s is None or plain_round_s is None:
        return 0
    loss = _probe_loss_steps(gained_steps, draft_round_s, plain_round_s, share)
    return min(math.ceil(loss / (_PROBE_COST_SHARE * share.sequences)), _MAX_PROBE_GAP_ROUNDS)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + _SMOOTHING * (new - old)


def _pays(gained_steps: float, draft_round_s: float | None, plain_round_s: float | None,
          share: StepShare = ALONE) -> bool:
    if gained_steps < MIN_GAINED_STEPS:
        return False
    if draft_round_s is None or plain_round_s is None:
        return True
    return ((1 + gained_steps * share.sequences) * plain_round_s
            >= (1 + _MARGIN) * share.draft_round_s(draft_round_s, plain_round_s))


class ShapeRecord:
    """The averages of every round of every request of one shape (docs/speculative-decoding.md)."""

    def __init__(self) -> None:
        self.gained_steps: float | None = None
        self.draft_round_s: float | None = None
        self.plain_round_s: float | None = None
        self.share = ALONE
        # seconds (their rounds, as their share of a step) of the requests started backed off since
        # one last probed at once
        self.probe_credit_s = 0.0

    def record(self, num_nodes: int, num_steps: int, round_s: float | None, share: StepShare = ALONE) -> None:
        if num_nodes == 0:
            if round_s is not None:
                self.plain_round_s = _average(self.plain_round_s, round_s)
            return
        self.gained_steps = _average(self.gained_steps, num_steps - 1)
        if round_s is not None:
            self.draft_round_s = _average(self.draft_round_s, round_s)
            self.share = share

    def loses(self) -> bool:
        """Whether what this shape learned says drafting does not pay (False while nothing is known)."""
        return self.gained_steps is not None and not _pays(self.gained_steps, self.draft_round_s,
                                                           self.plain_round_s, self.share)

    def probe_loss_s(self, sequences_share: float) -> float:
        """What a new request's probe round is expected to lose, in seconds (0 while not known): it
        drafts alone in its step, where its sequences are `sequences_share` of the step's."""
        if self.gained_steps is None or self.draft_round_s is None or self.plain_round_s is None:
            return 0.0
        alone = StepShare(sequences_share, 1.0)
        loss = _probe_loss_steps(self.gained_steps, self.draft_round_s, self.plain_round_s, alone)
        return self.plain_round_s * loss

    def credit_probe(self, max_rounds: int, sequences_share: float, max_steps: int) -> bool:
        """A new request started backed off with up to `max_rounds` rounds, its sequences expected to be
        `sequences_share` of a step's: whether it probes on its first round, so that such probes cost
        `_PROBE_COST_SHARE` of these requests' time. Never where a drafting round costs more than
        `max_steps` plain rounds (the most steps a round takes: 1 + its tree's depth): there not even
        a draft accepted whole pays, whatever the text (a probe would learn only what the next long
        request's own probe will)."""
        if self.draft_round_s is not None and self.plain_round_s is not None and (
                self.draft_round_s >= max_steps * self.plain_round_s):
            return False
        self.probe_credit_s += max_rounds * (self.plain_round_s or 0.0) * sequences_share
        if self.probe_credit_s * _PROBE_COST_SHARE < self.probe_loss_s(sequences_share):
            return False
        self.probe_credit_s = 0.0
        return True

    def starts_off(self) -> bool:
        """Whether a new request of this shape starts backed off: drafting lost, by the times of both
        kinds of rounds (`credit_probe` then says whether it probes at once)."""
        return self.loses() and self.draft_round_s is not None and self.plain_round_s is not None


def width_bucket(beam_width: int) -> int:
    """The beam width rounded up to a power of two: requests of one bucket share what they learn."""
    return 1 << max(beam_width - 1, 0).bit_length()


class DraftShapes:
    """The engine's memory of every shape (drafter kind, width bucket) its requests drafted in."""

    def __init__(self) -> None:
        self.shapes: dict[tuple[str, int], ShapeRecord] = {}

    def new_length(self, kind: str, beam_width: int, max_nodes: int, adaptive: bool = True,
                   max_new_tokens: int | None = None, sequences_share: float = 1.0) -> DraftLength:
        """The policy of a new request of this shape (a non-adaptive one ignores the memory); its
        `max_new_tokens` bounds the rounds it runs (None: unknown, taken as `_MAX_BACKOFF_ROUNDS`) and
        its sequences are expected to be `sequences_share` of a step's (those of the requests in the
        engine when it came)."""
        if not adaptive:
            return DraftLength(max_nodes, adaptive)
        bucket = width_bucket(beam_width)
        shape = self.shapes.setdefault((kind, bucket), ShapeRecord())
        # Greedy prompt lookup is accepted exactly when the request's own text recurs: what other
        # requests' texts taught says little, and one try costs a verify of 1 + D rows. Such a request
        # always tries, but from a losing shape one round that gains nothing ends it.
        content_decides = kind == "ngram" and bucket == 1
        # prompt lookup drafts a chain; a draft model a tree branching by the width
        branching = 1 if kind == "ngram" else branching_for_width(beam_width)
        max_depth = max_tree_depth(max_nodes, branching)
        return DraftLength(max_nodes, adaptive, shape, may_start_off=not content_decides,
                           max_rounds=max_new_tokens or _MAX_BACKOFF_ROUNDS, sequences_share=sequences_share,
                           max_depth=max_depth)


class DraftLength:
    def __init__(self, max_nodes: int, adaptive: bool = True, shape: ShapeRecord | None = None,
                 may_start_off: bool = True, max_rounds: int = _MAX_BACKOFF_ROUNDS,
                 sequences_share: float = 1.0, max_depth: int | None = None):
        self.max_nodes = max_nodes
        max_depth = max_nodes if max_depth is None else max_depth  # of the trees it drafts
        self.adaptive = adaptive
        self.shape = shape
        self.gained_steps = 1.0  # optimistic: a new request drafts in full
        self.draft_round_s: float | None = None
        self.plain_round_s: float | None = None
        self.share = ALONE  # this request's share of its latest timed drafting round's step
        self._skip_rounds = 0
        self._backoff_rounds = 1
        self._drafting_rounds_since_plain = 0
        if adaptive and shape is not None and shape.starts_off() and may_start_off:
            # earlier requests of this shape lost by drafting: start backed off, from what they measured
            self.gained_steps = shape.gained_steps
            self.draft_round_s, self.plain_round_s = shape.draft_round_s, shape.plain_round_s
            self.share = shape.share
            self._backoff_rounds = _MAX_BACKOFF_ROUNDS
            if not shape.credit_probe(max_rounds, sequences_share, 1 + max_depth):  # else it probes now
                self._skip_rounds = max(_MAX_BACKOFF_ROUNDS, self._probe_gap_rounds())
        elif adaptive and shape is not None and shape.loses():
            # it tries, but one round that gains nothing ends the try for a long back-off: as long as
            # what the shape measured says keeps such tries `_PROBE_COST_SHARE` of the time
            self.gained_steps = _TRY_GAINED_STEPS
            self.draft_round_s, self.plain_round_s = shape.draft_round_s, shape.plain_round_s
            self.share = StepShare(sequences_share, shape.share.drafted)
            self._backoff_rounds = _MAX_BACKOFF_ROUNDS

    def next_num_nodes(self) -> int:
        """D, or 0 while backing off or measuring a plain round."""
        if not self.adaptive:
            return self.max_nodes
        if self._skip_rounds > 0:
            self._skip_rounds -= 1
            return 0
        if self.wants_plain_round():  # timed rounds: compare with a timed plain round
            return 0
        return self.max_nodes

    def record(self, num_nodes: int, num_steps: int, round_s: float | None = None,
               share: StepShare = ALONE) -> None:
        """A round drafted up to `num_nodes` nodes per sequence and took `num_steps` steps, in a step
        of `round_s` seconds (None: not timed, e.g. the step also ran prompt chunks) of which this
        request had `share`."""
        if not self.adaptive:
            return
        if self.shape is not None:
            self.shape.record(num_nodes, num_steps, round_s, share)
        if num_nodes == 0:
            self._drafting_rounds_since_plain = 0
            if round_s is not None:
                self.plain_round_s = _average(self.plain_round_s, round_s)
            return
        self._drafting_rounds_since_plain += 1
        self.gained_steps += _SMOOTHING * ((num_steps - 1) - self.gained_steps)
        if round_s is not None:
            self.draft_round_s = _average(self.draft_round_s, round_s)
            self.share = share
        if self.pays():
            self._backoff_rounds = 1
            return
        self._skip_rounds = max(self._backoff_rounds, self._probe_gap_rounds())
        self._backoff_rounds = min(2 * self._backoff_rounds, _MAX_BACKOFF_ROUNDS)

    def _probe_gap_rounds(self) -> int:
        return _probe_gap_rounds(self.gained_steps, self.draft_round_s, self.plain_round_s, self.share)

    @property
    def backed_off(self) -> bool:
        """Not drafting for now (backing off after losing rounds, or started so)."""
        return self.adaptive and self._skip_rounds > 0

    def wants_plain_round(self) -> bool:
        """Whether the next round is a measured plain one (see `next_num_nodes`): the engine makes the
        whole step plain then, so the round's time is a plain step's, not other requests' drafting."""
        if not self.adaptive or self._skip_rounds > 0 or self.draft_round_s is None:
            return False
        due = _PROBE_PLAIN_AFTER if self.plain_round_s is None else _REFRESH_PLAIN_EVERY
        return self._drafting_rounds_since_plain >= due

    def pays(self) -> bool:
        """Whether drafting is expected to beat plain decoding (docs/speculative-decoding.md)."""
        return _pays(self.gained_steps, self.draft_round_s, self.plain_round_s, self.share)
