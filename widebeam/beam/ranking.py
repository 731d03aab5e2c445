"""The K best continuations of a beam search step, as pure functions over one step's log-probs.

Both return `(values, rows, tokens, row_best)`: the K best `running[row] + lp[row, token]` best first, and
each row of `lp`'s best allowed score (-inf: every continuation banned, so the beam ends: beam/search.py).
`eos`: the end-of-sequence ids on `lp`'s device while `min_new_tokens` masks them (their sums become -inf),
else None.
"""

from __future__ import annotations

import torch


def top_candidates(lp: torch.Tensor, running: torch.Tensor, num_candidates: int, eos: torch.Tensor | None):
    """The K = `num_candidates` best over all rows and the whole vocabulary.

    Exact, without touching the full [rows, vocab] sum: adding a row's running score keeps the row's
    order, so each row only offers its best tokens. A shallow top-k of every row gives a threshold (the
    K-th best of what it offers); only rows whose shallow list reaches the threshold can hold more of
    the K best, and only those are searched deeper. `running` has one entry per row of `lp`, or one per
    beam when `lp` is the prompt's single row (HF's prompt copies).
    """
    device = lp.device
    vocab = lp.shape[1]
    rows = running.shape[0]
    n_mask = 0 if eos is None else eos.numel()
    k_full = min(vocab, num_candidates + n_mask)  # enough for any row
    if lp.shape[0] != rows:  # the prompt's row stands for all `rows` copies
        k_shallow = k_full
    else:
        k_shallow = min(k_full, -(-num_candidates // rows) + 8 + n_mask)
    top_values, top_tokens = torch.topk(lp, k_shallow, dim=1)
    raw_last = top_values[:, -1]
    if eos is not None:
        top_values = top_values.masked_fill(torch.isin(top_tokens, eos), float("-inf"))
    # each row's best allowed score: its shallow list holds more than the masked EOS ids (or the
    # whole vocabulary), so a row whose list is all -inf allows nothing
    row_best = top_values.max(dim=1).values
    if lp.shape[0] != rows:
        top_values = top_values.expand(rows, k_shallow)
        top_tokens = top_tokens.expand(rows, k_shallow)
    sums = top_values + running[:, None]
    num = min(num_candidates, sums.numel())
    values, flat = torch.topk(sums.reshape(-1), num)
    if k_shallow < k_full:
        # Rows whose last offered token still reaches the threshold may hold more of the best K.
        deep = torch.nonzero((raw_last + running) >= values[-1]).squeeze(1)
        if deep.numel():
            deep_values, deep_tokens = torch.topk(lp.index_select(0, deep), k_full, dim=1)
            if eos is not None:
                deep_values = deep_values.masked_fill(torch.isin(deep_tokens, eos), float("-inf"))
            deep_sums = deep_values + running.index_select(0, deep)[:, None]
            sums = sums.index_fill(0, deep, float("-inf"))  # offered again, deeper, below
            all_sums = torch.cat((sums.reshape(-1), deep_sums.reshape(-1)))
            all_rows = torch.cat((torch.arange(rows, device=device).repeat_interleave(k_shallow),
                                  deep.repeat_interleave(k_full)))
            all_tokens = torch.cat((top_tokens.reshape(-1), deep_tokens.reshape(-1)))
            values, flat = torch.topk(all_sums, num)
            return values, all_rows[flat], all_tokens[flat], row_best
    return values, torch.div(flat, k_shallow, rounding_mode="floor"), top_tokens.reshape(-1)[flat], row_best


def top_allowed(lp: torch.Tensor, running: torch.Tensor, num_candidates: int, eos: torch.Tensor | None,
                rows: torch.Tensor, tokens: torch.Tensor):
    """The K best over the allowed (row, token) pairs only (a catalogue's). On the first step only the
    real prompt copy (row 0) offers candidates: a dummy copy's could neither finish nor live on, and rank
    below every real one."""
    rows, tokens = rows.to(lp.device), tokens.to(lp.device)
    sums = lp[rows, tokens] + running[rows]
    if eos is not None:
        sums = sums.masked_fill(torch.isin(tokens, eos), float("-inf"))
    values, order = torch.topk(sums, min(num_candidates, sums.shape[0]))
    # each row's best allowed score (-inf: no pair, or only banned ones)
    row_best = torch.full((lp.shape[0],), float("-inf"), device=lp.device)
    row_best = row_best.scatter_reduce(0, rows, sums, "amax")
    return values, rows[order], tokens[order], row_best
