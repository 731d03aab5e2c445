"""What a decoder hands its logits processors each step: one history of the live sequences and how
the rows moved since the previous step.

The decoder owns the history (prompt + generated token ids of every live sequence, one row each) and
moves it with the beams; processors read it and keep nothing a history can give them. A processor
whose state cannot be derived from the history (a grammar matcher, a trie node per beam) moves that
state itself with `StepContext.moves`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class BeamMoves:
    """Row i now continues row `parent_indices[i]` of the previous step with `token_ids[i]`. Rows
    dropped in between (beams finished on a stop string) are already left out."""

    parent_indices: tuple[int, ...]
    token_ids: tuple[int, ...]

    def keep(self, rows: Sequence[int]) -> BeamMoves:
        """These rows alone, in this order (the others finished)."""
        return BeamMoves(tuple(self.parent_indices[i] for i in rows), tuple(self.token_ids[i] for i in rows))


class TokenHistory:
    """The live sequences' token ids, one row each: [rows, prompt + generated], on the device of the
    scores that read it. Moves are queued and applied on the first read after them, so a step whose
    processors never read the history (a catalogue) costs nothing here; a read applies each queued
    move once (an index_select of the rows and one new column), as a per-step reorder would."""

    def __init__(self, prompt_token_ids: Sequence[int]):
        self.prompt_len = len(prompt_token_ids)
        # [1, prompt_len]: the prompt is the one row before the first step
        self._ids = torch.tensor(list(prompt_token_ids), dtype=torch.long).reshape(1, self.prompt_len)
        self._pending: list[BeamMoves] = []
        self._latest: BeamMoves | None = None  # the moves since the latest context (its processors' news)

    def move(self, parent_indices: Sequence[int], token_ids: Sequence[int]) -> None:
        """Row i continues row `parent_indices[i]` with `token_ids[i]` (one step of the decoder)."""
        moves = BeamMoves(tuple(parent_indices), tuple(token_ids))
        self._pending.append(moves)
        self._latest = moves

    def keep(self, rows: Sequence[int]) -> None:
        """Only these rows live on, in this order."""
        if self._latest is not None:
            self._latest = self._latest.keep(rows)
        if self._pending:
            self._pending[-1] = self._pending[-1].keep(rows)
        else:
            kept = torch.tensor(list(rows), dtype=torch.long, device=self._ids.device)
            self._ids = self._ids.index_select(0, kept)

    def ids(self, device: torch.device) -> torch.Tensor:
        """[rows, prompt_len + generated] token ids on `device`."""
        if self._ids.device != device:
            self._ids = self._ids.to(device)
        for moves in self._pending:
            parents = torch.tensor(moves.parent_indices, dtype=torch.long, device=device)
            tokens = torch.tensor(moves.token_ids, dtype=torch.long, device=device)
            self._ids = torch.cat((self._ids.index_select(0, parents), tokens[:, None]), 1)  # [rows, len + 1]
        self._pending.clear()
        return self._ids

    def context(self, num_rows: int, num_generated_tokens: int, device: torch.device) -> StepContext:
        """The next step's context: what moved since the previous one."""
        moves, self._latest = self._latest, None
        return StepContext(num_rows, num_generated_tokens, self.prompt_len, moves, device, self)


@dataclass(frozen=True)
class StepContext:
    """One step of one request, as its processors see it: `num_rows` live sequences have generated
    `num_generated_tokens` tokens each after a prompt of `prompt_len`; `moves` says how they came from
    the previous step's rows (None on the first step: the prompt's one row)."""

    num_rows: int
    num_generated_tokens: int
    prompt_len: int
    moves: BeamMoves | None
    device: torch.device
    _history: TokenHistory = field(repr=False, compare=False)

    @property
    def history(self) -> torch.Tensor:
        """[num_rows, prompt_len + num_generated_tokens] token ids of every live row, on `device`."""
        ids = self._history.ids(self.device)
        if ids.shape[0] != self.num_rows:
            raise ValueError(f"the history holds {ids.shape[0]} rows, the step {self.num_rows}")
        return ids


def drop_rows(num_rows: int, dropped: Iterable[int]) -> list[int]:
    """The rows that stay, in order, when `dropped` finish."""
    gone = set(dropped)
    return [i for i in range(num_rows) if i not in gone]
