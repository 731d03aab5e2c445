"""The capacity policy on the command line and in the engine's settings (issue #21):
`--scheduling-policy {guaranteed_no_evict,max_utilization}` and `--max-preemptions K` on serve,
generate and batch reach the engine; bad values are errors naming the setting. The same for
`--linear-backend` (#19; bench too). No model is loaded:
`LLM`, `LLMEngine` and the batch runner are replaced by recorders."""

from __future__ import annotations

import contextlib
import importlib

import pytest

from widebeam.cli import build_parser, main
from widebeam.config import EngineConfig
from widebeam.defaults import DEFAULT_LINEAR_BACKEND
from widebeam.errors import InvalidParameterError, WidebeamError

COMMANDS = {"serve": [], "generate": ["a prompt"], "batch": ["in.jsonl", "out.jsonl"]}


class Stop(WidebeamError):
    """Raised by the fake engine once it has recorded its arguments."""


@pytest.fixture()
def recorded(monkeypatch):
    seen: dict = {}

    class FakeLLM:
        def __init__(self, model="m", **kwargs):
            seen.update(kwargs)
            raise Stop("stopped before loading")

    def fake_engine(model="m", **kwargs):
        seen.update(kwargs)
        raise Stop("stopped before loading")

    def fake_run(input_path, output_path, model, **kwargs):
        seen.update(kwargs)
        raise Stop("stopped before running")

    monkeypatch.setattr("widebeam.llm.LLM", FakeLLM)
    monkeypatch.setattr("widebeam.engine.LLMEngine", fake_engine)
    monkeypatch.setattr(importlib.import_module("widebeam.batch.run"), "run", fake_run)
    return seen


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_engine_command_takes_both_flags(command):
    parser = build_parser()
    args = parser.parse_args([command, *COMMANDS[command]])
    assert (args.scheduling_policy, args.max_preemptions) == ("guaranteed_no_evict", 3)
    args = parser.parse_args([command, *COMMANDS[command], "--scheduling-policy", "max_utilization",
                              "--max-preemptions", "0"])
    assert (args.scheduling_policy, args.max_preemptions) == ("max_utilization", 0)


@pytest.mark.parametrize("flags", [["--scheduling-policy", "fifo"], ["--max-preemptions", "-1"],
                                   ["--max-preemptions", "two"]])
def test_bad_values_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "a prompt", *flags])
    assert flags[0] in capsys.readouterr().err


def command_argv(command: str, tmp_path) -> list[str]:
    """`command` with its positional arguments (batch: a real one-row input file)."""
    if command != "batch":
        return [command, *COMMANDS[command]]
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n')
    return [command, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_flags_reach_the_engine(command, recorded, tmp_path, capsys):
    argv = command_argv(command, tmp_path)
    with pytest.raises(SystemExit) if command == "generate" else contextlib.nullcontext():
        main([*argv, "--scheduling-policy", "max_utilization", "--max-preemptions", "5"])  # the fake stops it
    assert (recorded["scheduling_policy"], recorded["max_preemptions"]) == ("max_utilization", 5), recorded
    recorded.clear()
    with pytest.raises(SystemExit) if command == "generate" else contextlib.nullcontext():
        main(argv)
    assert (recorded["scheduling_policy"], recorded["max_preemptions"]) == ("guaranteed_no_evict", 3), \
        recorded


def test_engine_settings_check_the_policy():
    config = EngineConfig.from_kwargs("m", scheduling_policy="max_utilization", max_preemptions=7)
    assert (config.scheduler.scheduling_policy, config.scheduler.max_preemptions) == ("max_utilization", 7)
    assert EngineConfig.from_kwargs("m").scheduler.scheduling_policy == "guaranteed_no_evict"
    with pytest.raises(InvalidParameterError, match="scheduling_policy"):
        EngineConfig.from_kwargs("m", scheduling_policy="max-utilization")
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidParameterError, match="max_preemptions"):
            EngineConfig.from_kwargs("m", max_preemptions=bad)
    # one step loop for plain and speculative decoding: a speculative engine preempts too
    # (tests/unit/test_preemption_speculative.py)
    config = EngineConfig.from_kwargs("m", scheduling_policy="max_utilization", speculative_method="ngram")
    assert config.scheduler.scheduling_policy == "max_utilization" and config.speculative.method == "ngram"


def test_llm_takes_the_policy(tiny_llama_dir):
    from widebeam.llm import LLM
    from widebeam.params import SamplingParams

    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory="1MiB", scheduling_policy="max_utilization",
              max_preemptions=2)
    scheduler = llm.engine.scheduler
    assert (scheduler.policy, scheduler.max_preemptions) == ("max_utilization", 2)
    assert llm.stats()["scheduling"] == {"policy": "max_utilization", "preemptions": 0,
                                         "recomputed_tokens": 0,
                                         "max_preemptions": 2, "guaranteed_admissions": 0}
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_linear_backend_reaches_the_engine(command, recorded, tmp_path):
    argv = command_argv(command, tmp_path)
    for flags, expected in (([], DEFAULT_LINEAR_BACKEND), (["--linear-backend", "auto"], "auto")):
        recorded.clear()
        with pytest.raises(SystemExit) if command == "generate" else contextlib.nullcontext():
            main([*argv, *flags])
        assert recorded["linear_backend"] == expected, recorded


def test_bench_takes_the_linear_backend():
    assert build_parser().parse_args(["bench", "--linear-backend", "onednn"]).linear_backend == "onednn"
    with pytest.raises(InvalidParameterError, match="linear_backend"):
        EngineConfig.from_kwargs(linear_backend="fast")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_kv_cache_dtype_reaches_the_engine(command, recorded, tmp_path):
    """`--kv-cache-dtype` (#44) on serve, generate and batch; `auto` when not given."""
    argv = command_argv(command, tmp_path)
    for flags, expected in (([], "auto"), (["--kv-cache-dtype", "int8"], "int8")):
        recorded.clear()
        with pytest.raises(SystemExit) if command == "generate" else contextlib.nullcontext():
            main([*argv, *flags])
        assert recorded["kv_cache_dtype"] == expected, recorded


def test_a_kv_cache_dtype_the_engine_lacks_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "a prompt", "--kv-cache-dtype", "int4"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
    with pytest.raises(InvalidParameterError, match="kv_cache_dtype"):
        EngineConfig.from_kwargs(kv_cache_dtype="int4")
