"""Constraints that leave no token (issue 41, item 2): refused at admission where the engine can tell
(one-token bans, with min_new_tokens' end ban, covering the vocabulary: an error naming the field),
otherwise the sequence ends where it stands with finish reason "banned", for greedy, sampling, beam
search (W=1 and W>1), group beams and alternatives: never a banned token, a nan or an empty answer.
The tiny Llama has 128 tokens and EOS 2; with `no_repeat_ngram_size=1` and `ignore_eos` every token
may come once, so after 128 - len(prompt) tokens nothing is left."""

from __future__ import annotations

import pytest
import torch

from widebeam.beam.hypothesis import BANNED
from widebeam.beam.search import BeamSearchState
from widebeam.errors import InvalidParameterError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

VOCAB, EOS = 128, 2
PROMPT = [5, 6, 7]
RUN_OUT = {"max_new_tokens": 200, "no_repeat_ngram_size": 1, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory="4MiB", max_beam_width=4)


def generate(llm, params, prompt=PROMPT):
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out


def assert_pools_whole(llm):
    pools = llm.engine.stats()["pools"]
    assert all(p["free_blocks"] == p["total_blocks"] for p in pools.values()), pools


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, **RUN_OUT),
    SamplingParams(temperature=1.0, seed=3, **RUN_OUT),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=4, **RUN_OUT),
    BeamSearchParams(beam_width=1, **RUN_OUT),
    BeamSearchParams(beam_width=4, **RUN_OUT),
    BeamSearchParams(beam_width=4, num_beam_groups=2, diversity_penalty=0.5, **RUN_OUT),
    BeamSearchParams(beam_width=3, return_alternatives=True, num_return_sequences=3, **RUN_OUT),
], ids=["greedy", "sampling", "top-p-k", "beam-W1", "beam-W4", "groups", "alternatives"])
def test_running_out_of_tokens_ends_with_banned(llm, params):
    out = generate(llm, params)
    width = getattr(params, "num_return_sequences", None) or 1
    assert len(out.outputs) == width
    for beam in out.outputs:
        # every token once (the n-gram rule of size 1 over prompt + output), then nothing was left
        assert beam.finish_reason == BANNED
        assert len(set(beam.token_ids)) == len(beam.token_ids) == VOCAB - len(PROMPT)
        assert not set(beam.token_ids) & set(PROMPT)
    assert_pools_whole(llm)


def test_a_beam_left_no_token_ends_while_the_others_go_on(llm):
    """Two-token words ban every continuation of one beam but EOS, which min_new_tokens withholds: that
    beam ends "banned" at its length (one token) while the search goes on, and it competes with the
    others by score (a negative length penalty ranks the short one first here); no returned beam breaks
    a ban, and the tree marks the node."""
    plain = generate(llm, BeamSearchParams(beam_width=4, max_new_tokens=6))
    first = plain.outputs[0].token_ids[0]
    params = BeamSearchParams(beam_width=4, max_new_tokens=6, min_new_tokens=3, length_penalty=-1.0,
                              return_tree=True, bad_words_ids=[[first, t] for t in range(VOCAB) if t != EOS])
    out = generate(llm, params)
    assert len(out.outputs) == 4
    assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == ([first], BANNED)
    assert all(b.finish_reason in ("length", "stop") and len(b.token_ids) >= 3 for b in out.outputs[1:])
    for beam in out.outputs:
        assert not any(a == first and b != EOS for a, b in zip(beam.token_ids, beam.token_ids[1:]))
    tree = out.tree
    (node,) = [n for n, reason in enumerate(tree["finish_reason"]) if reason == BANNED]
    assert (tree["token_id"][node], tree["step"][node], tree["rank"][node]) == (first, 1, 0)
    assert_pools_whole(llm)


@pytest.mark.parametrize("params, field", [
    (SamplingParams(temperature=0, max_new_tokens=6, min_new_tokens=4,
                    bad_words_ids=[[t] for t in range(VOCAB) if t != EOS]), "bad_words_ids"),
    (SamplingParams(temperature=0.8, seed=1, max_new_tokens=6, min_new_tokens=4,
                    bad_words_ids=[[t] for t in range(VOCAB) if t != EOS]), "bad_words_ids"),
    (BeamSearchParams(beam_width=4, max_new_tokens=6, min_new_tokens=4,
                      bad_words_ids=[[t] for t in range(VOCAB) if t != EOS]), "bad_words_ids"),
    (SamplingParams(temperature=0, max_new_tokens=6, min_new_tokens=2, stop_token_ids=list(range(VOCAB))),
     "stop_token_ids"),
    (BeamSearchParams(beam_width=2, max_new_tokens=6, min_new_tokens=1,
                      stop_token_ids=list(range(3, VOCAB)), bad_words_ids=[[0], [1]]), "bad_words_ids"),
], ids=["greedy", "sampling", "beam", "stop-ids", "stop-ids-and-bans"])
def test_bans_covering_the_vocabulary_are_refused_at_admission(llm, params, field):
    engine = llm.engine
    rejected = engine.stats()["rejected"]
    with pytest.raises(InvalidParameterError) as error:
        engine.add_request("everything-banned", {"prompt_token_ids": PROMPT}, params)
    assert error.value.param == field
    assert "no token could be generated first" in str(error.value) and "min_new_tokens" in str(error.value)
    assert not engine.has_unfinished() and engine.stats()["rejected"] == rejected + 1
    # the same bans without the minimum are fine: the end ids are left, and the output ends at once
    out = generate(llm, params.replace(min_new_tokens=0))
    assert out.outputs and all(len(b.token_ids) == 1 and b.finish_reason == "stop" for b in out.outputs)
    assert_pools_whole(llm)


def test_one_allowed_token_is_enough(llm):
    """Every token but EOS and one other banned, with min_new_tokens: admitted, the other token comes
    first, and the n-gram rule of size 1 then leaves only EOS (not yet allowed): "banned"."""
    params = SamplingParams(temperature=0, max_new_tokens=6, min_new_tokens=4, no_repeat_ngram_size=1,
                            bad_words_ids=[[t] for t in range(VOCAB) if t not in (EOS, 50)])
    out = generate(llm, params, prompt=[60, 61])
    assert out.outputs[0].token_ids == [50] and out.outputs[0].finish_reason == BANNED


@pytest.mark.parametrize("search", [{}, {"num_beam_groups": 2, "diversity_penalty": 0.5}],
                         ids=["beams", "groups"])
def test_a_catalogue_whose_every_item_a_word_bans_returns_the_cut_beams(llm, search):
    """Multi-token bans that kill every item (known only while decoding: the words follow the path):
    the beams that cannot go on come back "banned", not an empty answer; with one item left open only
    items come back (a cut beam is no item)."""
    items = [[10, 11], [10, 12], [13, 14, 15]]
    params = BeamSearchParams(beam_width=4, allowed_sequences=items, **search)
    killed = generate(llm, params.replace(bad_words_ids=[[10, 11], [10, 12], [13, 14]]))
    assert killed.outputs and all(b.finish_reason == BANNED for b in killed.outputs)
    assert {tuple(b.token_ids) for b in killed.outputs} <= {(10,), (13,)}
    open_one = generate(llm, params.replace(bad_words_ids=[[10, 11], [10, 12]]))
    assert open_one.outputs
    assert {(tuple(b.token_ids), b.finish_reason) for b in open_one.outputs} == {((13, 14, 15, EOS), "stop")}
    assert_pools_whole(llm)


# -- the search alone, on hand-made log-probs ---------------------------------------------------------
def test_the_search_ends_a_row_with_nothing_allowed():
    state = BeamSearchState(BeamSearchParams(beam_width=2, max_new_tokens=5, return_tree=True), 5, [EOS])
    first = torch.log_softmax(torch.tensor([[0.0, 3.0, -5.0, 2.0, 1.0]]), dim=-1)
    result = state.step(first)
    assert result.token_ids == [1, 3]
    rows = torch.log_softmax(torch.tensor([[0.0, 1.0, -5.0, 2.0, 1.0]] * 2), dim=-1)
    rows[0] = float("-inf")  # beam [1]: every continuation banned
    result = state.step(rows)
    assert result.parent_indices == [1, 1]  # only beam [3] goes on
    (ended,) = [h for h in state.finished if h.finish_reason == BANNED]
    assert ended.token_ids == [1] and ended.cumulative_logprob == pytest.approx(float(first[0, 1]))
    tree = state.tree.to_dict()
    (node,) = [n for n, reason in enumerate(tree["finish_reason"]) if reason == BANNED]
    assert tree["token_id"][node] == 1 and tree["step"][node] == 1 and tree["pruned_at"][node] is None


def test_a_prompt_with_nothing_allowed_returns_one_empty_banned_hypothesis():
    state = BeamSearchState(BeamSearchParams(beam_width=4, max_new_tokens=5), 5, [EOS])
    result = state.step(torch.full((1, 6), float("-inf")))
    assert result.empty and state.done
    (hypothesis,) = state.finalize()
    assert (hypothesis.token_ids, hypothesis.finish_reason, hypothesis.score) == ([], BANNED, 0.0)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_new_tokens=4),
                                    SamplingParams(temperature=1.0, seed=2, max_new_tokens=4),
                                    BeamSearchParams(beam_width=1, max_new_tokens=4),
                                    BeamSearchParams(beam_width=4, max_new_tokens=4, num_return_sequences=2)],
                         ids=["greedy", "sampling", "beam-W1", "beam-W4"])
def test_nothing_allowed_from_the_first_step_gives_one_empty_banned_choice(llm, params):
    """A caller's processor that bans every token (what admission cannot see): one choice with no
    tokens and finish reason "banned", the blocks freed."""
    def ban_everything(scores, num_generated_tokens):
        scores.fill_(float("-inf"))

    engine = llm.engine
    engine.add_request("ban-everything", {"prompt_token_ids": PROMPT}, params,
                       logits_processors=[ban_everything])
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    (done,) = [d for d in deltas if d.finished]
    assert done.error is None
    assert [(o.token_ids, o.finish_reason) for o in done.output.outputs] == [([], BANNED)]
    assert_pools_whole(llm)
