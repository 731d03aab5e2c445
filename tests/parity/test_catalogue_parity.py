"""Catalogue-constrained beam search equals transformers' beam search with
`prefix_allowed_tokens_fn` returning the same allowed set (a trie node's children, and EOS where an
item ends): the same sequences and scores, W in {1, 4, 16, 64}, shared prefixes, items of unequal
lengths, items that are prefixes of others, several requests with different catalogues in one
batch; and over random catalogues every returned sequence is an item of its catalogue."""

from __future__ import annotations

import random

import pytest
import torch
from beam_checks import assert_beams_match

from widebeam.engine import LLMEngine
from widebeam.params import BeamSearchParams

EOS, PAD = 2, 0
PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
OPTIONS = {"device": "cpu", "kv_cache_memory": "64MiB", "tokens_per_block": 4, "max_beam_width": 64,
           "max_num_batched_tokens": 512}


def random_catalogue(seed: int, num_items: int, min_len: int = 1, max_len: int = 4, tokens=range(3, 128)):
    rng = random.Random(seed)
    tokens = list(tokens)
    items = {tuple(rng.choice(tokens) for _ in range(rng.randint(min_len, max_len)))
             for _ in range(num_items)}
    # shared prefixes and prefix items: extend some items, keep their prefixes as items too
    for item in list(items)[: num_items // 5]:
        items.add(item + (rng.choice(tokens),))
    return sorted(items)


def allowed_fn(items):
    """HF's `prefix_allowed_tokens_fn` for these items after `prompt_len` tokens."""
    children, ends = {}, set()
    for item in items:
        for i in range(len(item)):
            children.setdefault(tuple(item[:i]), set()).add(item[i])
        ends.add(tuple(item))

    def fn(prompt_len):
        def allowed(batch_id, input_ids):
            prefix = tuple(input_ids[prompt_len:].tolist())
            out = sorted(children.get(prefix, ()))
            if prefix in ends:
                out.append(EOS)
            return out or [EOS]  # a dead prefix (HF needs a non-empty set); its score is -inf anyway
        return allowed
    return fn


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(str(tiny_llama_dir), **OPTIONS)


def hf_beams(hf_model, prompt, items, width, max_new_tokens, **kwargs):
    with torch.no_grad():
        return hf_model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                                 do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=EOS,
                                 pad_token_id=PAD, prefix_allowed_tokens_fn=allowed_fn(items)(len(prompt)),
                                 return_dict_in_generate=True, output_scores=True, **kwargs)


def run(engine, requests):
    free = engine.cache.num_free_blocks()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"c{i}", {"prompt_token_ids": prompt}, params)
    outputs = {}
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error is None, delta.error
            if delta.finished:
                outputs[delta.request_id] = delta.output
    assert engine.cache.num_free_blocks() == free
    return [outputs[f"c{i}"] for i in range(len(requests))]


@pytest.mark.parametrize("width", [1, 4, 16, 64])
def test_constrained_beams_equal_transformers(engine, hf_model, width):
    items = random_catalogue(width, num_items=400)
    max_new_tokens = max(len(item) for item in items) + 1
    for prompt in PROMPTS:
        expected = hf_beams(hf_model, prompt, items, width, max_new_tokens)
        [output] = run(engine, [(prompt, BeamSearchParams(beam_width=width, allowed_sequences=items))])
        assert len(output.outputs) == width and output.outputs[0].token_ids[-1] == EOS
        assert_beams_match(output, expected, len(prompt), PAD, EOS, width, f"W={width}")
        for beam in output.outputs:
            assert tuple(beam.token_ids[:-1]) in set(items)


def test_several_catalogues_in_one_batch(engine, hf_model):
    """Different catalogues, registered and inline, decoding in one batch: each as transformers alone."""
    catalogues = {name: random_catalogue(seed, num_items=150) for name, seed in (("a", 1), ("b", 2))}
    for name, items in catalogues.items():
        engine.register_catalogue(name, items)
    inline = random_catalogue(3, num_items=80, max_len=3)
    requests = [(PROMPTS[0], BeamSearchParams(beam_width=8, catalogue="a")),
                (PROMPTS[1], BeamSearchParams(beam_width=4, catalogue="b")),
                (PROMPTS[0], BeamSearchParams(beam_width=6, allowed_sequences=inline)),
                (PROMPTS[1], BeamSearchParams(beam_width=8, catalogue="a", length_penalty=0.5))]
    outputs = run(engine, requests)
    assert [len(o.outputs) for o in outputs] == [p.beam_width for _, p in requests]
    for (prompt, params), output, items in zip(requests, outputs, [catalogues["a"], catalogues["b"], inline,
                                                                   catalogues["a"]]):
        expected = hf_beams(hf_model, prompt, items, params.beam_width, max(len(i) for i in items) + 1,
                            length_penalty=params.length_penalty)
        assert_beams_match(output, expected, len(prompt), PAD, EOS, params.beam_width, str(params))


def test_an_exhausted_catalogue_returns_fewer_beams_never_invalid_ones(engine):
    items = [[40, 41], [40, 42, 43], [50]]
    [output] = run(engine, [(PROMPTS[0], BeamSearchParams(beam_width=8, allowed_sequences=items))])
    returned = sorted(tuple(beam.token_ids) for beam in output.outputs)
    assert returned == sorted(tuple(item) + (EOS,) for item in items)
    scores = [beam.score for beam in output.outputs]
    assert scores == sorted(scores, reverse=True) and all(s > float("-inf") for s in scores)


@pytest.mark.parametrize("seed", range(6))
def test_every_returned_sequence_is_an_item(engine, seed):
    rng = random.Random(seed)
    items = random_catalogue(100 + seed, num_items=rng.choice([3, 20, 200]), max_len=rng.choice([2, 5]),
                             tokens=range(3, rng.choice([6, 40, 128])))
    width = rng.choice([2, 8, 32])
    [output] = run(engine, [(PROMPTS[seed % 2],
                             BeamSearchParams(beam_width=width, allowed_sequences=items,
                                              length_penalty=rng.choice([0.0, 1.0, 2.0])))])
    assert output.outputs
    for beam in output.outputs:
        assert beam.token_ids[-1] == EOS and tuple(beam.token_ids[:-1]) in set(items), beam.token_ids


def test_the_masked_path_equals_the_allowed_set_path(engine):
    """A catalogue alone is ranked over its allowed set; with another processor beside it the rows
    are masked densely instead: the same beams and scores either way."""
    items = random_catalogue(7, num_items=300)
    params = BeamSearchParams(beam_width=16, allowed_sequences=items, length_penalty=0.8)
    outputs = []
    for processors in ((), (lambda scores, num_generated: None,)):
        free = engine.cache.num_free_blocks()
        engine.add_request("p", {"prompt_token_ids": PROMPTS[1]}, params, logits_processors=processors)
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.finished:
                    outputs.append([(b.token_ids, b.score) for b in delta.output.outputs])
        assert engine.cache.num_free_blocks() == free
    sparse, dense = outputs
    assert [t for t, _ in sparse] == [t for t, _ in dense] and len(sparse) == 16
    for (_, a), (_, b) in zip(sparse, dense):
        assert a == pytest.approx(b, rel=1e-6)


def brute_force_ranking(hf_model, prompt, items, max_new_tokens, length_penalty):
    """Every item that fits (its tokens and EOS within `max_new_tokens`) scored from the definition:
    the summed log-probs of item + EOS after the prompt over `(len(item) + 1) ** length_penalty`,
    best first. Exhaustive, so it is the answer of a beam search whose width never prunes."""
    ranked = []
    with torch.no_grad():
        for item in items:
            if len(item) + 1 > max_new_tokens:
                continue
            generated = list(item) + [EOS]
            logits = hf_model(torch.tensor([list(prompt) + generated])).logits[0].float()
            logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
            total = float(logprobs[torch.arange(len(generated)), torch.tensor(generated)].sum())
            ranked.append((total / len(generated) ** length_penalty, tuple(generated)))
    ranked.sort(reverse=True)
    return ranked


@pytest.mark.parametrize("max_new_tokens", [2, 3, 4])
def test_max_new_tokens_below_the_longest_item_returns_whole_items_only(engine, hf_model, max_new_tokens):
    """`max_new_tokens` shorter than the longest item (and >= the shortest + EOS): every returned
    sequence is a whole item + EOS, never a cut one, and the ranking equals a brute force over the
    items that fit. The width (16) exceeds the trie's nodes at any depth, so nothing is pruned."""
    items = [(40,), (41, 42), (41, 43), (44, 45, 46), (44, 45), (47, 48, 49, 50), (41, 42, 51, 52, 53),
             (54, 55, 56, 57, 58, 59)]
    assert min(map(len, items)) + 1 <= max_new_tokens < max(map(len, items))
    for prompt in PROMPTS:
        for length_penalty in (1.0, 0.0):
            params = BeamSearchParams(beam_width=16, allowed_sequences=items, max_new_tokens=max_new_tokens,
                                      length_penalty=length_penalty)
            [output] = run(engine, [(prompt, params)])
            expected = brute_force_ranking(hf_model, prompt, items, max_new_tokens, length_penalty)
            got = [(beam.score, tuple(beam.token_ids)) for beam in output.outputs]
            for _, tokens in got:
                assert tokens[-1] == EOS and tokens[:-1] in set(items), (max_new_tokens, tokens)
            assert [t for _, t in got] == [t for _, t in expected], (max_new_tokens, length_penalty)
            for (score, _), (reference, _) in zip(got, expected, strict=True):
                assert score == pytest.approx(reference, rel=1e-4, abs=1e-5)
