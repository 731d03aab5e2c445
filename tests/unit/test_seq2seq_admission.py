"""Admission on every encoder-decoder family: a W=256 request reserves the cross pool once
(required == peak == ceil(E/T) cross blocks, whatever the width), and a source too long for the cross
pool is refused naming `cross` while the running requests finish and every block comes back.

Each family's tiny model is the one its parity tests use (tests/tiny_models.py, tiny_bart_family.py,
tiny_t5.py)."""

from __future__ import annotations

import math

import pytest

from widebeam.errors import RequestTooLargeError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

FAMILIES = ["marian", "m2m100", "bart", "mbart", "t5", "mt5"]
TOKENS_PER_BLOCK = 4
EOS = 2  # the sources' last token (T5's EOS is 1; any token ends a source)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_marian_dir):
    """Each family's tiny model directory, built on first use."""
    built = {"marian": tiny_marian_dir}

    def get(family: str):
        if family not in built:
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            if family in ("t5", "mt5"):
                from tiny_t5 import save_tiny_t5

                save_tiny_t5(path, family)
            else:
                from tiny_bart_family import TINY_CONFIGS, save_tiny_seq2seq

                save_tiny_seq2seq(path, TINY_CONFIGS[family])
            built[family] = path
        return built[family]

    return get


def engine(path, kv_cache_memory: str, max_beam_width: int) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", tokens_per_block=TOKENS_PER_BLOCK,
               kv_cache_memory=kv_cache_memory, max_beam_width=max_beam_width, max_num_batched_tokens=512)


def assert_all_free(llm: LLM) -> None:
    for name, pool in llm.stats()["pools"].items():
        assert pool["free_blocks"] == pool["total_blocks"], name


@pytest.mark.parametrize("family", FAMILIES)
def test_a_wide_request_reserves_the_cross_pool_once(family, family_dirs):
    path = family_dirs(family)
    llm = engine(path, "16MiB", 256)
    source = [5, 17, 33, 9, 40, 3, 11, 12, 13, 14, 15, 16, 30, EOS]
    (out,) = llm.generate([{"prompt_token_ids": source}], BeamSearchParams(beam_width=256, max_new_tokens=6),
                          use_tqdm=False)
    cross_blocks = math.ceil(len(source) / TOKENS_PER_BLOCK)
    assert out.required_blocks["cross"] == out.peak_blocks["cross"] == cross_blocks
    assert out.peak_blocks["self"] <= out.required_blocks["self"]
    assert len(out.outputs) > 1
    assert_all_free(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_source_too_long_for_the_cross_pool_is_refused_naming_it(family, family_dirs):
    path = family_dirs(family)
    llm = engine(path, "64KiB", 4)
    cross_total = llm.stats()["pools"]["cross"]["total_blocks"]
    too_long = [7] * (cross_total * TOKENS_PER_BLOCK) + [EOS]  # one token past the whole pool
    assert len(too_long) <= llm.engine.max_encoder_tokens  # the encoder takes it: the pool is the limit
    running = llm.engine
    running.add_request("running", {"prompt_token_ids": [5, 17, 33, EOS]},
                        BeamSearchParams(beam_width=4, max_new_tokens=6))
    running.step()  # it holds blocks now
    with pytest.raises(RequestTooLargeError) as excinfo:
        running.add_request("too-long", {"prompt_token_ids": too_long}, BeamSearchParams(beam_width=2))
    assert excinfo.value.pool == "cross", str(excinfo.value)
    assert "'cross'" in str(excinfo.value)
    finished = []
    while running.has_unfinished():
        finished += [d.output for d in running.step() if d.finished]
    assert [o.request_id for o in finished] == ["running"] and finished[0].outputs
    assert_all_free(llm)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prefix_len, beam_width", [(0, 1), (3, 8), (9, 16)])
def test_plan_counts_a_decoder_prefix_as_the_engine_does(family, prefix_len, beam_width, family_dirs):
    """`widebeam plan --decoder-prefix-len K` and the engine's admission of a request with a K-token
    decoder prefix ask the same blocks of every pool."""
    from widebeam.model.loading.arch import load_arch
    from widebeam.plan import PlanInputs, plan

    path = family_dirs(family)
    llm = engine(path, "16MiB", 16)
    source, new_tokens = [5, 17, 33, 9, 40, 3, 11, EOS], 6
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=new_tokens,
                              decoder_prefix=[7] * prefix_len)
    (out,) = llm.generate([{"prompt_token_ids": source}], params, use_tqdm=False)
    planned = plan(load_arch(str(path)), PlanInputs(
        memory_bytes=2**30, beam_width=beam_width, prompt_len=len(source), max_new_tokens=new_tokens,
        tokens_per_block=TOKENS_PER_BLOCK, dtype="float32", decoder_prefix_len=prefix_len))
    assert {p["name"]: p["required_blocks"] for p in planned["pools"]} == out.required_blocks
    assert_all_free(llm)
