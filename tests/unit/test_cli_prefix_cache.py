"""The prefix cache on the command line: `--no-prefix-caching` and `--pin-prefix FILE` (repeatable;
UTF-8 text, or token ids in a .json file) on serve, generate, batch and plan (bench: the first only),
their errors, and the blocks `plan` shows pinned: per pool the union over pins of the blocks pinning
holds, off the capacity requests may use. No model is loaded except in the bench test; `LLM`,
`LLMEngine` and the batch runner are replaced by recorders."""

from __future__ import annotations

import argparse
import importlib
import json
import types

import pytest

from widebeam.cli import build_parser, main
from widebeam.engine_args import error_message, prefix_cache_kwargs, read_pinned_prefix
from widebeam.errors import WidebeamError
from widebeam.model.families.arch import BUILTIN_CONFIGS
from widebeam.model.loading.arch import load_arch
from widebeam.plan import PlanError, PlanInputs, plan

T = 16
SYSTEM_TEXT = "Système: réponds brièvement ✓\n"  # non-ASCII, with its newline: the file's text as it is


class Stop(WidebeamError):
    """Raised by the fake engine once it has recorded its arguments."""


@pytest.fixture()
def pins(tmp_path):
    text = tmp_path / "system.txt"
    text.write_text(SYSTEM_TEXT, encoding="utf-8")
    ids = tmp_path / "few_shot.json"
    ids.write_text(json.dumps(list(range(3, 43))))
    return text, ids


@pytest.fixture()
def recorded(monkeypatch):
    """`LLM` and `LLMEngine` record their keyword arguments (LLM then generates a stub output, LLMEngine
    stops), and the batch runner records its own."""
    seen: dict = {}

    class FakeLLM:
        def __init__(self, model="m", **kwargs):
            seen.update(kwargs)
            self.engine = types.SimpleNamespace(apply_chat_template=lambda text: text)

        def generate(self, prompts, params, use_tqdm=False):
            choice = types.SimpleNamespace(index=0, text="x", token_ids=[5], score=-1.0,
                                           cumulative_logprob=-1.0, finish_reason="length")
            return [types.SimpleNamespace(outputs=[choice], peak_blocks={}, required_blocks={},
                                          num_cached_tokens=32)]

    def fake_engine(model="m", **kwargs):
        seen.update(kwargs)
        raise Stop("stopped before loading")

    def fake_run(input_path, output_path, model, **kwargs):
        seen.update(kwargs)
        raise Stop("stopped before running")

    monkeypatch.setattr("widebeam.llm.LLM", FakeLLM)
    monkeypatch.setattr("widebeam.engine.LLMEngine", fake_engine)
    # the module, not the package's `run` function of the same name
    monkeypatch.setattr(importlib.import_module("widebeam.batch.run"), "run", fake_run)
    return seen


# -- parsing ----------------------------------------------------------------------------------------
COMMANDS = {"serve": [], "generate": ["a prompt"], "plan": [], "batch": ["in.jsonl", "out.jsonl"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_engine_command_takes_both_flags(command):
    parser = build_parser()
    args = parser.parse_args([command, *COMMANDS[command]])
    assert (args.no_prefix_caching, args.pin_prefix) == (False, [])  # on by default, nothing pinned
    args = parser.parse_args([command, *COMMANDS[command], "--no-prefix-caching", "--pin-prefix", "a.txt",
                              "--pin-prefix", "b.json"])
    assert (args.no_prefix_caching, args.pin_prefix) == (True, ["a.txt", "b.json"])  # repeatable, in order


def test_bench_takes_no_prefix_caching_but_no_pins(capsys):
    parser = build_parser()
    assert parser.parse_args(["bench"]).no_prefix_caching is False
    assert parser.parse_args(["bench", "--no-prefix-caching"]).no_prefix_caching is True
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--pin-prefix", "a.txt"])


def test_pin_files_become_the_engines_keyword_arguments(pins):
    text, ids = pins
    args = argparse.Namespace(no_prefix_caching=False, pin_prefix=[str(text), str(ids)])
    assert prefix_cache_kwargs(args) == {"enable_prefix_caching": True,
                                         "pinned_prefixes": [SYSTEM_TEXT, list(range(3, 43))]}
    assert prefix_cache_kwargs(argparse.Namespace(no_prefix_caching=True, pin_prefix=[])) == \
        {"enable_prefix_caching": False}
    # bench: no pins at all
    assert prefix_cache_kwargs(argparse.Namespace()) == {"enable_prefix_caching": True}


@pytest.mark.parametrize("name, content, fragment", [
    ("missing.txt", None, "cannot read"),
    ("latin1.txt", b"caf\xe9", "cannot read"),
    ("empty.txt", b"", "is empty"),
    ("bad.json", b"[1, 2", "is not JSON"),
    ("object.json", b'{"ids": [1, 2]}', "JSON list of token ids"),
    ("empty.json", b"[]", "JSON list of token ids"),
    ("bools.json", b"[1, true, 3]", "JSON list of token ids"),
    ("negative.json", b"[1, -2, 3]", "JSON list of token ids"),
    ("text.json", b'"You are a helpful assistant."', "JSON list of token ids"),
])
def test_an_unusable_pin_file_is_an_error_naming_it(tmp_path, name, content, fragment):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        read_pinned_prefix(str(path))
    assert str(path) in str(exc.value) and fragment in str(exc.value)


def test_a_directory_is_an_unreadable_pin(tmp_path):
    with pytest.raises(argparse.ArgumentTypeError, match="cannot read"):
        read_pinned_prefix(str(tmp_path))


# -- the flags reach the engine ----------------------------------------------------------------------
def test_serve_passes_caching_and_pins_to_the_engine(recorded, pins, capsys):
    text, ids = pins
    assert main(["serve", "--pin-prefix", str(text), "--pin-prefix", str(ids)]) != 0  # the fake engine stops
    assert recorded["enable_prefix_caching"] is True
    assert recorded["pinned_prefixes"] == [SYSTEM_TEXT, list(range(3, 43))]
    recorded.clear()
    main(["serve", "--no-prefix-caching"])
    assert recorded["enable_prefix_caching"] is False and "pinned_prefixes" not in recorded


def test_generate_passes_them_and_reports_cached_tokens(recorded, pins, capsys):
    text, _ = pins
    assert main(["generate", "p", "--pin-prefix", str(text), "--json"]) == 0
    assert recorded["pinned_prefixes"] == [SYSTEM_TEXT] and recorded["enable_prefix_caching"] is True
    assert json.loads(capsys.readouterr().out)["num_cached_tokens"] == 32
    assert main(["generate", "p", "--no-prefix-caching"]) == 0
    assert recorded["enable_prefix_caching"] is False


def test_batch_passes_them_to_the_runner(recorded, pins, tmp_path, capsys):
    _, ids = pins
    main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--pin-prefix", str(ids),
          "--no-progress"])
    assert recorded["pinned_prefixes"] == [list(range(3, 43))] and recorded["enable_prefix_caching"] is True


@pytest.mark.parametrize("command", ["generate", "batch", "plan"])
def test_an_unreadable_pin_is_one_line_exit_2(recorded, tmp_path, capsys, command):
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(SystemExit) as exc:
        main([command, *COMMANDS[command], "--pin-prefix", str(missing)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --pin-prefix: cannot read" in err[0] and str(missing) in err[0]


def test_serve_names_an_unreadable_pin(recorded, tmp_path, capsys):
    assert main(["serve", "--pin-prefix", str(tmp_path / "nowhere.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --pin-prefix: cannot read" in err[0]
    assert "pinned_prefixes" not in recorded  # refused before the engine was built


def test_engine_errors_about_pins_name_the_flag():
    from widebeam.config import EngineConfig

    with pytest.raises(ValueError) as exc:
        EngineConfig.from_kwargs("m", pinned_prefixes=["a system prompt"], enable_prefix_caching=False)
    message = error_message(exc.value)
    assert message.startswith("argument --pin-prefix: --pin-prefix need prefix caching")
    assert "--pinned-prefixes" not in message  # the engine's name, which no flag has


# -- plan -------------------------------------------------------------------------------------------
def plan_of(pins_ids, model="smollm2-135m-instruct", t=T, **request) -> dict:
    inputs = PlanInputs(memory_bytes=request.pop("memory_bytes", 1 << 30),
                        beam_width=request.pop("beam_width", 4),
                        prompt_len=request.pop("prompt_len", 512),
                        max_new_tokens=request.pop("max_new_tokens", 64),
                        tokens_per_block=t, pinned_prefixes=tuple(tuple(ids) for ids in pins_ids))
    return plan(load_arch(str(model)), inputs)


@pytest.fixture()
def long_model(tmp_path):
    """SmolLM2-135M's shape with a position limit past its pool, so a request can fill the whole pool."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(BUILTIN_CONFIGS["smollm2-135m-instruct"],
                                    max_position_embeddings=1 << 20)))
    return path


@pytest.mark.parametrize("t", [16, 8])
@pytest.mark.parametrize("num_tokens", [16, 17, 40, 1000])
def test_one_pin_on_a_full_attention_model_holds_floor_p_over_t_blocks(num_tokens, t):
    (pool,) = plan_of([range(100, 100 + num_tokens)], t=t)["pools"]
    assert pool["pinned_blocks"] == num_tokens // t
    assert pool["capacity_blocks"] == pool["total_blocks"] - num_tokens // t


def test_pins_sharing_blocks_hold_them_once():
    base = list(range(100, 148))  # 3 blocks
    fork = base[:32] + [7] * 16  # its first 2 blocks are base's
    result = plan_of([base, fork, base])
    assert result["pools"][0]["pinned_blocks"] == 4
    assert result["pinned_prefixes"] == {"count": 3, "tokens": [48, 48, 48], "blocks": {"self": 4}}


def test_never_fit_uses_the_capacity_less_pinned(long_model):
    # the activation reserve, hence the pool, depends on W only: size it with W = 1 first
    free = plan_of([], long_model, beam_width=1)["pools"][0]
    capacity = free["total_blocks"]
    assert (free["pinned_blocks"], free["capacity_blocks"]) == (0, capacity)
    # W = 1, P a multiple of T, N = T: floor(P/T) + 1 blocks, the whole pool
    exact = {"beam_width": 1, "prompt_len": (capacity - 1) * T, "max_new_tokens": T}
    whole = plan_of([], long_model, **exact)
    assert whole["pools"][0]["required_blocks"] == capacity and whole["fits"] is True
    pinned = plan_of([range(100, 100 + T)], long_model, **exact)  # one block pinned: now it can never fit
    assert pinned["pools"][0]["fits"] is False and pinned["fits"] is False
    assert pinned["max_concurrent_requests"] == 0


def test_requests_at_once_use_the_capacity_less_pinned():
    free = plan_of([])["pools"][0]
    capacity, required = free["total_blocks"], free["required_blocks"]
    num_pinned_blocks = capacity % required + 1  # just enough to lose one request
    result = plan_of([range(100, 100 + num_pinned_blocks * T)])
    assert result["pools"][0]["pinned_blocks"] == num_pinned_blocks
    assert result["max_concurrent_requests"] == (capacity - num_pinned_blocks) // required
    assert result["max_concurrent_requests"] == capacity // required - 1


def test_a_sliding_pool_pins_only_the_window_a_hit_needs():
    pools = {p["name"]: p for p in plan_of([range(1000, 2000)], model="gemma3-270m",
                                           memory_bytes=2 << 30)["pools"]}
    assert pools["self"]["pinned_blocks"] == 1000 // T
    assert pools["sliding_512"]["pinned_blocks"] == 512 // T  # the window reached from the pin's end
    for p in pools.values():
        assert p["capacity_blocks"] == p["total_blocks"] - p["pinned_blocks"]


@pytest.mark.parametrize("model, pin, fragment", [
    ("smollm2-135m-instruct", list(range(100, 100 + T - 1)), "fewer than one block"),
    ("smollm2-135m-instruct", [49152] * T, "outside the vocabulary"),
    ("opus-mt-en-de", list(range(100, 100 + 2 * T)), "encoder-decoder"),
])
def test_plan_refuses_the_pins_the_engine_refuses(model, pin, fragment):
    with pytest.raises(PlanError) as exc:
        plan_of([pin], model=model)
    assert exc.value.argument == "--pin-prefix" and fragment in str(exc.value)


def test_plan_refuses_pins_larger_than_a_pool():
    with pytest.raises(PlanError, match="pinned prefixes need more than") as exc:
        plan_of([[(i * 7) % 40_000 for i in range(100_000)]], memory_bytes=500 << 20)
    assert exc.value.argument == "--pin-prefix"


@pytest.fixture()
def tokenizer_dir(tmp_path):
    """A model directory with a config.json and a word-level tokenizer (one token per word): enough
    for plan, which reads no weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(50)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(str(tmp_path))
    config = dict(BUILTIN_CONFIGS["smollm2-135m-instruct"], vocab_size=len(vocab))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def run_plan(capsys, *args) -> dict:
    assert main(["plan", "--memory", "1GiB", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_tokenizes_text_pins_with_the_models_tokenizer(tokenizer_dir, tmp_path, capsys):
    words = 75  # 75 tokens: 4 full blocks
    text = tmp_path / "system.txt"
    text.write_text(" ".join(f"w{i % 50}" for i in range(words)))
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(34, 1, -1))))  # 33 tokens, 2 blocks, none shared with the text's
    for model in (str(tokenizer_dir), str(tokenizer_dir / "config.json")):
        result = run_plan(capsys, "--model", model, "--pin-prefix", str(text), "--pin-prefix", str(ids))
        assert result["pinned_prefixes"]["tokens"] == [words, 33]
        (pool,) = result["pools"]
        assert pool["pinned_blocks"] == words // T + 33 // T == result["pinned_prefixes"]["blocks"]["self"]


def test_plan_table_shows_the_pinned_blocks(tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(100, 140))))
    assert main(["plan", "--memory", "1GiB", "--pin-prefix", str(ids)]) == 0
    out = capsys.readouterr().out
    assert "pinned blocks" in out and "pinned prefixes" in out and "1 (40 tokens): self 2 blocks" in out


@pytest.mark.parametrize("args, fragment", [
    (["--no-prefix-caching"], "need prefix caching"),
    (["--model", "llama-3-8b"], "built-in shape without a tokenizer"),
])
def test_plan_text_pin_errors_are_one_line_exit_2(pins, capsys, args, fragment):
    text, _ = pins
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--pin-prefix", str(text), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --pin-prefix: " in err[0] and fragment in err[0]


def test_plan_names_the_pin_flag_for_a_pin_the_engine_would_refuse(tmp_path, capsys):
    short = tmp_path / "short.json"
    short.write_text("[1, 2, 3]")
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--pin-prefix", str(short)])
    assert exc.value.code == 2
    assert "argument --pin-prefix: prefix 0 has 3 tokens" in capsys.readouterr().err


# -- bench ------------------------------------------------------------------------------------------
def test_bench_computes_every_prompt_whole(tiny_llama_dir):
    """Each bench point must do the work transformers and the floors count: a prompt repeated (the
    next width) or sharing its start (make_prompt) must not come from the cache."""
    from widebeam import bench
    from widebeam.llm import LLM
    from widebeam.params import SamplingParams

    llm = LLM(str(tiny_llama_dir), device="cpu", tokens_per_block=8, kv_cache_memory=1 << 20,
              max_beam_width=4)
    prompt = list(range(3, 43))
    assert [bench.run_widebeam(llm, prompt, 2, 4)["num_cached_tokens"] for _ in range(2)] == [0, 0]
    # caching is on: without the bench's reset the same prompt is a hit
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_new_tokens=2, temperature=0),
                          use_tqdm=False)
    assert out.num_cached_tokens == 32
