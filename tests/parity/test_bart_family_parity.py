"""M2M100 (NLLB), BART and mBART through widebeam against transformers' M2M100ForConditionalGeneration,
BartForConditionalGeneration and MBartForConditionalGeneration on tiny random models: encoder outputs,
logits of the paged decoder reading the 'cross' pool, greedy tokens, and beam search sequences and
scores at W = 1, 4, 16 through the whole engine (several sources of different lengths in one `generate`
call), with the cross pool holding exactly ceil(E/T) blocks per request whatever the beam width. Then
the real nllb-200-distilled-600M and bart-base shapes at one layer each, and int8.

Every HF generation setting that changes outputs is stated (tiny_bart_family.HF_SETTINGS), with
forced_bos_token_id=None: the engine's forced BOS is not part of this comparison.
"""

from __future__ import annotations

import math

import pytest
import torch
from beam_checks import assert_beams_match
from kv_helpers import allocate_table
from tiny_bart_family import (
    BART_BASE_SHAPE,
    EOS,
    HF_SETTINGS,
    NLLB_600M_SHAPE,
    PAD,
    TINY_CONFIGS,
    save_tiny_seq2seq,
)

from widebeam.kv.tables import Holding
from widebeam.llm import LLM
from widebeam.model.runner import SequenceInput
from widebeam.params import BeamSearchParams, SamplingParams

FAMILIES = sorted(TINY_CONFIGS)  # bart, m2m100, mbart
# Sources of several lengths (E = 2 .. 37), each ending with EOS as the families' tokenizers end them;
# none holds PAD (M2M100 gives PAD the padding position, see docs/translation-families.md).
SOURCES = [[5, 17, 33, 9, 100, 3, EOS], [7, 7, 9] * 4 + [EOS], list(range(3, 39)) + [EOS], [11, EOS]]

# (beam_width, tokens_per_block, length_penalty, early_stopping, num_return_sequences, min_new_tokens)
CASES = [
    (1, 4, 1.0, False, 1, 0),
    (4, 1, 1.0, True, 2, 0),
    (4, 16, 2.0, False, 4, 3),
    (4, 4, -1.0, "never", 2, 0),
    (16, 4, 1.0, True, 4, 2),
    (16, 16, 0.0, "never", 16, 0),
    (16, 3, -1.0, False, 8, 1),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, HF model, model directory, engines by tokens_per_block) of one family's tiny model."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf = save_tiny_seq2seq(path, TINY_CONFIGS[request.param])
    return request.param, hf, path, {}


def get_llm(family, tokens_per_block):
    _, _, path, llms = family
    if tokens_per_block not in llms:
        llms[tokens_per_block] = LLM(str(path), dtype="float32", device="cpu",
                                     tokens_per_block=tokens_per_block, kv_cache_memory="8MiB",
                                     max_num_batched_tokens=64, max_beam_width=16)
    return llms[tokens_per_block]


def assert_encoder_outputs_match(llm, hf, sources):
    """The encoder over a padding-free batch of the sources equals HF's last_hidden_state of each."""
    model = llm.engine.model
    ids = torch.tensor([t for s in sources for t in s])
    positions = torch.tensor([p for s in sources for p in range(len(s))])
    starts = [0]
    for s in sources:
        starts.append(starts[-1] + len(s))
    with torch.no_grad():
        hidden = model.encoder_hidden(ids, positions, starts)
        for i, source in enumerate(sources):
            expected = hf.get_encoder()(input_ids=torch.tensor([source])).last_hidden_state[0]
            torch.testing.assert_close(hidden[starts[i]:starts[i + 1]], expected, atol=1e-4, rtol=1e-4)


def assert_logits_match(llm, hf, sources, decoder_ids, decode_steps: int):
    """Decoder prefixes of different lengths in one forward (logits of every token), then decode steps
    of all sequences together, against HF's full forward; every block goes back."""
    engine = llm.engine
    self_manager, cross_manager = engine.cache["self"], engine.cache["cross"]
    cross_tables = [allocate_table(cross_manager, Holding(), len(s)) for s in sources]
    engine.runner.encode(sources, [cross_manager.slots(t) for t in cross_tables])
    decoder_ids = [list(d) for d in decoder_ids]
    tables = [self_manager.new_table(Holding()) for _ in decoder_ids]

    def inputs_for(tokens_per_seq, starts):
        return [SequenceInput(tokens, start, {"self": table.block_ids},
                              {"self": self_manager.append_slots(table, len(tokens))},
                              cross_block_table=cross.block_ids, num_encoder_tokens=cross.num_tokens)
                for tokens, start, table, cross in zip(tokens_per_seq, starts, tables, cross_tables)]

    def expected_logits(source, decoder):
        return hf(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([decoder])).logits[0]

    try:
        logits = engine.runner.execute(inputs_for(decoder_ids, [0] * len(sources)), all_logits=True)
        offset = 0
        with torch.no_grad():
            for source, decoder in zip(sources, decoder_ids):
                torch.testing.assert_close(logits[offset:offset + len(decoder)],
                                           expected_logits(source, decoder), atol=1e-4, rtol=1e-4)
                offset += len(decoder)
        for step in range(decode_steps):
            next_tokens = [[(7 * step + 3 * i) % 120 + 3] for i in range(len(sources))]
            logits = engine.runner.execute(inputs_for(next_tokens, [len(d) for d in decoder_ids]))
            for decoder, token in zip(decoder_ids, next_tokens):
                decoder.extend(token)
            with torch.no_grad():
                for row, source, decoder in zip(logits, sources, decoder_ids):
                    torch.testing.assert_close(row, expected_logits(source, decoder)[-1],
                                               atol=1e-4, rtol=1e-4)
    finally:
        for table in tables:
            self_manager.release(table)
        for table in cross_tables:
            cross_manager.release(table)


def test_encoder_outputs_match(family):
    assert_encoder_outputs_match(get_llm(family, 4), family[1], SOURCES)


@pytest.mark.parametrize("tokens_per_block", [1, 3, 16])
def test_logits_match_with_cross_attention_from_the_pool(family, tokens_per_block):
    decoder_ids = [[EOS, 4, 8, 9, 10], [EOS], [EOS] + [3] * 9, [EOS, 50, 51]]
    assert_logits_match(get_llm(family, tokens_per_block), family[1], SOURCES, decoder_ids, decode_steps=4)


@pytest.mark.parametrize("beam_width, tokens_per_block, length_penalty, early_stopping, num_return, min_new",
                         CASES)
def test_beam_search_matches_transformers(family, beam_width, tokens_per_block, length_penalty,
                                          early_stopping, num_return, min_new):
    name, hf = family[0], family[1]
    llm = get_llm(family, tokens_per_block)
    max_new_tokens = 12
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=max_new_tokens,
                              length_penalty=length_penalty, early_stopping=early_stopping,
                              num_return_sequences=num_return, min_new_tokens=min_new)
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES], params, use_tqdm=False)
    saw_eos = False
    for source, output in zip(SOURCES, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([source]), num_beams=beam_width,
                                   max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                                   early_stopping=early_stopping,
                                   num_return_sequences=num_return, min_new_tokens=min_new,
                                   output_scores=True, return_dict_in_generate=True, **HF_SETTINGS)
        assert output.prompt_token_ids == source
        assert len(output.outputs) == num_return
        # HF's sequences start with the decoder start token (EOS)
        saw_eos |= assert_beams_match(output, expected, 1, PAD, EOS, beam_width,
                                      f"{name} source {source[:4]}")
        assert all(PAD not in beam.token_ids for beam in output.outputs)  # bad_words_ids
        assert all(len(beam.token_ids) >= min_new for beam in output.outputs)
        # The cross pool: ceil(E/T) blocks, reserved once per request, whatever the beam width.
        cross_blocks = math.ceil(len(source) / tokens_per_block)
        assert output.required_blocks["cross"] == output.peak_blocks["cross"] == cross_blocks
        assert output.peak_blocks["self"] <= output.required_blocks["self"]
    if beam_width >= 4 and length_penalty <= 0:
        assert saw_eos, "the EOS paths were not exercised"
    for pool_name, pool in llm.stats()["pools"].items():
        assert pool["free_blocks"] == pool["total_blocks"], pool_name


def test_greedy_matches_transformers(family):
    llm, hf = get_llm(family, 4), family[1]
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES],
                           SamplingParams(temperature=0.0, max_new_tokens=10), use_tqdm=False)
    for source, output in zip(SOURCES, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([source]), num_beams=1, max_new_tokens=10,
                                   **HF_SETTINGS)[0, 1:]
        assert len(output.outputs) == 1
        assert output.outputs[0].token_ids == expected.tolist()  # whole: an empty output fails


def test_the_decoder_starts_at_eos_and_embeddings_are_shared(family):
    model = get_llm(family, 4).engine.model
    assert model.decoder_start_token_id == EOS
    shared = model.model.shared.weight
    assert model.model.encoder.embed_tokens.weight is shared
    assert model.model.decoder.embed_tokens.weight is shared
    assert model.lm_head.weight is shared
    if hasattr(family[1], "final_logits_bias"):
        torch.testing.assert_close(model.final_logits_bias, family[1].final_logits_bias)
    else:
        assert not hasattr(model, "final_logits_bias")  # M2M100 has none


def test_int8_runs_greedy(family):
    """dtype="int8" (int8 linears, float32 activations and KV) runs each family's encoder and decoder."""
    llm = LLM(str(family[2]), dtype="int8", device="cpu", tokens_per_block=4, kv_cache_memory="4MiB",
              max_num_batched_tokens=64, max_beam_width=4)
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES],
                           SamplingParams(temperature=0.0, max_new_tokens=8), use_tqdm=False)
    for output in outputs:
        (completion,) = output.outputs
        assert completion.token_ids and (len(completion.token_ids) == 8 or completion.token_ids[-1] == EOS)
        assert all(0 <= t < 128 for t in completion.token_ids)


@pytest.mark.parametrize("shape", ["nllb-200-distilled-600M", "bart-base"])
def test_real_config_shapes_at_one_layer(shape, tmp_path):
    """The real d_model, heads, feed-forward, vocabulary and position table at one encoder and one
    decoder layer: encoder outputs, logits, greedy tokens and a W=4 beam search equal HF's."""
    config = NLLB_600M_SHAPE if shape.startswith("nllb") else BART_BASE_SHAPE
    hf = save_tiny_seq2seq(tmp_path, config, std=0.05, embed_std=0.05)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", tokens_per_block=16, kv_cache_memory="16MiB",
              max_num_batched_tokens=64, max_beam_width=4)
    sources = [[5, 17, 33, 9, 1000, 3, EOS], list(range(300, 340)) + [EOS]]
    assert_encoder_outputs_match(llm, hf, sources)
    assert_logits_match(llm, hf, sources, [[EOS, 40, 8000], [EOS]], decode_steps=2)
    params = BeamSearchParams(beam_width=4, max_new_tokens=6, num_return_sequences=2)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sources], params, use_tqdm=False)
    for source, output in zip(sources, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([source]), num_beams=4, max_new_tokens=6,
                                   num_return_sequences=2, output_scores=True, return_dict_in_generate=True,
                                   **HF_SETTINGS)
        assert_beams_match(output, expected, 1, PAD, EOS, 4, f"{shape} source {source[:4]}")
        assert output.required_blocks["cross"] == output.peak_blocks["cross"] == math.ceil(len(source) / 16)


def test_older_checkpoint_names_load(family, tmp_path):
    """Hub checkpoints saved by older transformers store the tied copies (encoder and decoder
    embed_tokens, lm_head) and, for M2M100, a sinusoidal table placeholder; they load to the same
    model: greedy tokens equal the tiny model's."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, _, path, _ = family
    tensors = load_file(str(path / "model.safetensors"))
    shared = tensors["model.shared.weight"]
    for name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = shared.clone()
    if "model.encoder.embed_positions.weight" not in tensors:  # computed positions (M2M100)
        tensors["model.encoder.embed_positions._float_tensor"] = torch.zeros(1)
        tensors["model.decoder.embed_positions._float_tensor"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for name in ("config.json", "generation_config.json"):
        shutil.copy(path / name, tmp_path / name)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    older = LLM(str(tmp_path), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="4MiB",
                max_num_batched_tokens=64, max_beam_width=4)
    prompts = [{"prompt_token_ids": s} for s in SOURCES]
    expected = get_llm(family, 4).generate(prompts, params, use_tqdm=False)
    got = older.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
