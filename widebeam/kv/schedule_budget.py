"""Block bounds for beam-width schedules (budget.py holds the constant-width ones and the notation).

A schedule (w_1, ..., w_L) gives the width of each beam-search step: step k chooses the k-th generated
token and keeps w_k beams (w_L for every k > L). The bound below is the schedule's own worst case; it
is never W_max times the length.
"""

from __future__ import annotations

from widebeam.kv.budget import blocks_spanned, check_non_negative, sliding_prefill_blocks


def width_at_step(schedule: tuple[int, ...], step: int) -> int:
    """w_k: the width of step k >= 1 (the last width repeats)."""
    return schedule[min(step, len(schedule)) - 1]


def scheduled_blocks(prompt_tokens: int, max_new_tokens: int, schedule: tuple[int, ...],
                     tokens_per_block: int, window_tokens: int | None = None,
                     beams_own_all: bool = False) -> int:
    """The most blocks a request whose beam width follows `schedule` holds in a full-attention pool
    (`window_tokens=None`) or in the decode steps of a sliding-window one (no draft nor re-fed
    tokens: D = R = 0, which the engine enforces for schedules).

    Closed form. Decode step k = 1 .. N - 1 feeds the k-th generated token at position x = P + k - 1
    in each of its w_k live beams, having trimmed a window to keys from a = max(0, x - w + 1)
    (a = 0 for full attention). With E = floor(P/T) * T (the end of the shared full prompt blocks),
    the request then holds, for block b (positions bT .. bT + T - 1):

        blocks(k) = #{b < E/T : b spans a key >= a}                       (prompt, shared: once)
                  + w_k                                                   (b = floor(x/T), written now)
                  + sum over E/T <= b < floor(x/T), (b+1)T - 1 >= a of  min(w_s : s_b <= s <= k)

    where s_b = (b + 1)T - P is the step that wrote b's last position, and the bound is
    `max(ceil(P/T), max_k blocks(k))` (N <= 1: `ceil(P/T)`, the prompt alone).

    Proof (upper bound). Full prompt blocks are written once in the prefill and only shared. Block
    floor(x/T) is being written by every live beam, each into its own copy (copy-on-write): at most
    w_k. A block b below it is complete: after step s_b nobody writes it again, so each copy held at
    step k is one of those the w_{s_b} beams of step s_b held, inherited through forks. Every beam of
    step k descends from one beam of each step s in [s_b, k], so the copies it holds number at most
    the fewest beams of any such step: min(w_s : s_b <= s <= k). A pruned beam's blocks are released
    before the kept ones fork (`RequestKV.reorder`), and a window's trimmed blocks leave before any
    append (`RequestKV.decode_slots`), so nothing else is held at the step's allocation, which is
    where the count peaks (a reorder never allocates).

    Reached exactly: let every beam diverge (its own token at every step), and when the width falls
    keep parents spread over the ancestors (as many distinct ancestors of every earlier step as the
    new width allows: the ancestor partitions are nested, so one choice of parents serves every
    step); when it grows, continue every parent. Then each term is met with equality at once
    (tests/unit/test_kv_schedule_traces.py drives `RequestKV` through such traces).

    For a constant schedule (W) every min is W and this is `full_attention_blocks` (D = 0):
    floor(P/T) + ceil((P mod T + N - 1)/T) * W, and the sliding bound's decode term.

    `beams_own_all`: a request preempted and resumed re-feeds each live beam's tokens into blocks of
    its own (`Request._resume`), so at a resume at step k every beam owns every block it reads; the
    min is then w_k for every block (a bound at least as large, reached by a preemption at the worst
    step). The engine asks for it under the `max_utilization` policy only.

    Computed in O(N): the mins are nondecreasing in b (a later block's range of steps is a suffix of
    an earlier one's), so they are kept as runs (value, count) on a stack that step k caps at w_k
    (pop the runs above it, merge them), a window drops from its bottom, and a block enters on top.
    """
    if not schedule or any(w < 1 for w in schedule):
        raise ValueError(f"schedule must hold widths >= 1, got {schedule}")
    check_non_negative(prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens)
    t = tokens_per_block
    if t < 1:
        raise ValueError("tokens_per_block must be >= 1")
    best = -(-prompt_tokens // t) if window_tokens is None else 0
    if max_new_tokens <= 1:
        return best
    return max(best, max(_scheduled_step_blocks(prompt_tokens, max_new_tokens, schedule, t, window_tokens,
                                                beams_own_all)))


def _scheduled_step_blocks(prompt_tokens: int, max_new_tokens: int, schedule: tuple[int, ...],
                           tokens_per_block: int, window_tokens: int | None,
                           beams_own_all: bool) -> list[int]:
    """blocks(k) of `scheduled_blocks` for k = 1 .. N - 1, in order."""
    t, p = tokens_per_block, prompt_tokens
    first_own = p // t  # the first block a beam may own (the partial prompt block, or the next)
    runs: list[list[int]] = []  # [min width, blocks] bottom (oldest block) to top; mins nondecreasing
    bottom = 0  # index of the bottom run still in the window
    next_block = first_own  # the next complete own block to enter the runs
    complete_sum = 0  # sum of min * count over the runs
    out = []
    for k in range(1, max_new_tokens):
        x = p + k - 1
        width = width_at_step(schedule, k)
        current = x // t
        # blocks completed by an earlier step enter with their min so far: w_{s_b} = w_{k-1} caps them
        while next_block < current:
            value = width_at_step(schedule, k - 1)
            if len(runs) > bottom and runs[-1][0] == value:
                runs[-1][1] += 1
            else:
                runs.append([value, 1])
            complete_sum += value
            next_block += 1
        # cap every min at w_k (or, re-fed beams, set it to w_k)
        merged = 0
        while len(runs) > bottom and (beams_own_all or runs[-1][0] > width):
            value, count = runs.pop()
            complete_sum -= value * count
            merged += count
        if merged:
            runs.append([width, merged])
            complete_sum += width * merged
        window_start = 0 if window_tokens is None else max(0, x - window_tokens + 1)
        first_visible = window_start // t
        # drop whole blocks that left the window, from the oldest
        dropped_to = max(first_visible, first_own)
        oldest = next_block - sum(c for _, c in runs[bottom:])
        while oldest < dropped_to and len(runs) > bottom:
            run = runs[bottom]
            take = min(run[1], dropped_to - oldest)
            run[1] -= take
            complete_sum -= run[0] * take
            oldest += take
            if run[1] == 0:
                bottom += 1
        shared = blocks_spanned(window_start, first_own * t - 1, t)
        out.append(shared + complete_sum + width)
    return out


def scheduled_sliding_window_blocks(prompt_tokens: int, max_new_tokens: int, schedule: tuple[int, ...],
                                    tokens_per_block: int, window_tokens: int,
                                    prefill_chunk_tokens: int | None = None, cached_prompt_tokens: int = 0,
                                    beams_own_all: bool = False) -> int:
    """`sliding_window_blocks` for a width schedule (D = R = 0): the prefill term is the same (one
    sequence, whatever the widths), the decode term is `scheduled_blocks` with the window, and like
    there it never exceeds the full-attention count."""
    if window_tokens < 1:
        raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
    t = tokens_per_block
    full = scheduled_blocks(prompt_tokens, max_new_tokens, schedule, t, None, beams_own_all)
    prefill_blocks = sliding_prefill_blocks(prompt_tokens, window_tokens, t, prefill_chunk_tokens,
                                            cached_prompt_tokens)
    decode_blocks = scheduled_blocks(prompt_tokens, max_new_tokens, schedule, t, window_tokens, beams_own_all)
    return min(full, max(prefill_blocks, decode_blocks))
