"""Group (diverse) beam search (`num_beam_groups`, `diversity_penalty`) through the whole engine against
transformers 4.46's `_group_beam_search`, whose outputs tests/data/make_group_beam_reference.py stored
(transformers 5 no longer ships it): the same tiny Llama rebuilt here from the script's seeded weights,
W in {4, 8, 30} and groups in {2, 4, W}, sequences equal and `sequences_scores` to 1e-4. On a
synthetic catalogue the top beams spread over at least twice as many first-level codes as plain beam
search at the same width."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

DATA = Path(__file__).parent.parent / "data"


def _script():
    spec = importlib.util.spec_from_file_location("make_group_beam_reference",
                                                  DATA / "make_group_beam_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REFERENCE = json.loads((DATA / "group_beam_reference.json").read_text())


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    script = _script()
    path = tmp_path_factory.mktemp("group-beam-llama")
    script.build_model().save_pretrained(str(path), safe_serialization=True)
    return LLM(str(path), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="16MiB",
               max_beam_width=32)


def test_reference_covers_the_asked_shapes():
    shapes = {(c["num_beams"], c["num_beam_groups"]) for c in REFERENCE["cases"]}
    assert {4, 8, 30} == {w for w, _ in shapes}
    assert {(4, 2), (4, 4), (8, 2), (8, 4), (8, 8), (30, 2), (30, 30)} <= shapes
    assert REFERENCE["transformers"] == "4.46.3"


@pytest.mark.parametrize("index", range(len(REFERENCE["cases"])))
def test_group_beam_search_equals_transformers_446(llm, index):
    case = REFERENCE["cases"][index]
    params = BeamSearchParams(beam_width=case["num_beams"], num_beam_groups=case["num_beam_groups"],
                              diversity_penalty=case["diversity_penalty"],
                              max_new_tokens=case["max_new_tokens"], length_penalty=case["length_penalty"],
                              early_stopping=case["early_stopping"])
    (output,) = llm.generate([{"prompt_token_ids": case["prompt"]}], params, use_tqdm=False)
    assert [b.token_ids for b in output.outputs] == case["sequences"]
    for beam, score in zip(output.outputs, case["scores"]):
        torch.testing.assert_close(beam.score, score, atol=1e-4, rtol=1e-5)
    for name, peak in output.peak_blocks.items():
        assert peak <= output.required_blocks[name]


def test_diverse_beams_spread_over_first_level_codes(llm):
    """A synthetic catalogue of 3-code items (first code 3..34, then 35..74, 75..114): the top 16 of a
    W=16 search with 16 groups cover at least twice the first codes plain beam search does."""
    rng = torch.Generator().manual_seed(0)
    items = torch.stack([torch.randint(low, high, (3000,), generator=rng)
                         for low, high in ((3, 35), (35, 75), (75, 115))], dim=1).tolist()
    llm.register_catalogue("codes", items)
    prompts = [{"prompt_token_ids": [5, 9, 13, 70 + i]} for i in range(4)]
    plain = llm.generate(prompts, BeamSearchParams(beam_width=16, catalogue="codes"), use_tqdm=False)
    diverse = llm.generate(prompts, BeamSearchParams(beam_width=16, catalogue="codes", num_beam_groups=16,
                                                     diversity_penalty=5.0), use_tqdm=False)
    for p, d in zip(plain, diverse):
        assert all(b.token_ids[:-1] in items for b in d.outputs)
        plain_codes = {b.token_ids[0] for b in p.outputs}
        diverse_codes = {b.token_ids[0] for b in d.outputs}
        assert len(diverse_codes) >= 2 * len(plain_codes), (plain_codes, diverse_codes)


@pytest.mark.parametrize("kwargs, param", [
    ({"beam_width": 6, "num_beam_groups": 4, "diversity_penalty": 1.0}, "num_beam_groups"),
    ({"beam_width": 4, "num_beam_groups": 2}, "diversity_penalty"),
    ({"beam_width": 4, "diversity_penalty": 1.0}, "diversity_penalty"),
    ({"beam_width": 4, "num_beam_groups": 2, "diversity_penalty": -1.0}, "diversity_penalty"),
    ({"beam_width_schedule": [2, 4], "num_beam_groups": 2, "diversity_penalty": 1.0}, "beam_width_schedule"),
    ({"beam_width": 4, "num_beam_groups": 2, "diversity_penalty": 1.0, "stop": ["x"]}, "stop"),
])
def test_group_errors_name_the_parameter(kwargs, param):
    from widebeam.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError) as error:
        BeamSearchParams(**kwargs)
    assert error.value.param == param


def test_http_group_fields_reach_the_engine():
    from widebeam.server.protocol import plan_request
    from widebeam.server.schemas import CompletionRequest

    plan = plan_request(CompletionRequest(prompt="x", use_beam_search=True, n=4, beam_width=8,
                                          num_beam_groups=4, diversity_penalty=0.5, max_tokens=4))
    (params,) = plan.params
    assert (params.num_beam_groups, params.diversity_penalty, params.beam_width) == (4, 0.5, 8)
