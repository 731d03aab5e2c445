"""The K best continuations of a beam search step, as pure functions over one step's log-probs.

Both return `(values, rows, tokens, row_best)`: the K best `running[row] + lp[row, token]` best first, and
each row of `lp`'s best allowed score (-inf: every continuation banned, so the beam ends: beam/search.py).
`eos`: the end-of-sequence ids on `lp`'s device while `min_new_tokens` masks them (their sums become -inf),
else None.

`top_candidates` may take the raw logits instead (`normalize=True`): it then ranks their log-softmax
without ever writing the whole [rows, vocab] of it. Rows go through in chunks small enough to stay in
the core's cache: each chunk's log-softmax is written to one reused buffer and its top-k read from
there, so the step reads the logits once from memory instead of writing and re-reading a second
[rows, vocab] tensor (0.2 GB a step at W=1,024 on a 49k vocabulary). The values are the log-softmax's
own, bit for bit: the kernel normalises each row on its own, so a chunk's rows come out as the
whole tensor's would, and the top-k of each row, ties included, is the one it gave before.

Where the C++ kernels are built (`make setup`) a CPU step goes one better: `log_softmax_topk` reads each
row from cache three times and writes nothing row-sized, where torch.topk copies every row into (value,
index) pairs before its partial sort. Its values are the log-softmax's bit for bit and its order
torch.topk's, ties included (model/kernels/row_top.cpp); it serves where torch.topk partial-sorts
(k x 64 <= vocab), the chunks above everywhere else. A deeper search reads its rows in place (no gathered
copy) and reuses each row's max and log-sum-exp from the first pass, so it costs a scan of those rows,
not their exps again.
"""

from __future__ import annotations

import torch

from widebeam.model import kernels

# One chunk of log-softmax rows (bytes): a core's L2 here (2 MiB), so the buffer and the logits it was
# read from stay in cache between the normalisation and the top-k. Measured on this CPU (row_top, k = 10,
# 49k vocabulary): W=256 18.0 ms at 1 MiB, 15.3 at 2 MiB, 14.8 at 4 MiB; W=1,024 71 / 55 / 56 ms; the
# log-softmax written whole and its top-k 23.5 and 104 ms.
CHUNK_BYTES = 2 << 20


def _log_softmax_topk(x: torch.Tensor, k: int, rows: torch.Tensor | None = None,
                      shifts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.ops.widebeam.log_softmax_topk(x, k, rows, shifts)


def row_top(x: torch.Tensor, k: int, normalize: bool, rows: torch.Tensor | None = None,
            shifts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each row's k best: of `x` itself, or (`normalize`) of its float32 log-softmax, chunk by chunk.

    `rows`: only these rows of `x` (the kernel reads them in place; the torch paths gather them).
    Returns (values, tokens, shifts): shifts are the kernel's per-row (max, log-sum-exp), None from
    the torch paths; handing them back with the same rows of the same `x` spares the kernel their
    max and exps (a deeper search of rows it has read).
    """
    if normalize and (k * 64 <= x.shape[1] and x.device.type == "cpu" and x.dtype == torch.float32
                      and x.stride(1) == 1 and kernels.selection_enabled()):
        return _log_softmax_topk(x, k, rows, shifts)
    if rows is not None:
        x = x.index_select(0, rows)
    if not normalize:
        return *torch.topk(x, k, dim=1), None
    num_rows, vocab = x.shape
    rows_per_chunk = max(1, CHUNK_BYTES // (4 * vocab))
    if num_rows <= rows_per_chunk:
        return *torch.topk(torch.log_softmax(x, dim=1), k, dim=1), None
    values = torch.empty((num_rows, k), dtype=torch.float32, device=x.device)
    tokens = torch.empty((num_rows, k), dtype=torch.long, device=x.device)
    buffer = torch.empty((rows_per_chunk, vocab), dtype=torch.float32, device=x.device)
    for start in range(0, num_rows, rows_per_chunk):
        end = min(start + rows_per_chunk, num_rows)
        chunk = buffer[:end - start]
        torch.log_softmax(x[start:end], dim=1, out=chunk)
        torch.topk(chunk, k, dim=1, out=(values[start:end], tokens[start:end]))
    return values, tokens, None


def top_candidates(lp: torch.Tensor, running: torch.Tensor, num_candidates: int, eos: torch.Tensor | None,
                   normalize: bool = False):
    """The K = `num_candidates` best over all rows and the whole vocabulary.

    Exact, without touching the full [rows, vocab] sum: adding a row's running score keeps the row's
    order, so each row only offers its best tokens. A shallow top-k of every row gives a threshold (the
    K-th best of what it offers); only rows whose shallow list reaches the threshold can hold more of
    the K best, and only those are searched deeper (4x deeper a round, until none can). `running` has one
    entry per row of `lp`, or one per beam when `lp` is the prompt's single row (HF's prompt copies).
    `normalize`: `lp` holds raw logits, ranked by their log-softmax (see the module's docstring).
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
    top_values, top_tokens, shifts = row_top(lp, k_shallow, normalize)
    # each row's last offered sum, before EOS is masked: a row whose last reaches the threshold may hold more
    last = top_values[:, -1] + running if lp.shape[0] == rows else None
    if eos is not None:
        top_values = top_values.masked_fill(torch.isin(top_tokens, eos), float("-inf"))
    # each row's best allowed score: its shallow list holds more than the masked EOS ids (or the
    # whole vocabulary), so a row whose list is all -inf allows nothing
    row_best = top_values.max(dim=1).values
    if lp.shape[0] != rows:
        top_values = top_values.expand(rows, k_shallow)
        top_tokens = top_tokens.expand(rows, k_shallow)
    sums = (top_values + running[:, None]).reshape(-1)
    num = min(num_candidates, sums.numel())
    values, flat = torch.topk(sums, num)
    if k_shallow == k_full:
        parents = torch.div(flat, k_shallow, rounding_mode="floor")
        return values, parents, top_tokens.reshape(-1)[flat], row_best
    # Deepen the rows that may hold more of the K best, 4x at a time (a step's rows mostly need a few
    # more; one row can need all K): each round's threshold only rises, so a row that falls below it
    # stays out, and a row whose new last offered sum still reaches it goes deeper in the next round.
    sum_rows = torch.arange(rows, device=device).repeat_interleave(k_shallow)
    sum_tokens = top_tokens.reshape(-1)
    k = k_shallow
    while k < k_full:
        deep = torch.nonzero(last >= values[-1]).squeeze(1)
        if not deep.numel():
            break
        k = min(k_full, 4 * k)
        deep_values, deep_tokens, _ = row_top(lp, k, normalize, rows=deep,
                                              shifts=None if shifts is None else shifts.index_select(0, deep))
        deep_running = running.index_select(0, deep)
        last = last.index_copy(0, deep, deep_values[:, -1] + deep_running)
        if eos is not None:
            deep_values = deep_values.masked_fill(torch.isin(deep_tokens, eos), float("-inf"))
        kept = ~torch.isin(sum_rows, deep)  # the deep rows' shallower offers, replaced by these
        sums = torch.cat((sums[kept], (deep_values + deep_running[:, None]).reshape(-1)))
        sum_rows = torch.cat((sum_rows[kept], deep.repeat_interleave(k)))
        sum_tokens = torch.cat((sum_tokens[kept], deep_tokens.reshape(-1)))
        values, flat = torch.topk(sums, num)
    return values, sum_rows[flat], sum_tokens[flat], row_best


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
