"""`return_tree` through the engine: the tree's ranked nodes are the returned hypotheses (token ids,
cumulative log-probs, scores), plainly, inside a catalogue, under a JSON schema and with speculative
decoding, whose tree is the target's search: the tree of the same engine without drafts, node for
node (scores to 1e-4)."""

from __future__ import annotations

import pytest

from widebeam.beam.tree import ranked_hypotheses
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

PROMPT = "The colours of the sea are"
SCHEMA = {"type": "json_schema", "json_schema": {"name": "pick", "schema": {
    "type": "object", "additionalProperties": False, "required": ["colour"],
    "properties": {"colour": {"enum": ["red", "green", "blue"]}}}}}


@pytest.fixture(scope="module")
def engines(tiny_chat_model_dir):
    options = {"device": "cpu", "kv_cache_memory": "16MiB", "max_beam_width": 16}
    return {"plain": LLM(str(tiny_chat_model_dir), **options),
            "ngram": LLM(str(tiny_chat_model_dir), speculative_method="ngram", num_speculative_tokens=3,
                         **options)}


def _check(output):
    tree = output.tree
    assert tree is not None
    returned = [(c.token_ids, c.cumulative_logprob, c.score) for c in output.outputs]
    assert ranked_hypotheses(tree) == returned
    assert all(str(t) in tree["token_text"] for t in tree["token_id"])
    return tree


@pytest.mark.parametrize("width", [1, 4, 16])
def test_tree_matches_the_output_and_speculation_changes_nothing(engines, width):
    params = BeamSearchParams(beam_width=width, max_new_tokens=10, return_tree=True)
    (plain,) = engines["plain"].generate([PROMPT + " " * width], params, use_tqdm=False)
    (drafted,) = engines["ngram"].generate([PROMPT + " " * width], params, use_tqdm=False)
    plain_tree, drafted_tree = _check(plain), _check(drafted)
    # the target's search, node for node (scores to float32 noise: a drafted round's rows are batched
    # differently, as in tests/parity/test_speculative_exact.py)
    for key in ("token_id", "parent", "step", "finished", "finish_reason", "rank", "pruned_at"):
        assert plain_tree[key] == drafted_tree[key], key
    for key in ("cumulative_logprob", "score"):
        assert [x is None for x in plain_tree[key]] == [x is None for x in drafted_tree[key]]
        assert [x for x in plain_tree[key] if x is not None] == pytest.approx(
            [x for x in drafted_tree[key] if x is not None], abs=1e-4)
    assert engines["ngram"].stats()["speculative"]["rounds"] > 0


def test_tree_inside_a_catalogue(engines):
    llm = engines["plain"]
    encode = llm.engine.tokenizer.encode
    items = [encode(t, add_special_tokens=False) for t in (" red", " green", " blue sea")]
    params = BeamSearchParams(beam_width=4, allowed_sequences=items, return_tree=True)
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    tree = _check(output)
    for node, rank in enumerate(tree["rank"]):
        if rank is not None:
            assert output.outputs[rank].token_ids[:-1] in items


def test_tree_under_a_json_schema(engines):
    params = BeamSearchParams(beam_width=4, max_new_tokens=24, response_format=SCHEMA, return_tree=True)
    (output,) = engines["plain"].generate([PROMPT], params, use_tqdm=False)
    _check(output)
    assert output.outputs[0].text.startswith("{")


@pytest.mark.parametrize("schedule", [(2, 8, 4), (16, 4, 4, 1)])
def test_tree_with_a_width_schedule(engines, schedule):
    """Each step keeps at most its scheduled width of live candidates; the tree still redraws the
    returned hypotheses."""
    params = BeamSearchParams(beam_width_schedule=schedule, max_new_tokens=8, return_tree=True)
    (output,) = engines["plain"].generate([PROMPT], params, use_tqdm=False)
    tree = _check(output)
    for step in range(1, tree["num_steps"] + 1):
        width = schedule[min(step, len(schedule)) - 1]
        live = [n for n, s in enumerate(tree["step"]) if s == step and not tree["finished"][n]]
        assert len(live) <= width


def test_no_tree_unless_asked(engines):
    (output,) = engines["plain"].generate([PROMPT], BeamSearchParams(beam_width=2, max_new_tokens=4),
                                          use_tqdm=False)
    assert output.tree is None


def test_generate_tree_on_the_command_line(tiny_chat_model_dir, capsys):
    import json

    from widebeam.cli import main

    args = ["generate", PROMPT, "--model", str(tiny_chat_model_dir), "--beam-width", "4", "--max-new-tokens",
            "6", "--kv-cache-memory", "4MiB", "--device", "cpu", "--tree"]
    assert main([*args, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert ranked_hypotheses(printed["tree"]) == [(o["token_ids"], o["cumulative_logprob"], o["score"])
                                                  for o in printed["outputs"]]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "search tree:" in text and "step 1:" in text and "#1" in text
    with pytest.raises(SystemExit):
        main(["generate", PROMPT, "--model", str(tiny_chat_model_dir), "--tree"])
    assert "--tree" in capsys.readouterr().err
