"""benchmarks/seq2seq.py's core on tiny models of each family widebeam serves: every side decodes exactly
N tokens per source at W = 1 and 2, and at W = 1 widebeam's tokens are transformers' (and CTranslate2's,
converted by its own converter from the same directory). No timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import transformers

from widebeam.model.families.table import SUPPORTED_MODEL_TYPES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import seq2seq  # benchmarks/ is a scripts folder, not a package

_TINY = {"d_model": 32, "max_position_embeddings": 128}
# every dimension shrunk; init_std sharpens the random weights so greedy choices are far apart
OVERRIDES = {
    "marian": {**_TINY, "vocab_size": 96, "decoder_vocab_size": 96, "pad_token_id": 95,
               "decoder_start_token_id": 95, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
               "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "init_std": 0.3},
    "nllb": {**_TINY, "vocab_size": 96, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
             "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "init_std": 0.3},
    "t5": {"vocab_size": 96, "d_model": 32, "d_kv": 8, "num_heads": 4, "d_ff": 64},
}


def _model_type(name: str) -> str:
    return getattr(transformers, seq2seq.FAMILIES[name].config_class).model_type


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_seq2seq_bench_core(name, tmp_path):
    assert _model_type(name) in SUPPORTED_MODEL_TYPES  # every benchmarked family is served
    family = seq2seq.FAMILIES[name]
    seq2seq.save_model(family, tmp_path / "model", layers=2, overrides=OVERRIDES[name])
    config = seq2seq.model_config(family, 2, OVERRIDES[name])
    sides = ["widebeam", "transformers", "ctranslate2"]  # CTranslate2 is in the dev extra make test installs
    specials = {i for i in family.special_tokens if i < config["vocab_size"]} | {config["pad_token_id"]}
    sources = seq2seq.make_sources(3, config["vocab_size"], specials, config["eos_token_id"])
    assert [len(s) for s in sources] == [48, 55, 62] and all(s[-1] == config["eos_token_id"] for s in sources)
    bench = seq2seq.Sides(tmp_path / "model", "float32", threads=1, max_width=2, kv_cache_memory="16MiB",
                          sides=sides, ct2_cache=tmp_path)
    try:
        n = 8
        for width in (1, 2):
            # peer_max_beams 2: transformers and CTranslate2 batch 2 sources at W=1 (padding masked), 1 at W=2
            row = seq2seq.bench_point(bench, sources, width, n, sides, peer_max_beams=2)
            for side in sides:
                assert row[side]["all_lengths_n"], side
                assert len(row["best"][side]) == len(sources)
            if width == 1:
                assert row["best"]["widebeam"] == row["best"]["transformers"]
                if "ctranslate2" in sides:
                    assert row["best"]["ctranslate2"] == row["best"]["widebeam"]
            assert row["transformers"]["widebeam_speedup"] > 0
    finally:
        bench.close()
