"""Ranking a beam step's candidates (beam/ranking.py) on synthetic log-probs: the shallow-then-deep top-k
equals one top-k over every running score + log-prob, and ranking the raw logits (their log-softmax
normalised chunk by chunk, never written whole) gives the same candidates, bit for bit, as ranking the
written log-softmax."""

from __future__ import annotations

import pytest
import torch

from widebeam.beam import BeamSearchState
from widebeam.beam.ranking import top_candidates
from widebeam.params import BeamSearchParams

VOCAB = 96
EOS = 2


@pytest.mark.parametrize("rows, width, vocab, scale, eos, mask", [
    (8, 8, 1000, 1.0, (), False), (8, 8, 1000, 0.05, (3,), True), (16, 16, 300, 4.0, (1, 2), False),
    (5, 8, 500, 0.3, (7, 8, 9), True), (4, 4, 20, 1.0, (0,), True), (64, 64, 3000, 0.5, (5,), False),
])
def test_top_candidates_equal_a_full_top_k(rows, width, vocab, scale, eos, mask):
    """The shallow-then-deep top-k equals one top-k over every running score + log-prob."""
    gen = torch.Generator().manual_seed(rows * vocab)
    params = BeamSearchParams(beam_width=width, max_new_tokens=8, min_new_tokens=8 if mask else 0)
    state = BeamSearchState(params, 8, set(eos))
    for trial in range(4):
        lp = torch.log_softmax(torch.randn(rows, vocab, generator=gen) * scale, dim=-1)
        if trial == 1:  # one beam far ahead of the others: all candidates come from it
            running = torch.full((rows,), -50.0)
            running[rows // 2] = -1.0
        else:
            running = torch.randn(rows, generator=gen) * (0.1 if trial == 2 else 3.0)
        values, parents, tokens, _ = top_candidates(lp, running, state._num_candidates,
                                                     state._eos_on(lp.device) if mask else None)
        full = lp + running[:, None]
        if mask:
            full[:, list(eos)] = float("-inf")
        expected_values, flat = torch.topk(full.reshape(-1), state._num_candidates)
        assert torch.equal(values, expected_values)
        assert set(zip(parents.tolist(), tokens.tolist())) == set(zip((flat // vocab).tolist(),
                                                                      (flat % vocab).tolist()))
        assert torch.equal(full[parents, tokens], values)


@pytest.mark.parametrize("rows,vocab,chunk_bytes", [(64, 500, 4 * 500 * 3), (17, 1000, 4 * 1000 * 4),
                                                    (5, 300, 1 << 20), (1, 700, 4 * 700)])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("mask", [False, True])
def test_ranking_the_logits_equals_ranking_their_log_softmax(monkeypatch, rows, vocab, chunk_bytes, ties,
                                                             mask):
    """`normalize=True` (the logits, normalised chunk by chunk in cache) gives the same candidates,
    bit for bit and in the same order, as the log-softmax written whole; many rows per chunk, one,
    and a last chunk cut short; ties (logits on a coarse grid) included."""
    from widebeam.beam import ranking

    monkeypatch.setattr(ranking, "CHUNK_BYTES", chunk_bytes)
    gen = torch.Generator().manual_seed(rows + vocab)
    params = BeamSearchParams(beam_width=8, max_new_tokens=8, min_new_tokens=8 if mask else 0)
    state = BeamSearchState(params, 8, {EOS, 3})
    eos = state._eos_on(torch.device("cpu")) if mask else None
    for trial in range(3):
        logits = torch.randn(rows, vocab, generator=gen) * 4
        if ties:
            logits = torch.round(logits)  # few distinct values: many exact ties in every row
        running = torch.randn(rows, generator=gen) * (0.0 if trial == 0 else 2.0)
        written = top_candidates(torch.log_softmax(logits, dim=-1), running, state._num_candidates, eos)
        normalised = top_candidates(logits, running, state._num_candidates, eos, normalize=True)
        for a, b in zip(written, normalised):
            assert torch.equal(a, b)


def test_a_beam_search_never_writes_the_whole_log_softmax(monkeypatch):
    """Without processors the beam decoder hands the search the logits: no [beams, vocab] log-softmax
    is written (only chunk-sized ones), and the results are those of the written path. The chunks are the
    torch path: the C++ selection kernel (tests/unit/test_row_top_kernel.py) is off here."""
    from widebeam.beam import ranking
    from widebeam.decoding.decoders import BeamDecoder, RowScores
    from widebeam.model import kernels

    monkeypatch.setattr(kernels, "SELECTION_ENABLED", False)
    monkeypatch.setattr(ranking, "CHUNK_BYTES", 4 * VOCAB * 3)  # three rows a chunk; the search runs 16
    gen = torch.Generator().manual_seed(1)
    params = BeamSearchParams(beam_width=16, max_new_tokens=4)
    decoders = [BeamDecoder(params, 4, frozenset({EOS}), []) for _ in range(2)]
    real_log_softmax = torch.log_softmax
    shapes = []

    def spy(x, *args, **kwargs):
        shapes.append(tuple(x.shape))
        return real_log_softmax(x, *args, **kwargs)

    rows = 1
    while not decoders[0].done:
        logits = torch.randn(rows, VOCAB, generator=gen) * 3
        monkeypatch.setattr(torch, "log_softmax", spy)
        fast = decoders[0].advance(RowScores(logits))
        monkeypatch.setattr(torch, "log_softmax", real_log_softmax)
        written = decoders[1].advance(RowScores(logits, real_log_softmax(logits, dim=-1)))
        assert fast == written
        rows = len(fast.token_ids)
        if rows == 0:
            break
    assert shapes and max(shape[0] for shape in shapes) == 3
    assert [(h.token_ids, h.score) for h in decoders[0].finalize()] == \
        [(h.token_ids, h.score) for h in decoders[1].finalize()]
