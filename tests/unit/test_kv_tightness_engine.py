"""The KV bound is reached through the engine's public path, not only on the bare allocator.

A logits processor makes every beam diverge at the first step and then continue its own line to
`max_new_tokens` (each row has one good token, so the best W candidates are one per row: no beam is
pruned, none is forked again), so each beam owns its partial prompt block and every generated block.
That is the worst case the bound describes, and the engine must reach it exactly, in the full
(`self`), sliding-window and cross pools.

What the engine writes: the prompt (P tokens, once), then one token per beam per decode step; the
N-th generated token is chosen but never fed, so a beam's table ends at P + N - 1 tokens, and at
N = 1 no decode step runs (the prompt alone, held once). The bound (`kv/budget.py`) counts what is
written, so the peak equals `required_blocks` in every configuration, among them those where the
N-th token would have opened a block ((P mod T + N - 1) mod T == 0) and N = 1.
"""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_marian, save_tiny_model

from widebeam.kv.budget import cross_attention_blocks, full_attention_blocks, sliding_window_blocks
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams


def ceil_div(a, b):
    return -(-a // b)


def diverge(beam_width):
    """Every beam diverges at the first step, then continues only itself."""
    def processor(scores, num_generated_tokens):
        scores.fill_(-1e4)
        if num_generated_tokens == 0:  # one row: the prompt; W distinct children
            for j in range(beam_width):
                scores[0, 3 + j] = -0.01 * j
        else:
            for row in range(scores.shape[0]):
                scores[row, 3 + (7 * row + num_generated_tokens) % 100] = 0.0
    return processor


def run(llm, prompt_token_ids, params):
    engine = llm.engine
    start = {name: pool["free_blocks"] for name, pool in llm.stats()["pools"].items()}
    engine.add_request("tight", {"prompt_token_ids": prompt_token_ids}, params,
                       logits_processors=[diverge(params.beam_width)])
    output = None
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                output = delta.output
    # every block comes back
    assert {name: pool["free_blocks"] for name, pool in llm.stats()["pools"].items()} == start
    assert len(output.outputs) == params.beam_width
    assert all(len(beam.token_ids) == params.max_new_tokens for beam in output.outputs)
    return output


def written_blocks(prompt_tokens, max_new_tokens, beam_width, tokens_per_block):
    """The full-attention blocks of what the engine writes, counted by hand: the full prompt blocks
    once, and per beam its partial prompt block and N - 1 generated tokens; N = 1 is the prompt alone."""
    p, n, w, t = prompt_tokens, max_new_tokens, beam_width, tokens_per_block
    if n <= 1:
        return ceil_div(p, t)
    return p // t + ceil_div(p % t + n - 1, t) * w


WINDOW = 8
# (P, N, W, T): prompt, max_new_tokens, beam width, tokens per block. Block boundaries on both sides,
# prompts shorter and longer than the window, the issue's own P=40, N=30, W=4, T=4.
CASES = [
    (40, 30, 4, 4),
    (5, 2, 3, 4),
    (5, 4, 3, 4),  # the N-th token would have opened a block: once one block per beam of slack
    (8, 9, 3, 4),
    (8, 12, 3, 4),
    (13, 12, 5, 4),
    (13, 1, 3, 4),  # the prompt alone
    (3, 20, 6, 4),
    (21, 17, 2, 8),
    (16, 16, 4, 8),
    (9, 6, 8, 8),
    (30, 11, 3, 2),
]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3-tight")
    save_tiny_model(path, "gemma3_text", num_hidden_layers=2, tie_word_embeddings=True, head_dim=16,
                    sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    return path


@pytest.fixture(scope="module")
def gemma3_llms(gemma3_dir):
    llms = {}

    def get(tokens_per_block):
        if tokens_per_block not in llms:
            llms[tokens_per_block] = LLM(str(gemma3_dir), device="cpu", tokens_per_block=tokens_per_block,
                                         kv_cache_memory="4MiB", max_beam_width=16,
                                         enable_prefix_caching=False)
        return llms[tokens_per_block]
    return get


@pytest.mark.parametrize("prompt_tokens,max_new_tokens,beam_width,tokens_per_block", CASES)
def test_every_beam_diverging_reaches_the_bound_in_self_and_sliding_pools(
        gemma3_llms, prompt_tokens, max_new_tokens, beam_width, tokens_per_block):
    llm = gemma3_llms(tokens_per_block)
    p, n, w, t = prompt_tokens, max_new_tokens, beam_width, tokens_per_block
    output = run(llm, list(range(3, 3 + p)),
                 BeamSearchParams(beam_width=w, max_new_tokens=n, ignore_eos=True))
    sliding = f"sliding_{WINDOW}"
    chunk = llm.engine.scheduler.max_num_batched_tokens
    assert output.required_blocks["self"] == full_attention_blocks(p, n, w, t)
    assert output.required_blocks[sliding] == sliding_window_blocks(p, n, w, t, WINDOW, chunk)

    # the peak is the exact count of what the engine writes ...
    exact_self = written_blocks(p, n, w, t)
    exact_sliding = sliding_window_blocks(p, n, w, t, WINDOW, chunk)
    assert output.peak_blocks == {"self": exact_self, sliding: exact_sliding}
    # ... which is `required_blocks`, the N-th token's block and N = 1 included
    assert output.peak_blocks == output.required_blocks
    if n > 1 and (p % t + n - 1) % t == 0:  # where the bound once counted one block per beam more
        assert full_attention_blocks(p, n, w, t) == exact_self
    elif n == 1:  # the prompt alone, its partial block once
        assert output.required_blocks["self"] == ceil_div(p, t)


@pytest.fixture(scope="module")
def marian_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-marian-tight")
    save_tiny_marian(path)
    return LLM(str(path), device="cpu", tokens_per_block=4, kv_cache_memory="4MiB", max_beam_width=16,
               enable_prefix_caching=False)


# (E, N, W): source tokens, max_new_tokens, beam width; the decoder prompt is the start token (P = 1)
MARIAN_CASES = [(7, 8, 4), (13, 5, 6), (4, 12, 3), (1, 3, 2)]


@pytest.mark.parametrize("encoder_tokens,max_new_tokens,beam_width", MARIAN_CASES)
def test_encoder_decoder_reaches_the_bound_in_self_and_cross_pools(marian_llm, encoder_tokens, max_new_tokens,
                                                                   beam_width):
    e, n, w, t = encoder_tokens, max_new_tokens, beam_width, 4
    output = run(marian_llm, list(range(3, 3 + e)),
                 BeamSearchParams(beam_width=w, max_new_tokens=n, ignore_eos=True))
    assert output.required_blocks["cross"] == output.peak_blocks["cross"] == cross_attention_blocks(e, t)
    assert output.required_blocks["self"] == full_attention_blocks(1, n, w, t)
    assert output.peak_blocks["self"] == written_blocks(1, n, w, t)
    assert output.peak_blocks == output.required_blocks  # n % t == 0 (the N-th token's block) included


@pytest.fixture(scope="module")
def speculative_llms(tiny_llama_dir):
    llms = {}

    def get(num_draft_tokens):
        if num_draft_tokens not in llms:  # the model drafts for itself; every round drafts D nodes
            llms[num_draft_tokens] = LLM(str(tiny_llama_dir), device="cpu", tokens_per_block=4,
                                         kv_cache_memory="4MiB", max_beam_width=16,
                                         enable_prefix_caching=False, speculative_model=str(tiny_llama_dir),
                                         num_speculative_tokens=num_draft_tokens, speculative_adaptive=False)
        return llms[num_draft_tokens]
    return get


# (P, N, W, D) at T = 4: the N-th token's block, N = 1 (no round at all), N = 2 (one round, at g = 1)
SPECULATIVE_CASES = [(5, 4, 3, 2), (8, 9, 3, 3), (13, 1, 3, 2), (3, 6, 4, 1), (10, 2, 2, 4), (6, 7, 2, 2)]


@pytest.mark.parametrize("prompt_tokens,max_new_tokens,beam_width,num_draft_tokens", SPECULATIVE_CASES)
def test_speculative_rounds_reach_the_bound_in_the_target_and_draft_pools(
        speculative_llms, prompt_tokens, max_new_tokens, beam_width, num_draft_tokens):
    """The target's processor makes every beam diverge; the draft (which does not run it) is rejected,
    so each round takes one step and the last begins at g = N - 1, taking its D slots: through
    position P + N - 2 + D, what the bound counts, in the target's pool and the draft's alike."""
    llm = speculative_llms(num_draft_tokens)
    p, n, w, d, t = prompt_tokens, max_new_tokens, beam_width, num_draft_tokens, 4
    params = BeamSearchParams(beam_width=w, max_new_tokens=n, ignore_eos=True)
    output = run(llm, list(range(3, 3 + p)), params)
    assert set(output.required_blocks) == {"self", "draft"}
    assert output.required_blocks == dict.fromkeys(["self", "draft"], full_attention_blocks(p, n, w, t, d))
    assert output.peak_blocks == output.required_blocks


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_a_preempted_worst_case_still_peaks_at_the_bound(tiny_llama_dir, policy):
    """Preempted mid-decode, the diverging request resumes (prompt shared again, each beam re-feeding its
    own tokens into blocks of its own, as it held them) and runs to its worst case: the peak it reports
    is the bound, neither more (lives are not added) nor less."""
    p, n, w, t = 13, 12, 5, 4
    llm = LLM(str(tiny_llama_dir), device="cpu", tokens_per_block=t, kv_cache_memory="4MiB",
              max_beam_width=16, enable_prefix_caching=False, scheduling_policy=policy)
    engine = llm.engine
    engine.add_request("tight", {"prompt_token_ids": list(range(3, 3 + p))},
                       BeamSearchParams(beam_width=w, max_new_tokens=n, ignore_eos=True),
                       logits_processors=[diverge(w)])
    request, output, preempted = engine._requests["tight"], None, False
    while engine.has_unfinished():
        if not preempted and request.decoder.num_generated_tokens == 6:
            preempted = engine.scheduler.preempt("tight")
        for delta in engine.step():
            if delta.finished:
                output = delta.output
    assert preempted and request.num_preemptions == 1
    assert all(len(beam.token_ids) == n for beam in output.outputs)
    assert output.peak_blocks == output.required_blocks == {"self": written_blocks(p, n, w, t)}
