"""T5 / T5 v1.1 / mT5 through widebeam against transformers' T5ForConditionalGeneration and
MT5ForConditionalGeneration on tiny random models (tests/tiny_t5.py): the encoder's output (as the
cross K/V it leaves in the 'cross' pool), the paged decoder's logits with its causal relative bias
through the attention backend, greedy and beam search through the whole engine (several sources of
different lengths in one `generate` call), the cross pool holding ceil(E/T) blocks once per request at
every beam width, and the t5-small shape at reduced depth."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from beam_checks import assert_beams_match
from kv_helpers import allocate_table
from tiny_t5 import T5_EOS as EOS
from tiny_t5 import T5_PAD as PAD
from tiny_t5 import T5_SMALL_SHAPE, save_tiny_t5

from widebeam.kv.tables import Holding
from widebeam.llm import LLM
from widebeam.model.runner import SequenceInput
from widebeam.params import BeamSearchParams, SamplingParams

# Sources of several lengths (E = 2 .. 37; past the tiny model's max_distance of 20), ending with EOS
# as T5's tokenizer ends them.
SOURCES = [[5, 17, 33, 9, 60, 3, EOS], [7, 7, 9] * 4 + [EOS], list(range(3, 39)) + [EOS], [11, EOS]]
# Everything in HF's generation config that changes outputs, stated explicitly.
HF_SETTINGS = {"do_sample": False, "eos_token_id": EOS, "pad_token_id": PAD, "decoder_start_token_id": PAD,
               "bad_words_ids": None, "forced_eos_token_id": None, "forced_bos_token_id": None,
               "no_repeat_ngram_size": 0, "repetition_penalty": 1.0, "min_length": 0}

# (beam_width, tokens_per_block, length_penalty, early_stopping, num_return_sequences, min_new_tokens[,
#  attention backend: sdpa unless named])
CASES = [
    (1, 4, 1.0, False, 1, 0),
    (4, 1, 1.0, True, 2, 0),
    (4, 16, 2.0, False, 4, 3),
    (4, 4, -1.0, "never", 2, 0),
    (16, 4, 0.0, True, 8, 0),
    (16, 3, 1.0, "never", 3, 2),
    (16, 1, -1.0, False, 4, 1),
    (4, 3, 1.0, False, 4, 2, "reference"),  # the reference backend through the whole engine
]
VARIANTS = ["t5", "t5-v1_1", "mt5"]


@pytest.fixture(scope="module", params=VARIANTS)
def models(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf = save_tiny_t5(path, request.param)
    return {}, hf, path


def get_llm(models, tokens_per_block, attention_backend="sdpa"):
    llms, _, path = models
    key = (tokens_per_block, attention_backend)
    if key not in llms:
        llms[key] = LLM(str(path), dtype="float32", device="cpu", tokens_per_block=tokens_per_block,
                        kv_cache_memory="8MiB", max_num_batched_tokens=64, max_beam_width=16,
                        attention_backend=attention_backend)
    return llms[key]


def check_logits(engine, hf, sources, decoder_ids, steps: int = 4, tol: float = 1e-4) -> None:
    """The encoder's cross K/V in the pool, then every decoder token's logits (one prefill forward of
    all sequences, then decode steps together) against HF's full forward."""
    self_manager, cross_manager = engine.cache["self"], engine.cache["cross"]
    cross_tables = [allocate_table(cross_manager, Holding(), len(s)) for s in sources]
    tables = [self_manager.new_table(Holding()) for _ in decoder_ids]
    try:  # the blocks go back even when a comparison fails, so one failure does not cascade
        _compare(engine, hf, sources, decoder_ids, steps, tol, tables, cross_tables)
    finally:
        for table in tables:
            self_manager.release(table)
        for table in cross_tables:
            cross_manager.release(table)


def _compare(engine, hf, sources, decoder_ids, steps, tol, tables, cross_tables) -> None:
    self_manager, cross_manager = engine.cache["self"], engine.cache["cross"]
    engine.runner.encode(sources, [cross_manager.slots(t) for t in cross_tables])
    cross_caches = [kv for kv, name in zip(engine.runner.kv_caches, engine.model.layer_pool_names)
                    if name == "cross"]
    with torch.no_grad():
        for source, table in zip(sources, cross_tables):
            encoded = hf.get_encoder()(input_ids=torch.tensor([source])).last_hidden_state[0]
            slots = torch.tensor(cross_manager.slots(table))
            for block, (k_cache, v_cache) in zip(hf.decoder.block, cross_caches):
                attention = block.layer[1].EncDecAttention
                heads = (len(source), attention.n_heads, attention.key_value_proj_dim)
                for cache, projection in ((k_cache, attention.k), (v_cache, attention.v)):
                    torch.testing.assert_close(cache[slots], projection(encoded).view(heads),
                                               atol=tol, rtol=tol)

    def inputs_for(tokens_per_seq, starts):
        return [SequenceInput(tokens, start, {"self": table.block_ids},
                              {"self": self_manager.append_slots(table, len(tokens))},
                              cross_block_table=cross.block_ids, num_encoder_tokens=cross.num_tokens)
                for tokens, start, table, cross in zip(tokens_per_seq, starts, tables, cross_tables)]

    logits = engine.runner.execute(inputs_for(decoder_ids, [0] * len(sources)), all_logits=True)
    offset = 0
    with torch.no_grad():
        for source, decoder in zip(sources, decoder_ids):
            expected = hf(input_ids=torch.tensor([source]),
                          decoder_input_ids=torch.tensor([decoder])).logits[0]
            torch.testing.assert_close(logits[offset:offset + len(decoder)], expected, atol=tol, rtol=tol)
            offset += len(decoder)
    for step in range(steps):
        next_tokens = [[(7 * step + 3 * i) % 90 + 3] for i in range(len(sources))]
        logits = engine.runner.execute(inputs_for(next_tokens, [len(d) for d in decoder_ids]))
        for decoder, token in zip(decoder_ids, next_tokens):
            decoder.extend(token)
        with torch.no_grad():
            for row, source, decoder in zip(logits, sources, decoder_ids):
                expected = hf(input_ids=torch.tensor([source]),
                              decoder_input_ids=torch.tensor([decoder])).logits[0, -1]
                torch.testing.assert_close(row, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("tokens_per_block, attention_backend",
                         [(1, "sdpa"), (3, "sdpa"), (16, "sdpa"), (3, "reference")])
def test_encoder_output_and_logits_match(models, tokens_per_block, attention_backend):
    engine, hf = get_llm(models, tokens_per_block, attention_backend).engine, models[1]
    assert engine.runner.attention_backend.name == attention_backend
    # decoder prefixes of different lengths, one past max_distance (20) to reach the log buckets
    decoder_ids = [[PAD, 4, 8, 9, 10], [PAD], [PAD] + [3] * 24, [PAD, 50, 51]]
    check_logits(engine, hf, SOURCES, decoder_ids)
    for name, pool in engine.stats()["pools"].items():
        assert pool["free_blocks"] == pool["total_blocks"], name


@pytest.mark.parametrize("beam_width, tokens_per_block, length_penalty, early_stopping, num_return, min_new, "
                         "attention_backend", [case if len(case) == 7 else (*case, "sdpa") for case in CASES])
def test_beam_search_matches_transformers(models, beam_width, tokens_per_block, length_penalty,
                                          early_stopping, num_return, min_new, attention_backend):
    llm, hf = get_llm(models, tokens_per_block, attention_backend), models[1]
    max_new_tokens = 12
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=max_new_tokens,
                              length_penalty=length_penalty, early_stopping=early_stopping,
                              num_return_sequences=num_return, min_new_tokens=min_new)
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES], params, use_tqdm=False)
    saw_eos = False
    for source, output in zip(SOURCES, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([source]), num_beams=beam_width,
                                   max_new_tokens=max_new_tokens,
                                   length_penalty=length_penalty, early_stopping=early_stopping,
                                   num_return_sequences=num_return, min_new_tokens=min_new,
                                   output_scores=True, return_dict_in_generate=True, **HF_SETTINGS)
        assert output.prompt_token_ids == source
        assert len(output.outputs) == num_return
        # HF's sequences start with the decoder start token
        saw_eos |= assert_beams_match(output, expected, 1, PAD, EOS, beam_width, f"source {source[:4]}")
        assert all(len(beam.token_ids) >= min_new for beam in output.outputs)
        # The cross pool: ceil(E/T) blocks, once per request, whatever the beam width.
        cross_blocks = math.ceil(len(source) / tokens_per_block)
        assert output.required_blocks["cross"] == output.peak_blocks["cross"] == cross_blocks
        assert output.peak_blocks["self"] <= output.required_blocks["self"]
    if beam_width >= 4 and length_penalty <= 0:
        assert saw_eos, "the EOS paths were not exercised"
    for name, pool in llm.stats()["pools"].items():
        assert pool["free_blocks"] == pool["total_blocks"], name


def test_greedy_matches_transformers(models):
    llm, hf = get_llm(models, 4), models[1]
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES],
                           SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True),
                           use_tqdm=False)
    for source, output in zip(SOURCES, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([source]), num_beams=1, max_new_tokens=10,
                                   **{**HF_SETTINGS, "eos_token_id": None})[0, 1:]
        assert output.outputs[0].token_ids == expected.tolist()  # whole: an empty output fails


def test_int8_runs_greedy(models):
    llm = LLM(str(models[2]), dtype="int8", device="cpu", tokens_per_block=4, kv_cache_memory="4MiB",
              max_num_batched_tokens=64, max_beam_width=4)
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES],
                           SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)


def test_loads_the_checkpoint_with_its_head(models):
    model, hf = get_llm(models, 4).engine.model, models[1]
    shared = model.shared.weight
    assert model.encoder.embed_tokens.weight is shared and model.decoder.embed_tokens.weight is shared
    tied = hf.lm_head.weight is hf.shared.weight
    assert (model.lm_head.weight is shared) == tied
    assert (model.output_scale is not None) == tied  # T5 v1.0 scales before its tied head; v1.1/mT5 not
    torch.testing.assert_close(model.lm_head.weight, hf.lm_head.weight)


def test_t5_small_shape_at_two_layers(tmp_path):
    """t5-small's widths (d_model 512, 8 x 64 heads, d_ff 2048, 32128 tokens, 32 buckets to 128)."""
    hf = save_tiny_t5(tmp_path, "t5", shape=T5_SMALL_SHAPE)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", tokens_per_block=16, kv_cache_memory="16MiB",
              max_num_batched_tokens=160, max_beam_width=4)
    long_source = [(37 * i) % 32000 + 2 for i in range(150)] + [EOS]  # past max_distance 128
    sources = [SOURCES[0], long_source]
    check_logits(llm.engine, hf, sources, [[PAD, 4, 8], [PAD] + [3] * 140], steps=2, tol=2e-4)
    params = BeamSearchParams(beam_width=4, max_new_tokens=6, num_return_sequences=2)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sources], params, use_tqdm=False)
    for source, output in zip(sources, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([source]), num_beams=4, max_new_tokens=6,
                                   num_return_sequences=2,
                                   length_penalty=1.0, early_stopping=False, output_scores=True,
                                   return_dict_in_generate=True, **HF_SETTINGS)
        assert_beams_match(output, expected, 1, PAD, EOS, 4, "t5-small shape")
        assert output.required_blocks["cross"] == output.peak_blocks["cross"] == math.ceil(len(source) / 16)


def test_generate_cli_with_a_task_prefix_like_transformers(tmp_path):
    """A model directory with T5's tokenizer: `widebeam generate "translate English to German: ..."`
    encodes the task-prefixed text (EOS appended) as the source and returns HF's beams and scores."""
    pytest.importorskip("sentencepiece")
    from tiny_t5 import save_tiny_t5_tokenizer

    tokenizer = save_tiny_t5_tokenizer(tmp_path)
    hf = save_tiny_t5(tmp_path, "t5-v1_1")
    assert len(tokenizer) <= hf.config.vocab_size
    text = "translate English to German: the quick brown dog sat on the mat"
    proc = subprocess.run([sys.executable, "-m", "widebeam", "generate", text, "--model", str(tmp_path),
                           "--beam-width", "4", "--max-new-tokens", "8", "--tokens-per-block", "4", "--json",
                           "--kv-cache-memory", "1MiB", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    source = tokenizer(text).input_ids
    assert source[-1] == EOS
    with torch.no_grad():
        expected = hf.generate(torch.tensor([source]), num_beams=4, num_return_sequences=4, max_new_tokens=8,
                               length_penalty=1.0, early_stopping=False, output_scores=True,
                               return_dict_in_generate=True, **HF_SETTINGS)
    assert len(result["outputs"]) == 4
    for rank, beam in enumerate(result["outputs"]):
        generated = expected.sequences[rank, 1:].tolist()
        assert beam["token_ids"] == generated[:len(beam["token_ids"])]
        assert beam["text"] == tokenizer.decode(beam["token_ids"], skip_special_tokens=True)
        assert abs(beam["score"] - float(expected.sequences_scores[rank])) < 1e-4
    assert result["kv_peak_blocks"]["cross"] == math.ceil(len(source) / 4)
