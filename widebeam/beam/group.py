"""Group (diverse) beam search for one request, model-free: transformers 4.46's `_group_beam_search`
(`generate(num_beams=W, num_beam_groups=G, diversity_penalty=d)`), exactly.

What that algorithm does, and what this module therefore does (S = W / G beams per group):

* The W beams form G groups of S, searched one after the other within each step. Group k's scores
  are its rows' log-softmax, less `d` times how often each token was chosen at this same step by
  the groups before it (Hamming diversity: transformers' `HammingDiversityLogitsProcessor`), plus
  each beam's running score. The penalised scores are what accumulate: they are the beams' scores
  and, divided by the length penalty, the hypotheses' scores.
* On the first step every group sees only the prompt: its first beam scores 0 and its other S - 1
  (copies of the prompt) -1e9, so each group starts from one real beam.
* Within a group, a step is transformers' beam-scorer step at width S: the 2S best continuations
  (max(2, 1 + number of EOS ids) * S), an EOS continuation among the first S ranks finishing a
  hypothesis of that group (`generated_len` includes the EOS), the first S others living on. Each
  group keeps its own S best hypotheses (HF's `BeamHypotheses`: a new one enters when the pool is
  not full or it beats the worst), and is done once that pool is full and (`early_stopping` True,
  or) the best of this step's candidates, at the current length (or `max_new_tokens` with "never"
  and `length_penalty > 0`), cannot beat its worst. A done group's beams leave the batch; in
  transformers they stay as padding whose token (the pad id, which falls back to EOS) still counts
  in later groups' penalties, and so it does here (`pad_token_id`).
* The search ends when every group is done, or at `max_new_tokens`, where each group not done adds
  its live beams as hypotheses scored at that length. The result is the best
  `num_return_sequences` hypotheses over all groups.
* `min_new_tokens` bans EOS before it. `allowed` pairs (a catalogue) mask every other token of a
  group's rows to -inf first; a group then keeps only real (finite) beams.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from widebeam.beam.hypothesis import BANNED, Hypothesis, StepResult
from widebeam.params import BeamSearchParams

_NEG = -1.0e9  # transformers' score of a group's prompt copies but the first


class _Pool:
    """transformers 4.46 `BeamHypotheses` of one group: at most `size` (score, tokens, cumulative)."""

    def __init__(self, size: int, length_penalty: float, early_stopping, max_new_tokens: int):
        self.size, self.length_penalty = size, length_penalty
        self.early_stopping, self.max_new_tokens = early_stopping, max_new_tokens
        self.entries: list[tuple[float, list[int], float, str]] = []
        self.worst_score = 1e9

    def add(self, tokens: list[int], cumulative: float, generated_len: int, reason: str) -> None:
        score = cumulative / (generated_len ** self.length_penalty)
        if len(self.entries) < self.size or score > self.worst_score:
            self.entries.append((score, tokens, cumulative, reason))
            if len(self.entries) > self.size:
                ranked = sorted((s, i) for i, (s, *_rest) in enumerate(self.entries))
                del self.entries[ranked[0][1]]
                self.worst_score = ranked[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_cumulative: float, generated_len: int) -> bool:
        if len(self.entries) < self.size:
            return False
        if self.early_stopping is True:
            return True
        length = generated_len
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_new_tokens
        return self.worst_score >= best_cumulative / (length ** self.length_penalty)


class GroupBeamSearchState:
    """Diverse beam search driven by the caller's log-probs, with `BeamSearchState`'s protocol: the
    first `step` takes the prompt's single row, later ones one row per live beam (the beams of the
    groups not yet done, group by group), in `live_token_ids` order."""

    tree = None  # `return_tree` is refused with groups (params.py): one tree per group is not drawn

    def __init__(self, params: BeamSearchParams, max_new_tokens: int, eos_token_ids: Iterable[int] = (),
                 pad_token_id: int | None = None):
        self.params = params
        self.num_groups = params.num_beam_groups
        self.group_size = params.beam_width // self.num_groups
        self.max_new_tokens = max_new_tokens
        eos = set() if params.ignore_eos else {int(t) for t in eos_token_ids}
        eos.update(params.stop_token_ids)
        self.eos_token_ids = frozenset(eos)
        self._eos_sorted = sorted(eos)
        # transformers pads a done group's beams with pad_token_id, falling back to the first EOS id
        self.pad_token_id = pad_token_id if pad_token_id is not None else (self._eos_sorted or [0])[0]
        self._num_candidates = max(2, 1 + len(eos)) * self.group_size
        self._pools = [_Pool(self.group_size, float(params.length_penalty), params.early_stopping,
                             max_new_tokens) for _ in range(self.num_groups)]
        self._group_done = [False] * self.num_groups
        # per group: live beams' generated tokens and running (penalised) scores
        self._tokens: list[list[list[int]]] = [[[]] for _ in range(self.num_groups)]
        self._scores: list[list[float]] = [[0.0] for _ in range(self.num_groups)]
        self._generated = 0
        self._done = False
        self._ended: list[tuple[list[int], float, int, str]] = []  # constrained: beams nothing continued

    # -- read-only views ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done

    @property
    def num_generated_tokens(self) -> int:
        return self._generated

    @property
    def num_live_beams(self) -> int:
        return sum(len(t) for k, t in enumerate(self._tokens) if not self._group_done[k])

    @property
    def live_token_ids(self) -> list[list[int]]:
        return [list(tokens) for k in range(self.num_groups) if not self._group_done[k]
                for tokens in self._tokens[k]]

    # -- the search ---------------------------------------------------------------------------------
    def step(self, logprobs: torch.Tensor, mask_min_length_eos: bool = True,
             allowed: tuple[torch.Tensor, torch.Tensor] | None = None, annotate=None,
             normalize: bool = False) -> StepResult:
        """As `BeamSearchState.step`; the diversity penalty edits every row, so raw logits
        (`normalize`) are normalised whole here."""
        if self._done:
            raise RuntimeError("beam search is done; call finalize()")
        if annotate is not None:
            raise ValueError("log-probs are not reported with num_beam_groups > 1")
        lp = logprobs.detach().float().cpu()
        if normalize:
            lp = torch.log_softmax(lp, dim=-1)
        first = self._generated == 0
        if allowed is not None:  # a catalogue: every pair it does not offer is -inf
            rows, tokens = allowed
            masked = torch.full_like(lp, float("-inf"))
            masked[rows.cpu(), tokens.cpu()] = lp[rows.cpu(), tokens.cpu()]
            lp = masked
        if mask_min_length_eos and self._eos_sorted and self._generated < self.params.min_new_tokens:
            lp = lp.clone()
            lp[:, self._eos_sorted] = float("-inf")
        generated = self._generated + 1
        vocab = lp.shape[1]
        allows = (lp > float("-inf")).any(dim=1).tolist()  # per row: any token left (else it ends)
        step_tokens: list[int] = []  # tokens the groups chose this step, in group order
        out_parents: list[int] = []
        out_tokens: list[int] = []
        row = 0  # the first row of the current group in `lp`
        spans = []  # (group, its first new beam in out_*, how many)
        for k in range(self.num_groups):
            if self._group_done[k]:
                step_tokens += [self.pad_token_id] * self.group_size
                continue
            if first:
                group_lp = lp[0:1].expand(self.group_size, vocab)
                running = torch.full((self.group_size,), _NEG, dtype=torch.float32)
                running[0] = 0.0
                parent_rows = [0] * self.group_size
                self._end_banned(k, [0] if k == 0 and not allows[0] else [])  # the one prompt: once
            else:
                n = len(self._tokens[k])
                group_lp = lp[row:row + n]
                running = torch.tensor(self._scores[k], dtype=torch.float32)
                parent_rows = list(range(row, row + n))
                self._end_banned(k, [i for i in range(n) if not allows[row + i]])
                row += n
            if k > 0 and self.params.diversity_penalty:
                frequency = torch.bincount(torch.tensor(step_tokens, dtype=torch.long), minlength=vocab)
                group_lp = group_lp - self.params.diversity_penalty * frequency
            sums = (group_lp + running[:, None]).reshape(-1)
            values, flat = torch.topk(sums, min(self._num_candidates, sums.numel()))
            start = len(out_tokens)
            chosen_tokens = self._group_step(k, values.tolist(), (flat // vocab).tolist(),
                                             (flat % vocab).tolist(), generated, first, parent_rows,
                                             out_parents, out_tokens)
            spans.append((k, start, len(out_tokens) - start))
            step_tokens += chosen_tokens
            best = float(values[0]) if values.numel() else float("-inf")
            self._group_done[k] = self._group_done[k] or self._pools[k].is_done(best, generated)
        self._generated = generated
        if generated >= self.max_new_tokens or all(self._group_done):
            return self._finish()
        # the next step's rows: the beams of the groups not done, group by group
        live_parents, live_tokens = [], []
        for k, start, n in spans:
            if not self._group_done[k]:
                live_parents += out_parents[start:start + n]
                live_tokens += out_tokens[start:start + n]
        if not live_tokens:
            return self._finish()
        return StepResult(live_parents, live_tokens)

    def _group_step(self, k: int, values: list[float], local_rows: list[int], tokens: list[int],
                    generated: int, first: bool, parent_rows: list[int], out_parents: list[int],
                    out_tokens: list[int]) -> list[int]:
        """Group k's beam-scorer step over its ranked candidates; its new beams go to `out_*`."""
        new_tokens, new_scores, chosen = [], [], []
        old_tokens = self._tokens[k]
        for rank, (value, local, token) in enumerate(zip(values, local_rows, tokens)):
            parent_tokens = old_tokens[0] if first else old_tokens[local]
            if token in self.eos_token_ids:
                if rank < self.group_size and value > float("-inf"):
                    self._pools[k].add(parent_tokens + [token], value, generated, "stop")
            elif value > float("-inf"):
                new_tokens.append(parent_tokens + [token])
                new_scores.append(value)
                out_parents.append(parent_rows[local])
                out_tokens.append(token)
                chosen.append(token)
            if len(new_tokens) == self.group_size:
                break
        self._tokens[k], self._scores[k] = new_tokens, new_scores
        if not new_tokens:
            self._group_done[k] = True  # a constraint left this group nothing to extend
        return chosen + [self.pad_token_id] * (self.group_size - len(chosen))

    def _end_banned(self, k: int, local_rows: list[int]) -> None:
        """Group k's beams at `local_rows` that no allowed token can continue end where they stand,
        finish reason "banned" (a constrained search keeps them aside: returned only if nothing else
        finished, as beam/search.py does)."""
        for i in local_rows:
            entry = (list(self._tokens[k][i]), self._scores[k][i], max(1, self._generated), BANNED)
            if self.params.constrained:
                self._ended.append(entry)
            else:
                self._pools[k].add(*entry)

    def finish_live_beams(self, indices) -> None:
        raise ValueError("stop strings are not supported with num_beam_groups > 1")

    def _finish(self) -> StepResult:
        if self._generated >= self.max_new_tokens:
            for k in range(self.num_groups):
                if not self._group_done[k]:
                    for tokens, score in zip(self._tokens[k], self._scores[k]):
                        self._pools[k].add(list(tokens), score, self._generated, "length")
        self._done = True
        return StepResult()

    def finalize(self) -> list[Hypothesis]:
        """The best `num_return_sequences` hypotheses over every group, best first."""
        entries = [entry for pool in self._pools for entry in pool.entries]
        if not entries:  # only beams that nothing could continue (a constrained search)
            pool = _Pool(len(self._ended) or 1, float(self.params.length_penalty), False, self.max_new_tokens)
            for entry in self._ended:
                pool.add(*entry)
            entries = pool.entries
        entries.sort(key=lambda e: e[0], reverse=True)
        return [Hypothesis(tokens, cumulative, score, reason)
                for score, tokens, cumulative, reason in entries[:self.params.num_return_sequences]]
