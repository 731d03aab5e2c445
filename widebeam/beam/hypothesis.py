"""What a search hands back: the next live beams of a step (`StepResult`) and the finished
hypotheses (`Hypothesis`), shared by beam search (search.py) and group beam search (group.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# The finish reason of a sequence (a beam, a sample) that its constraints (bans, the n-gram rule,
# min_new_tokens' end ban, a catalogue or grammar, a caller's processor) left no token to take: it ends
# where it stands, never with a banned token.
BANNED = "banned"


@dataclass(frozen=True)
class Hypothesis:
    """One finished beam: generated tokens only (with the final EOS/stop token if it ended with one)."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS / stop token / stop string), "length", or BANNED (no token was left)
    # One per token when the steps were annotated (`step(annotate=...)`): the beam's own history.
    annotations: list | None = None


# Called once per step with the (parent row, token) pairs the step kept (new live beams and newly
# finished hypotheses), returns one annotation per pair (the decoder's per-token log-probs).
Annotate = Callable[[Sequence[int], Sequence[int]], list]


@dataclass(frozen=True)
class StepResult:
    """The next live beams: beam i = current live beam `parent_indices[i]` extended by `token_ids[i]`.

    Empty when the search is done.
    """

    parent_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def empty(self) -> bool:
        return not self.token_ids
