"""Bad input to generation: each gets a clear error, nothing leaks, the engine keeps serving."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tiny_models import save_tiny_model

from widebeam.errors import InvalidParameterError, UnsupportedModelError
from widebeam.llm import LLM
from widebeam.model.loading.sources import ModelNotFoundError
from widebeam.params import BeamSearchParams, SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", tokens_per_block=4,
               kv_cache_memory=40 * 4 * 2 * 2 * 2 * 16 * 4, max_seq_len=64)


def free_blocks(llm) -> int:
    return llm.stats()["pools"]["self"]["free_blocks"]


def test_sizing_is_what_was_asked(llm):
    pool = llm.stats()["pools"]["self"]
    assert pool["total_blocks"] == 40 and llm.max_seq_len == 64


def test_unknown_model_lists_aliases():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct.*gemma3-270m"):
        LLM("no-such-model")


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path):
    save_tiny_model(tmp_path, "gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*llama, qwen2, mistral"):
        LLM(str(tmp_path), device="cpu", kv_cache_memory="1MiB")


def test_prompt_longer_than_max_seq_len_names_both_numbers(llm):
    start = free_blocks(llm)
    with pytest.raises(InvalidParameterError, match=r"70 tokens but max_seq_len is 64") as info:
        llm.generate([{"prompt_token_ids": [5] * 70}], GREEDY, use_tqdm=False)
    assert info.value.param == "prompt"
    assert free_blocks(llm) == start


def test_prompt_plus_max_new_tokens_beyond_max_seq_len(llm):
    with pytest.raises(InvalidParameterError, match=r"60 tokens\) \+ max_new_tokens \(10\).*<= 4"):
        llm.generate([{"prompt_token_ids": [5] * 60}], GREEDY.replace(max_new_tokens=10), use_tqdm=False)


@pytest.mark.parametrize("prompt", [{"prompt_token_ids": []}, "", [999999]])
def test_empty_or_invalid_prompt(llm, prompt):
    with pytest.raises(InvalidParameterError):
        llm.generate([prompt], GREEDY, use_tqdm=False)


def test_text_prompt_without_tokenizer_says_to_pass_ids(llm):
    with pytest.raises(InvalidParameterError, match="prompt_token_ids"):
        llm.generate(["hello"], GREEDY, use_tqdm=False)


def test_missing_max_new_tokens_defaults_to_the_rest_of_max_seq_len(llm):
    (out,) = llm.generate([{"prompt_token_ids": [5] * 60}], GREEDY.replace(max_new_tokens=None),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_batch_with_one_impossible_prompt_runs_nothing_and_names_it(tiny_llama_dir):
    small = LLM(str(tiny_llama_dir), device="cpu", tokens_per_block=4,
                kv_cache_memory=10 * 4 * 2 * 2 * 2 * 16 * 4)
    assert small.stats()["pools"]["self"]["total_blocks"] == 10
    batch = [{"prompt_token_ids": [5] * 8}, {"prompt_token_ids": [6] * 39}]
    # one sequence can hold at most the pool's 40 tokens, so max_seq_len (40) rejects it first
    with pytest.raises(InvalidParameterError,
                       match=r"prompt 1 of the batch: .*39 tokens.*max_seq_len \(40\)"):
        small.generate(batch, GREEDY.replace(max_new_tokens=4), use_tqdm=False)
    stats = small.stats()
    assert stats["waiting"] == 0 and stats["running"] == 0 and stats["rejected"] == 1
    assert stats["pools"]["self"]["free_blocks"] == 10
    # and the engine still serves
    (ok,) = small.generate(batch[:1], GREEDY, use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 4


def test_requests_that_do_not_fit_together_wait_and_all_finish(tiny_llama_dir):
    small = LLM(str(tiny_llama_dir), device="cpu", tokens_per_block=4,
                kv_cache_memory=10 * 4 * 2 * 2 * 2 * 16 * 4)
    # each needs ceil((12 + 8) / 4) = 5 blocks: two run at once, the rest wait their turn
    outputs = small.generate([{"prompt_token_ids": [5 + i] * 12} for i in range(5)],
                             GREEDY.replace(max_new_tokens=8), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8] * 5
    assert small.stats()["pools"]["self"]["free_blocks"] == 10


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--model", "no-such-model"], "smollm2-135m-instruct"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    ],
)
def test_cli_generate_bad_input_is_one_line_exit_2(args, fragment):
    proc = subprocess.run([sys.executable, "-m", "widebeam", "generate", "hi", *args],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("changes", [{"top_p": 5e-324}, {"temperature": 1e-40}])
def test_extreme_sampling_values_degrade_to_greedy(llm, changes):
    sampled = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3, ignore_eos=True).replace(**changes)
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], sampled, use_tqdm=False)
    (greedy,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids


# -- a catalogue whose items cannot come back: refused at admission, not an empty answer ------------
ITEMS = [[11, 12, 13], [11, 14], [20, 21, 22, 23]]  # shortest 2 tokens, longest 4


def _refused(llm, params) -> InvalidParameterError:
    free = free_blocks(llm)
    with pytest.raises(InvalidParameterError) as info:
        llm.engine.add_request("refused", {"prompt_token_ids": [5, 6, 7]}, params)
    assert not llm.engine.has_unfinished() and free_blocks(llm) == free  # nothing queued, nothing held
    return info.value


@pytest.mark.parametrize("source", ["named", "inline"])
def test_a_catalogue_with_max_new_tokens_below_its_shortest_item_is_refused_naming_the_least(llm, source):
    llm.register_catalogue("short", ITEMS)
    where = {"catalogue": "short"} if source == "named" else {"allowed_sequences": ITEMS}
    for too_few in (1, 2):  # the shortest item needs 2 tokens and its EOS
        error = _refused(llm, BeamSearchParams(beam_width=3, max_new_tokens=too_few, **where))
        assert error.param == "max_new_tokens"
        assert "must be >= 3 with this catalogue" in str(error) and f"got {too_few}" in str(error)
        assert "max_tokens must be >= 3" in error.render({"max_new_tokens": "max_tokens"})
    # the least that fits returns the shortest item (and only it: no other fits), then EOS
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                          BeamSearchParams(beam_width=3, max_new_tokens=3, **where), use_tqdm=False)
    assert [beam.token_ids[:-1] for beam in out.outputs] == [[11, 14]]


def test_a_catalogue_with_min_new_tokens_past_its_longest_item_is_refused(llm):
    llm.register_catalogue("short", ITEMS)
    params = BeamSearchParams(beam_width=3, max_new_tokens=8, min_new_tokens=5, catalogue="short")
    error = _refused(llm, params)
    assert error.param == "min_new_tokens" and "must be <= 4 with this catalogue" in str(error)
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                          params.replace(min_new_tokens=4), use_tqdm=False)
    assert [beam.token_ids[:-1] for beam in out.outputs] == [[20, 21, 22, 23]]


@pytest.mark.parametrize("source", ["named", "inline"])
@pytest.mark.parametrize(("field", "value"), [("stop", ("x",)), ("stop_token_ids", (12,))])
def test_a_catalogue_with_stop_or_stop_token_ids_is_refused_naming_both(source, field, value):
    where = {"catalogue": "short"} if source == "named" else {"allowed_sequences": ITEMS}
    with pytest.raises(InvalidParameterError) as info:
        BeamSearchParams(beam_width=3, **where, **{field: value})
    constraint = "catalogue" if source == "named" else "allowed_sequences"
    assert info.value.param == field
    assert str(info.value).startswith(f"{field} and {constraint} exclude each other"), info.value
