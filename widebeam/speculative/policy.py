"""How many nodes a request drafts next round.

Drafted nodes cost whether or not they are accepted: the target scores every one (rows of its
verify pass) and a draft model runs a pass per tree level. A request whose drafts are rarely
accepted (free text under prompt lookup, wide beams leaving the drafted tree) then runs slower than
without speculation, so such a request stops drafting for a while and probes again after 1, 2, 4
... 16 rounds. Output never depends on this: a round without drafts is a plain decode step.
"""

from __future__ import annotations

# Keep drafting while the recent rounds gained at least this many steps beyond the one every
# round takes (an exponential average): below it, the rejected nodes cost more than the steps saved
# (benchmarks/speculative.py, W=4 prompt lookup at 1.27 steps per round: 0.58x).
MIN_GAINED_STEPS = 0.5
_SMOOTHING = 0.3
_MAX_BACKOFF_ROUNDS = 16


class DraftLength:
    def __init__(self, max_nodes: int, adaptive: bool = True):
        self.max_nodes = max_nodes
        self.adaptive = adaptive
        self.gained_steps = 1.0  # optimistic: a new request drafts in full
        self._skip_rounds = 0
        self._backoff_rounds = 1

    def next_num_nodes(self) -> int:
        """D, or 0 while the request is backing off."""
        if self._skip_rounds > 0:
            self._skip_rounds -= 1
            return 0
        return self.max_nodes

    def record(self, num_nodes: int, num_steps: int) -> None:
        """A round drafted up to `num_nodes` nodes per sequence and took `num_steps` steps."""
        if not self.adaptive or num_nodes == 0:
            return
        self.gained_steps += _SMOOTHING * ((num_steps - 1) - self.gained_steps)
        if self.gained_steps >= MIN_GAINED_STEPS:
            self._backoff_rounds = 1
            return
        self._skip_rounds = self._backoff_rounds
        self._backoff_rounds = min(2 * self._backoff_rounds, _MAX_BACKOFF_ROUNDS)
