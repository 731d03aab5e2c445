"""`widebeam bench serve`'s request bodies: widths drawn in the mix's proportions, genrec's shared prefix and
catalogue, chat's greedy share, translation's beams, a JSONL file used as written; the same seed gives the
same bodies; bad input is a ValueError naming it."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from widebeam.bench_serve.workloads import (
    CHAT,
    COMPLETIONS,
    WorkloadConfig,
    build_requests,
    load_catalogue_items,
    parse_width_mix,
)


def test_width_mix_parses_and_refuses():
    assert parse_width_mix("64:0.5, 256:1.5") == [(64, 0.5), (256, 1.5)]
    assert parse_width_mix("8") == [(8, 1.0)]
    for bad in ("64:x", "0:1", "64:0", "64:-1", "a", "64:inf"):
        with pytest.raises(ValueError):
            parse_width_mix(bad)


def test_genrec_widths_follow_the_mix_and_share_one_prefix():
    specs = build_requests(WorkloadConfig(workload="genrec", num_requests=4000, width_mix="64:0.25,256:0.75",
                                          catalogue="items", num_returned_beams=50, prefix_num_words=30))
    counts = Counter(s.beam_width for s in specs)
    assert set(counts) == {64, 256}
    assert counts[64] / 4000 == pytest.approx(0.25, abs=0.03)
    prefixes = {s.body["prompt"].split("\n")[0] for s in specs}
    assert len(prefixes) == 1 and len(prefixes.pop().split()) == 30
    assert len({s.body["prompt"] for s in specs}) > 3900  # the user parts differ
    body = specs[0].body
    assert body["use_beam_search"] and body["catalogue"] == "items" and "max_tokens" not in body
    assert body["n"] == 50 and body["beam_width"] == specs[0].beam_width
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert all(s.catalogue and s.endpoint == COMPLETIONS for s in specs)


def test_genrec_without_catalogue_sets_max_tokens_and_n_at_most_the_width():
    specs = build_requests(WorkloadConfig(workload="genrec", num_requests=20, width_mix="4:1",
                                          num_returned_beams=10, output_len=5))
    assert all(s.body["n"] == 4 and s.body["max_tokens"] == 5 and not s.catalogue for s in specs)


def test_chat_greedy_share_and_seeded_sampling():
    specs = build_requests(WorkloadConfig(workload="chat", num_requests=1000, greedy_fraction=0.3, model="m"))
    greedy = [s for s in specs if s.kind == "chat-greedy"]
    assert len(greedy) / 1000 == pytest.approx(0.3, abs=0.05)
    assert all(s.body["temperature"] == 0 for s in greedy)
    sampled = [s for s in specs if s.kind == "chat-sampled"]
    assert all(s.body["temperature"] > 0 and "seed" in s.body for s in sampled)
    assert all(s.endpoint == CHAT and s.body["model"] == "m" and not s.beam_width for s in specs)


def test_translation_is_narrow_beams_over_short_sentences():
    specs = build_requests(WorkloadConfig(workload="translation", num_requests=10))
    assert all(s.beam_width == 4 and s.body["n"] == 1 and len(s.body["prompt"].split()) < 16 for s in specs)


@pytest.mark.parametrize("workload", ["genrec", "translation", "chat"])
def test_same_seed_same_bodies(workload):
    def bodies(seed):
        return [s.body for s in build_requests(WorkloadConfig(workload=workload, num_requests=20, seed=seed))]
    assert bodies(1) == bodies(1) and bodies(1) != bodies(2)


def test_jsonl_bodies_are_sent_as_written_and_cycled(tmp_path):
    path = tmp_path / "b.jsonl"
    rows = [{"prompt": "a", "use_beam_search": True, "beam_width": 8, "catalogue": "c"},
            {"messages": [{"role": "user", "content": "b"}], "stream": False}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    specs = build_requests(WorkloadConfig(workload="jsonl", num_requests=3, dataset_path=str(path)))
    assert [s.endpoint for s in specs] == [COMPLETIONS, CHAT, COMPLETIONS]
    assert specs[0].beam_width == 8 and specs[0].catalogue and specs[0].body["stream"]
    assert specs[1].body == rows[1] and specs[1].beam_width == 0  # stream: false kept
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"b.jsonl:2"):
        build_requests(WorkloadConfig(workload="jsonl", num_requests=1, dataset_path=str(path)))


def test_catalogue_items_file(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text('"red shoes"\n{"text": " socks "}\n')
    assert load_catalogue_items(str(path)) == {"red shoes", "socks"}
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="token-id"):
        load_catalogue_items(str(path))
