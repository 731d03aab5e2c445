"""Beam search for one request as a pure, model-free state machine.

The search reproduces Hugging Face transformers' `generate(num_beams=W, do_sample=False)` (the vectorised
beam search of transformers 4.50+ / 5.x) exactly: same hypotheses, same order, same `sequences_scores`.
What that algorithm does, and what this module therefore does:

* The first step sees only the prompt. HF holds W copies of it, scores copy 0 with 0 and the others with
  -1e9, so that only copy 0's tokens compete; here the caller passes one row of log-probs for the prompt
  and the W-1 dummy copies are reproduced on the (tiny) candidate set, not on the vocabulary.
* Each step keeps the K = max(2, 1 + number of EOS ids) * W best continuations of all live beams by
  cumulative log-prob. A continuation that ends with an EOS id finishes a hypothesis, but only if it ranks
  among the first W of the K; an EOS continuation ranked W..K-1 is dropped. The W best continuations that do
  not end with EOS become the next live beams (K is large enough that there are always W of them).
* A finished hypothesis scores `cumulative_logprob / generated_len ** length_penalty`, `generated_len`
  counting the generated tokens including the EOS token (the prompt is excluded). At most W finished
  hypotheses are kept, the best by score.
* On the step that generates token number `max_new_tokens`, every one of the W best continuations is
  finished (EOS or not), scored with `generated_len = max_new_tokens`, and the search ends. There is no
  other "add the running beams at the end" step.
* After each step the search ends early when W hypotheses are finished and either `early_stopping is True`,
  or the best live beam, scored as if it finished at `generated_len` (the current length, or
  `max_new_tokens` when `early_stopping == "never"` and `length_penalty > 0`), does not beat the worst kept
  hypothesis.
* `min_new_tokens`: while fewer than `min_new_tokens` tokens were generated, EOS ids get log-prob -inf.
* Candidates with exactly equal float32 scores (ties) come in the order torch.topk gives them, which
  depends on tensor shapes and device; HF's own order among exact ties is no better defined, so it is not
  imitated. (Real models practically never tie; a toy bigram model ties whenever beams permute a cycle.)
* `beam_width=1` is what HF `generate(num_beams=1)` runs: greedy search. It is the W=1 case of the above
  except that the first EOS always ends the search (the "never" rule with `length_penalty > 0` could keep
  a width-1 beam search going); the hypothesis is still scored as above (HF greedy reports no score).
* Where HF would carry a beam whose every continuation is -inf (its processors banned all) on with -inf
  scores and banned tokens, here it ends where it stands: a hypothesis with finish reason "banned",
  scored at its length (under a catalogue it is no item: kept aside, returned only if nothing finished).
* `patience` p >= 1 (CTranslate2's, arXiv 2204.05424): every "W finished hypotheses" above becomes
  round(W * p): that many are kept, and the search can stop only once that many finished. Which
  candidates may finish (the top W of the K) is unchanged; p = 1 is HF's search exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from widebeam.beam.hypothesis import BANNED, Annotate, Hypothesis, StepResult
from widebeam.beam.ranking import top_allowed, top_candidates
from widebeam.beam.scores import divided_scores, hypothesis_score, length_normalizer
from widebeam.beam.tree import SearchTree
from widebeam.params import BeamSearchParams

# HF's running score of its dummy prompt copies (all but copy 0), reproduced on the first step's candidates.
# It is never compared with a finished score: a length penalty can take a real score below it (HF then
# drops real hypotheses as empty slots). Candidates from dummy copies are told apart by their copy index.
_NEG = -1.0e9

# Below every real score (scores are finite: see `divided_scores`): an empty slot of finished hypotheses.
_IMPOSSIBLE = float("-inf")

_NO_NODE = -1  # parent of the first generated token: the prompt

@dataclass
class _Finished:
    score: float
    cumulative_logprob: float
    node: int  # last node of the tokens already in the tree
    extra_token: int | None  # a final token that has no node of its own
    finish_reason: str
    extra_annotation: object = None  # the extra token's annotation
    tree_id: int = -1  # its node in the search tree (return_tree)


class BeamSearchState:
    """Beam search of one request, driven by the caller's log-probs; scores exactly like HF `generate`.

    Protocol::

        state = BeamSearchState(params, max_new_tokens, eos_token_ids)
        logprobs = log_softmax(model(prompt)[-1])[None]      # [1, vocab]: the prompt, once
        while not state.done:
            result = state.step(logprobs)                    # picks the next live beams
            if result.empty:
                break
            # live beam i = old live beam result.parent_indices[i] + result.token_ids[i]
            # (optional) state.finish_live_beams([...]) for beams whose text hit a stop string
            logprobs = ...                                   # [live beams, vocab], same order
        hypotheses = state.finalize()

    `logprobs` holds, for each live beam in order, the float32 `log_softmax` of the model's raw logits for
    the next token; it may live on any device (the top-k over the vocabulary runs there, only O(W) numbers
    come back to the CPU). The first step takes a single row, the prompt's: HF's W identical prompt copies
    (all but one scored -1e9) are reproduced exactly without the caller duplicating anything. Later steps
    take `beam_width` rows, fewer only after `finish_live_beams` (or with a vocabulary smaller than the
    candidate pool); the next step goes back to `beam_width` live beams.

    The end-of-sequence set is `eos_token_ids` (dropped when `params.ignore_eos`) plus
    `params.stop_token_ids`. Stop strings are the caller's job: it detokenizes the live beams after a step
    and calls `finish_live_beams` for those that hit one; each becomes a hypothesis with finish reason
    "stop", scored at its current length (HF has no equivalent, so there is nothing to match there).

    Per-step Python work is O(beam_width * number of EOS ids); nothing loops over the vocabulary in Python.
    """

    def __init__(self, params: BeamSearchParams, max_new_tokens: int, eos_token_ids: Iterable[int] = ()):
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        self.params = params
        # With a schedule, step k runs w_k beams (`params.width_at_step`); the finished hypotheses
        # kept and the stopping rule follow the final width, the one results come from.
        self.beam_width = params.final_beam_width
        self.max_new_tokens = max_new_tokens
        eos = set() if params.ignore_eos else {int(t) for t in eos_token_ids}
        eos.update(params.stop_token_ids)
        self.eos_token_ids = frozenset(eos)
        self._eos_sorted = sorted(eos)
        self._eos_by_device: dict[torch.device, torch.Tensor] = {}
        self._candidates_per_beam = max(2, 1 + len(eos))
        self._num_candidates = self._candidates_per_beam * self.beam_width
        self._length_penalty = float(params.length_penalty)
        self._early_stopping = params.early_stopping
        # finished hypotheses kept, and needed before the search may stop (patience, CTranslate2's)
        self._num_kept = max(self.beam_width, round(self.beam_width * params.patience))
        # Token tree: node i holds one generated token and the node before it (_NO_NODE: the prompt).
        self._node_token: list[int] = []
        self._node_parent: list[int] = []
        self._node_annotation: list | None = None  # per node, once a step is annotated
        self._live_nodes: list[int] = [_NO_NODE]
        self._live_scores: list[float] = [0.0]  # cumulative log-probs (float32 values)
        self._live_tokens_cache: list[list[int]] | None = None
        self._generated = 0
        self._finished: list[_Finished] = []  # best first, at most _num_kept
        # constrained search: beams that no allowed token could continue (finish reason "banned"), best
        # first; returned only when no hypothesis finished (unconstrained, they are hypotheses at once)
        self._ended: list[_Finished] = []
        self._done = False
        # return_tree: every kept candidate (beam/tree.py); None, and no per-step work, when off.
        self.tree = SearchTree(self.beam_width, self._length_penalty) if params.return_tree else None

    # -- read-only views ---------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._done

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated so far by every live beam (all live beams have the same length)."""
        return self._generated

    @property
    def finished(self) -> list[Hypothesis]:
        """The finished hypotheses kept so far (at most `beam_width`), best first."""
        return [self._hypothesis(entry) for entry in self._finished]

    @property
    def num_live_beams(self) -> int:
        return len(self._live_nodes)

    @property
    def live_token_ids(self) -> list[list[int]]:
        """Generated tokens of each live beam, in live-beam order (one empty list before the first step).

        Rebuilt from the token tree once per step: O(beam_width * generated tokens), unlike `step`.
        """
        if self._live_tokens_cache is None:
            self._live_tokens_cache = [self._path(node) for node in self._live_nodes]
        return [list(tokens) for tokens in self._live_tokens_cache]

    # -- the search --------------------------------------------------------------------------------------

    def step(self, logprobs: torch.Tensor, mask_min_length_eos: bool = True,
             allowed: tuple[torch.Tensor, torch.Tensor] | None = None,
             annotate: Annotate | None = None, normalize: bool = False) -> StepResult:
        """Consume the live beams' next-token log-probs `[live beams, vocab]`; return the next live beams.

        `normalize=True`: `logprobs` holds the raw logits instead; the step ranks their log-softmax
        without writing it whole (beam/ranking.py), with the same choices and scores.

        `mask_min_length_eos=False` lets EOS through before `min_new_tokens` (a caller forcing EOS).
        `allowed` = (rows, tokens): the only (beam, token) pairs this step may take (a catalogue);
        the search then ranks just those, never the whole [beams, vocab] (the same result as
        masking every other score to -inf, without writing or scanning it).
        `annotate(parent_rows, tokens)`: called once with the pairs the step kept; each result is
        stored with its token and comes back in `Hypothesis.annotations`, following the beams.

        Returns an empty `StepResult` when the search is done (then `done` is True).
        """
        if self._done:
            raise RuntimeError("beam search is done; call finalize()")
        num_live = len(self._live_nodes)
        if logprobs.dim() != 2 or logprobs.shape[0] != num_live or logprobs.shape[1] < 1:
            raise ValueError(f"logprobs must have shape [{num_live}, vocab] (one row per live beam), "
                             f"got {tuple(logprobs.shape)}")
        lp = logprobs.detach()
        if lp.dtype != torch.float32:
            lp = lp.float()
        device = lp.device
        width = self.params.width_at_step(self._generated + 1)  # this step's (scheduled) width
        self._num_candidates = self._candidates_per_beam * width
        mask_eos = (mask_min_length_eos and bool(self._eos_sorted)
                    and self._generated < self.params.min_new_tokens)

        first = self._generated == 0
        if first and width > 1:
            # HF's W prompt copies: copy 0 scored 0, the others -1e9. Only the candidates are replicated.
            running = torch.full((width,), _NEG, dtype=torch.float32)
            running[0] = 0.0
        else:
            running = torch.tensor(self._live_scores, dtype=torch.float32)
        eos = self._eos_on(device) if mask_eos else None
        if allowed is None:
            values, parent_rows, tokens, row_best = top_candidates(lp, running.to(device),
                                                                   self._num_candidates, eos, normalize)
        else:
            if normalize:
                lp = torch.log_softmax(lp, dim=-1)
            values, parent_rows, tokens, row_best = top_allowed(lp, running.to(device),
                                                                self._num_candidates, eos, *allowed)
        num_candidates = values.shape[0]
        generated = self._generated + 1
        last = generated >= self.max_new_tokens
        lp_exp = self._length_penalty
        finished_scores = divided_scores(values, length_normalizer(generated, lp_exp))
        if self._early_stopping == "never" and lp_exp > 0.0:
            hypothetical_len = self.max_new_tokens
        else:
            hypothetical_len = generated
        best_possible = divided_scores(values, length_normalizer(hypothetical_len, lp_exp))
        # one read of the candidates' floats and of each row's best allowed score (-inf: none allowed)
        candidates = torch.stack((values.double(), finished_scores.double(), best_possible.double()))
        floats = torch.cat((candidates.reshape(-1), row_best.double())).cpu().tolist()
        ints = torch.stack((parent_rows, tokens)).cpu().tolist()
        values_l = floats[:num_candidates]
        finished_l = floats[num_candidates:2 * num_candidates]
        best_possible_l = floats[2 * num_candidates:3 * num_candidates]
        ended = self._ended_beams(floats[3 * num_candidates:], first)
        parents_l, tokens_l = ints

        eos = self.eos_token_ids
        new_nodes: list[int] = []
        new_scores: list[float] = []
        out_parents: list[int] = []
        out_tokens: list[int] = []
        new_finished: list[_Finished] = []
        finished_rows: list[int] = []  # the parent row of each new finished entry
        best_running = None
        for rank in range(num_candidates):
            token = tokens_l[rank]
            parent = 0 if first else parents_l[rank]
            hits_eos = token in eos
            if last or hits_eos:
                # Only the top-W ranks may finish; never a candidate of a dummy prompt copy, nor a
                # masked (-inf) token.
                dummy = first and width > 1 and parents_l[rank] != 0
                if rank < width and not dummy and finished_l[rank] > _IMPOSSIBLE:
                    new_finished.append(_Finished(finished_l[rank], values_l[rank], self._live_nodes[parent],
                                                  token, "stop" if hits_eos else "length"))
                    finished_rows.append(parent)
                continue
            if len(out_tokens) < width and values_l[rank] > _IMPOSSIBLE and not (first and width > 1
                                                                                 and parents_l[rank] != 0):
                # A live beam is real: never a masked (-inf) continuation nor one of a dummy prompt
                # copy. HF keeps such beams when fewer real ones exist (a constrained search); here
                # fewer beams live on, so nothing invalid is ever returned.
                if best_running is None:
                    best_running = best_possible_l[rank]
                out_parents.append(parent)
                out_tokens.append(token)
                new_scores.append(values_l[rank])
        annotations = None
        if annotate is not None:
            annotations = annotate(finished_rows + out_parents,
                                   [f.extra_token for f in new_finished] + out_tokens)
            for entry, annotation in zip(new_finished, annotations):
                entry.extra_annotation = annotation
            annotations = annotations[len(new_finished):]
            if self._node_annotation is None:
                self._node_annotation = [None] * len(self._node_token)
        if self.tree is not None:
            self.tree.record_step(generated, new_finished, [self._live_nodes[p] for p in out_parents],
                                  out_tokens, new_scores)
            for entry in ended:
                if entry.node != _NO_NODE:  # the prompt itself has no node
                    self.tree.finish_node(entry)
        if self.params.constrained and ended:
            # under a catalogue a beam cut inside an item is no item: returned only if nothing else is
            self._ended = sorted(self._ended + ended, key=lambda f: f.score, reverse=True)[:self._num_kept]
            ended = []
        self._merge_finished(new_finished + ended)

        if last or not out_tokens:
            return self._finish()
        for i, (parent, token) in enumerate(zip(out_parents, out_tokens)):
            self._node_token.append(token)
            self._node_parent.append(self._live_nodes[parent])
            if self._node_annotation is not None:
                self._node_annotation.append(None if annotations is None else annotations[i])
            new_nodes.append(len(self._node_token) - 1)
        self._live_nodes = new_nodes
        self._live_scores = new_scores
        self._live_tokens_cache = None
        self._generated = generated
        if self._should_stop(best_running):
            return self._finish()
        return StepResult(out_parents, out_tokens)

    def finish_live_beams(self, indices: Iterable[int]) -> None:
        """Finish the given live beams now (their text hit a stop string), with finish reason "stop".

        Each becomes a hypothesis scored at its current length, competing for the `beam_width` kept slots
        like any other. The remaining live beams keep their relative order and are renumbered 0..n-1; the
        next `step` takes one row per remaining beam. When none remain, the search is done.
        """
        if self._done:
            raise RuntimeError("beam search is done; call finalize()")
        chosen = sorted({int(i) for i in indices})
        if not chosen:
            return
        if self._generated == 0:
            raise ValueError("no beam has generated a token yet; nothing to finish")
        num_live = len(self._live_nodes)
        if chosen[0] < 0 or chosen[-1] >= num_live:
            raise IndexError(f"live beam indices must be in [0, {num_live}), got {chosen}")
        new_finished = []
        for i in chosen:
            score = hypothesis_score(self._live_scores[i], self._generated, self._length_penalty)
            if score > _IMPOSSIBLE:
                new_finished.append(_Finished(score, self._live_scores[i], self._live_nodes[i], None, "stop"))
        if self.tree is not None:
            for entry in new_finished:
                self.tree.finish_node(entry)
        self._merge_finished(new_finished)
        chosen_set = set(chosen)
        keep = [i for i in range(num_live) if i not in chosen_set]
        self._live_nodes = [self._live_nodes[i] for i in keep]
        self._live_scores = [self._live_scores[i] for i in keep]
        self._live_tokens_cache = None
        if not keep:
            self._finish()
            return
        if self._early_stopping == "never" and self._length_penalty > 0.0:
            hypothetical_len = self.max_new_tokens
        else:
            hypothetical_len = self._generated
        best = hypothesis_score(max(self._live_scores), hypothetical_len, self._length_penalty)
        if self._should_stop(best):
            self._finish()

    def finalize(self) -> list[Hypothesis]:
        """The best `num_return_sequences` hypotheses, best first.

        Called before the search is done (an aborted request), live beams fill any missing places, scored at
        their current length with finish reason "length". Fewer come back only when stop strings ended every
        beam before `num_return_sequences` hypotheses were finished, or a constraint left fewer
        reachable; never none once a step ran (a constrained search with no item finished returns the
        beams its constraint cut, "banned").
        """
        wanted = self.params.num_return_sequences
        entries = list(self._finished[:wanted] or self._ended[:wanted])
        # A finished search never fills with live beams: they are the previous step's, and under a
        # constraint an unfinished beam is not an item.
        if len(entries) < wanted and self._generated > 0 and not self._done:
            live = [_Finished(hypothesis_score(score, self._generated, self._length_penalty), score, node,
                              None, "length") for score, node in zip(self._live_scores, self._live_nodes)]
            live.sort(key=lambda f: f.score, reverse=True)
            if self.tree is not None:
                for entry in live[:wanted - len(entries)]:
                    self.tree.finish_node(entry)
            entries = sorted(entries + live[:wanted - len(entries)], key=lambda f: f.score, reverse=True)
        if self.tree is not None:
            self.tree.set_ranks([entry.tree_id for entry in entries])
        return [self._hypothesis(entry) for entry in entries]

    # -- internals ---------------------------------------------------------------------------------------

    def _ended_beams(self, row_best: list[float], first: bool) -> list[_Finished]:
        """The live beams (on the first step: the prompt) whose every continuation is banned (their
        best allowed score is -inf): each ends where it stands, finish reason "banned", scored at its
        length (a prompt with no allowed first token: no tokens, score 0)."""
        ended = []
        for row, best in enumerate(row_best):
            if best > _IMPOSSIBLE:  # false for nan too (the log-softmax of a row with nothing left)
                continue
            node, cumulative = (_NO_NODE, 0.0) if first else (self._live_nodes[row], self._live_scores[row])
            score = hypothesis_score(cumulative, max(1, self._generated), self._length_penalty)
            ended.append(_Finished(score, cumulative, node, None, BANNED))
        return ended

    def _merge_finished(self, new_finished: list[_Finished]) -> None:
        if new_finished:
            merged = self._finished + new_finished  # stable: earlier hypotheses win ties
            merged.sort(key=lambda f: f.score, reverse=True)
            self._finished = merged[:self._num_kept]

    def _should_stop(self, best_possible: float | None) -> bool:
        """HF's stopping rule, checked after each step with the best live beam's optimistic score."""
        full = len(self._finished) >= self._num_kept
        if full and (self._early_stopping is True or self.params.beam_width == 1):
            # beam_width 1 is HF's greedy search (generate(num_beams=1)): the first EOS ends it.
            return True
        if best_possible is None:
            return True
        worst_kept = self._finished[-1].score if full else _IMPOSSIBLE
        return not best_possible > worst_kept

    def _finish(self) -> StepResult:
        self._done = True
        self._live_nodes = []
        self._live_scores = []
        self._live_tokens_cache = None
        return StepResult()

    def _eos_on(self, device: torch.device) -> torch.Tensor:
        tensor = self._eos_by_device.get(device)
        if tensor is None:
            tensor = torch.tensor(self._eos_sorted, dtype=torch.long, device=device)
            self._eos_by_device[device] = tensor
        return tensor

    def _hypothesis(self, entry: _Finished) -> Hypothesis:
        tokens = self._path(entry.node)
        annotations = None
        if self._node_annotation is not None:
            annotations = self._path(entry.node, self._node_annotation)
        if entry.extra_token is not None:
            tokens.append(entry.extra_token)
            if annotations is not None:
                annotations.append(entry.extra_annotation)
        return Hypothesis(tokens, entry.cumulative_logprob, entry.score, entry.finish_reason, annotations)

    def _path(self, node: int, values: list | None = None) -> list:
        """The tokens (or `values`, one per node) from the prompt to `node`."""
        values = self._node_token if values is None else values
        tokens = []
        while node != _NO_NODE:
            tokens.append(values[node])
            node = self._node_parent[node]
        tokens.reverse()
        return tokens
