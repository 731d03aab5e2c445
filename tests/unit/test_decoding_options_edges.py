"""The decoding options at every edge: OpenAI extra fields (server/protocol.py), batch rows (batch/rows.py)
and `widebeam generate` flags (cli.py) reach the same params fields, and a bad value is refused naming
the field. Nothing here runs a model but the last test (the tiny Llama, in-process)."""

from __future__ import annotations

import pytest

from widebeam.batch.rows import parse_row
from widebeam.cli import build_parser
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.server.protocol import plan_request
from widebeam.server.schemas import ApiError, CompletionRequest


def test_openai_extra_fields_reach_the_params():
    plan = plan_request(CompletionRequest(prompt="hi", no_repeat_ngram_size=3, bad_words_ids=[[4, 5], [6]],
                                          max_input_length=20))
    (params,) = plan.params
    assert isinstance(params, SamplingParams)
    assert (params.no_repeat_ngram_size, params.bad_words_ids, params.max_input_length) == (
        3, ((4, 5), (6,)), 20)
    plan = plan_request(CompletionRequest(prompt="hi", use_beam_search=True, n=2, beam_width=4, patience=1.5,
                                          bad_words_ids=[[7, 8]]))
    (params,) = plan.params
    assert isinstance(params, BeamSearchParams)
    assert (params.patience, params.bad_words_ids) == (1.5, ((7, 8),))
    plan = plan_request(CompletionRequest(prompt="hi", use_beam_search=True, n=3, decoder_prefix=[4],
                                          return_alternatives=True, min_alternative_expansion_prob=0.1,
                                          prefix_bias_beta=None))
    (params,) = plan.params
    assert (params.return_alternatives, params.min_alternative_expansion_prob) == (True, 0.1)


@pytest.mark.parametrize("fields, param", [
    ({"patience": 2.0}, "patience"),  # sampling
    ({"prefix_bias_beta": 0.5, "decoder_prefix": [3]}, "prefix_bias_beta"),  # sampling
    ({"return_alternatives": True}, "return_alternatives"),  # sampling
    ({"use_beam_search": True, "n": 2, "min_alternative_expansion_prob": 0.2},
     "min_alternative_expansion_prob"),
    ({"use_beam_search": True, "n": 1, "beam_width": 2, "prefix_bias_beta": 0.5}, "prefix_bias_beta"),
    ({"use_beam_search": True, "n": 1, "beam_width": 1, "patience": 2.0}, "patience"),  # greedy
    ({"bad_words_ids": [[]]}, "bad_words_ids"),
    ({"no_repeat_ngram_size": 2, "response_format": {"type": "json_object"}}, "no_repeat_ngram_size"),
])
def test_openai_refusals_name_the_field(fields, param):
    with pytest.raises(ApiError) as excinfo:
        plan_request(CompletionRequest(prompt="hi", **fields))
    assert excinfo.value.param == param
    assert param in excinfo.value.message


def test_batch_rows_take_the_options_as_json_cells():
    row = parse_row({"prompt": "x", "bad_words_ids": "[[1, 2], [3]]", "no_repeat_ngram_size": "2",
                     "max_input_length": 8.0}, 0, {})
    assert row.error is None
    assert (row.params.bad_words_ids, row.params.no_repeat_ngram_size, row.params.max_input_length) == (
        ((1, 2), (3,)), 2, 8)
    row = parse_row({"prompt": "x", "beam_width": 4, "patience": 2}, 1, {"patience": 1.5})
    assert isinstance(row.params, BeamSearchParams) and row.params.patience == 2.0
    row = parse_row({"prompt": "x", "bad_words_ids": "[[1, -2]]"}, 2, {})
    assert row.error.startswith("row 2, column bad_words_ids")


def test_generate_flags_parse():
    args = build_parser("generate").parse_args(["generate", "hi", "--no-repeat-ngram-size", "2",
                                                "--bad-words-ids", "4,5", "--bad-words-ids", "9",
                                                "--max-input-length", "16", "--patience", "2",
                                                "--prefix-bias-beta", "0.5"])
    assert (args.no_repeat_ngram_size, args.bad_words_ids, args.max_input_length, args.patience,
            args.prefix_bias_beta) == (2, [(4, 5), (9,)], 16, 2.0, 0.5)


def test_the_options_run_together(tiny_llama_dir):
    """patience, an n-gram ban and truncation in one request (the tiny Llama has no tokenizer, so the
    generate command, which takes text, is not run here)."""
    from widebeam.llm import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory="4MiB")
    params = BeamSearchParams(beam_width=2, max_new_tokens=6, patience=2.0, no_repeat_ngram_size=1,
                              max_input_length=3)
    (out,) = llm.generate([{"prompt_token_ids": [9, 9, 5, 6, 7]}], params, use_tqdm=False)
    assert out.prompt_token_ids == [5, 6, 7]
    for beam in out.outputs:  # no token twice in prompt + beam
        assert len(set(beam.token_ids) | {5, 6, 7}) == len(beam.token_ids) + 3


def test_bans_work_inside_a_catalogue(tiny_llama_dir):
    """A catalogue with a ban: the banned item is never returned, the others are (whole, EOS-ended)."""
    from widebeam.llm import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory="4MiB", max_beam_width=4)
    items = [[10, 11, 12], [10, 13], [14, 15], [16]]
    params = BeamSearchParams(beam_width=4, allowed_sequences=items)
    (plain,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert sorted(b.token_ids[:-1] for b in plain.outputs) == sorted(items)
    (banned,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params.replace(bad_words_ids=[[10, 11]]),
                             use_tqdm=False)
    assert sorted(b.token_ids[:-1] for b in banned.outputs) == sorted(items[1:])
