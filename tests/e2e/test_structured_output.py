"""Structured output (`response_format`): every output parses and validates against its schema, over many
seeds and at beam widths 1, 4 and 16; beam search with the grammar forked per beam equals transformers'
beam search with a grammar replayed from scratch for every beam at every step; over HTTP with the official
`openai` client (chat and completions, streamed and whole, beams, `parse` with a pydantic model); a bad
schema is a 400 naming `response_format` and xgrammar's reason, and frees everything."""

from __future__ import annotations

import json
import typing

import jsonschema
import openai
import pydantic
import pytest
import torch
from beam_checks import assert_beams_match
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from widebeam.errors import InvalidParameterError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams, SamplingParams

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                  "maxItems": 3}}}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
# bounded: a name of at most 8 characters, 3 tags, an age of at most 3 digits: well under 96 tokens
MAX_TOKENS = 96
PROMPTS = ["Describe a person as JSON.", "Name: Ada. Age: 36.", "{", "Random words: apple river stone"]


@pytest.fixture(scope="module")
def llm(tiny_chat_model_dir):
    return LLM(str(tiny_chat_model_dir), device="cpu", kv_cache_memory="32MiB", max_beam_width=16)


def _valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_sampled_outputs_always_validate(llm):
    params = [SamplingParams(max_new_tokens=MAX_TOKENS, temperature=1.2, seed=seed,
                             response_format=PERSON_FORMAT)
              for seed in range(32)]
    outputs = [llm.generate([PROMPTS[seed % len(PROMPTS)]], p, use_tqdm=False)[0]
               for seed, p in enumerate(params)]
    texts = {o.outputs[0].text for o in outputs}
    assert len(texts) > 16, "the seeds give different outputs"
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        _valid(output.outputs[0].text, PERSON)
    free = llm.generate(PROMPTS, SamplingParams(max_new_tokens=40, temperature=1.2, seed=0), use_tqdm=False)
    with pytest.raises(ValueError):  # without the grammar this model writes no JSON: the check can fail
        for output in free:
            _valid(output.outputs[0].text, PERSON)


@pytest.mark.parametrize("width", [1, 4, 16])
def test_every_beam_validates(llm, width):
    params = BeamSearchParams(beam_width=width, max_new_tokens=MAX_TOKENS, response_format=PERSON_FORMAT)
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        assert len(output.outputs) == width
        for beam in output.outputs:
            assert beam.finish_reason == "stop", beam.text
            _valid(beam.text, PERSON)
    pool = llm.stats()["pools"]["self"]
    assert pool["free_blocks"] == pool["total_blocks"]


def test_json_object_mode(llm):
    fmt = {"type": "json_object"}
    outputs = [llm.generate([PROMPTS[i % 4]],
                            SamplingParams(max_new_tokens=MAX_TOKENS, temperature=1.0, seed=i,
                                                             response_format=fmt), use_tqdm=False)[0]
               for i in range(8)]
    outputs += llm.generate(PROMPTS,
                            BeamSearchParams(beam_width=4, max_new_tokens=MAX_TOKENS, response_format=fmt),
                            use_tqdm=False)
    for output in outputs:
        for completion in output.outputs:
            # an object's strings are unbounded: it may run out of tokens
            if completion.finish_reason == "stop":
                assert isinstance(json.loads(completion.text), dict)


class ReplayedGrammar(LogitsProcessor):
    """The plain reference: a fresh matcher per row per step, fed the row's whole output, then masking."""

    def __init__(self, compiled_grammar, prompt_len: int, vocab_size: int, eos: int):
        import xgrammar

        self.xgr, self.compiled, self.prompt_len, self.vocab_size = (xgrammar, compiled_grammar, prompt_len,
                                                                     vocab_size)
        self.eos = eos

    def __call__(self, input_ids, scores):
        bitmask = self.xgr.allocate_token_bitmask(scores.shape[0], self.vocab_size)
        for row, ids in enumerate(input_ids.tolist()):
            generated = ids[self.prompt_len:]
            if self.eos in generated:  # HF's filler beam (-inf) when fewer real ones remain: nothing allowed
                bitmask[row] = 0
                continue
            matcher = self.xgr.GrammarMatcher(self.compiled)
            for token in generated:
                assert matcher.accept_token(token)
            matcher.fill_next_token_bitmask(bitmask, row)
        self.xgr.apply_token_bitmask_inplace(scores, bitmask, vocab_size=self.vocab_size)
        return scores


@pytest.mark.parametrize("width", [4, 16])
def test_forked_grammar_beams_equal_transformers_with_a_replayed_grammar(llm, tiny_chat_model_dir, width):
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_chat_model_dir), dtype=torch.float32).eval()
    tokenizer = llm.tokenizer
    compiled = llm.engine.grammars.constraint(PERSON_FORMAT).compiled_grammar
    params = BeamSearchParams(beam_width=width, max_new_tokens=40, response_format=PERSON_FORMAT)
    for prompt in PROMPTS[:2]:
        ids = tokenizer.encode(prompt)
        output = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        processor = ReplayedGrammar(compiled, len(ids), llm.engine.arch.vocab_size, tokenizer.eos_token_id)
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), num_beams=width, do_sample=False, max_new_tokens=40,
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                   logits_processor=LogitsProcessorList([processor]), output_scores=True,
                                   return_dict_in_generate=True, num_return_sequences=width)
        assert_beams_match(output, expected, len(ids), tokenizer.pad_token_id, tokenizer.eos_token_id, width,
                           f"W={width} {prompt!r}")


@pytest.mark.parametrize(("response_format", "needle"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "nonsense"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}},
     "properties"),
    ({"type": "yaml"}, "type"),
    ({"type": "json_schema"}, "json_schema"),
])
def test_bad_formats_name_the_problem(llm, response_format, needle):
    with pytest.raises(InvalidParameterError) as info:
        llm.engine.add_request("bad", "x", SamplingParams(response_format=response_format))
    assert info.value.param == "response_format" and needle in str(info.value)
    assert not llm.engine.has_unfinished()


# -- over HTTP ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60)


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    # bounded: fits MAX_TOKENS
    tags: list[typing.Literal["red", "green", "blue"]] = pydantic.Field(max_length=3)


def test_chat_json_schema_whole_streamed_and_parsed(client):
    messages = [{"role": "user", "content": "Describe a person."}]
    kwargs = {"model": "tiny-chat", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 1.0}
    for seed in range(4):
        whole = client.chat.completions.create(response_format=PERSON_FORMAT, seed=seed, **kwargs).choices[0]
        _valid(whole.message.content, PERSON)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            response_format=PERSON_FORMAT, seed=seed, stream=True, **kwargs) if c.choices)
        assert streamed == whole.message.content
    parsed = client.chat.completions.parse(response_format=Person, seed=0, **kwargs).choices[0].message.parsed
    assert isinstance(parsed, Person)


def test_beam_search_json_over_http(client):
    out = client.completions.create(model="tiny-chat", prompt="Person:", max_tokens=MAX_TOKENS, n=4,
                                    extra_body={"use_beam_search": True, "beam_width": 4,
                                                "response_format": PERSON_FORMAT})
    assert len(out.choices) == 4
    for choice in out.choices:
        _valid(choice.text, PERSON)


def test_bad_schema_is_a_400_naming_the_problem(client, server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, response_format=bad)
    assert info.value.body["param"] == "response_format" and "nonsense" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-chat", prompt="x", max_tokens=4, extra_body={
            "use_beam_search": True, "catalogue": "none", "response_format": PERSON_FORMAT})
    assert info.value.body["param"] == "response_format"
    samples = server.wait_idle()
    assert samples["widebeam_requests_running"] == 0
    assert all(free == total for free, total in server.pools().values())
