"""The speculative decoding options of `widebeam generate`, `bench`, `serve` and `plan`: they reach
`LLM`/`LLMEngine` as keyword arguments, bad values and combinations are one line naming the flag.
No model is loaded: the engine classes are replaced by recorders that apply the engine's own config
rules (`EngineConfig.from_kwargs`). Also the speculative Prometheus metrics."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from widebeam.cli import build_parser, main
from widebeam.config import EngineConfig
from widebeam.errors import WidebeamError

SPEC_KEYS = ("speculative_model", "num_speculative_tokens", "speculative_method")


class Stop(WidebeamError):
    """Raised by the fake engines once they have recorded their arguments."""


@pytest.fixture()
def engine_kwargs(monkeypatch):
    """Replace `LLM` and `LLMEngine`: record the keyword arguments, check them as the engine would
    (config errors come out as from the real engine), then stop (serve, bench) or answer (generate)."""
    seen: dict = {}

    def record(model, **kwargs):
        seen.clear()
        seen.update(kwargs, model=model)
        seen["config"] = EngineConfig.from_kwargs(model, **kwargs)

    class FakeLLM:
        def __init__(self, model="m", **kwargs):
            record(model, **kwargs)
            self.engine = types.SimpleNamespace(apply_chat_template=lambda text: text)

        def generate(self, prompts, params, use_tqdm=False):
            choice = types.SimpleNamespace(index=0, text="ok", token_ids=[1], score=0.0,
                                           cumulative_logprob=0.0, finish_reason="length")
            return [types.SimpleNamespace(outputs=[choice], peak_blocks={}, required_blocks={})]

    def fake_engine(model="m", **kwargs):
        record(model, **kwargs)
        raise Stop("stopped before loading")

    monkeypatch.setattr("widebeam.llm.LLM", FakeLLM)
    monkeypatch.setattr("widebeam.engine.LLMEngine", fake_engine)
    return seen


def _spec(seen: dict) -> dict:
    return {k: seen[k] for k in SPEC_KEYS}


# -- parsing ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["generate", "hi"], ["bench"], ["serve"], ["plan"]])
def test_every_command_takes_the_three_flags(command):
    parser = build_parser()
    args = parser.parse_args([*command, "--speculative-model", "d", "--num-speculative-tokens", "7",
                              "--speculative-method", "draft"])
    assert (args.speculative_model, args.num_speculative_tokens, args.speculative_method) == ("d", 7, "draft")
    args = parser.parse_args(command)
    assert (args.speculative_model, args.num_speculative_tokens,
            args.speculative_method) == (None, None, None)


@pytest.mark.parametrize("command", [["generate", "hi"], ["bench"], ["serve"], ["plan"]])
@pytest.mark.parametrize("value, fragment",
                         [("0", "must be in [1, 64], got 0"), ("65", "must be in [1, 64], got 65"),
                                             ("-3", "must be in [1, 64], got -3"),
                                             ("four", "expected an integer in [1, 64], got 'four'")])
def test_num_speculative_tokens_outside_1_to_64_is_one_line_exit_2(command, value, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*command, "--num-speculative-tokens", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --num-speculative-tokens" in err[0] and fragment in err[0]


def test_unknown_method_is_rejected_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "hi", "--speculative-method", "medusa"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-method" in err and "'draft', 'ngram'" in err


# -- generate -------------------------------------------------------------------------------------

def test_generate_passes_the_flags_to_llm(engine_kwargs, capsys):
    assert main(["generate", "hi", "--speculative-model", "draft-m", "--num-speculative-tokens", "3"]) == 0
    assert _spec(engine_kwargs) == {"speculative_model": "draft-m", "num_speculative_tokens": 3,
                                    "speculative_method": None}
    spec = engine_kwargs["config"].speculative
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft", "draft-m", 3)
    assert capsys.readouterr().out.strip() == "ok"


def test_generate_without_the_flags_passes_none(engine_kwargs):
    assert main(["generate", "hi"]) == 0
    assert _spec(engine_kwargs) == dict.fromkeys(SPEC_KEYS)
    assert engine_kwargs["config"].speculative is None


def test_generate_ngram(engine_kwargs):
    assert main(["generate", "hi", "--beam-width", "2", "--speculative-method", "ngram",
                 "--num-speculative-tokens", "8"]) == 0
    spec = engine_kwargs["config"].speculative
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("ngram", None, 8)


@pytest.mark.parametrize("args, flag, fragment", [
    (["--num-speculative-tokens", "4"], "--num-speculative-tokens",
     "needs --speculative-model or --speculative-method"),
    (["--speculative-method", "draft"], "--speculative-model", "--speculative-model is required"),
    (["--speculative-method", "ngram", "--speculative-model", "m"], "--speculative-model",
     "takes no draft model"),
])
def test_generate_bad_combination_is_one_line_exit_2(engine_kwargs, capsys, args, flag, fragment):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"widebeam generate: error: argument {flag}: ")
    assert fragment in err[0] and "Traceback" not in err[0]


# -- serve ----------------------------------------------------------------------------------------

def test_serve_passes_the_flags_to_llmengine(engine_kwargs, capsys):
    rc = main(["serve", "--port", "0", "--speculative-model", "draft-m", "--num-speculative-tokens", "5",
               "--speculative-method", "draft", "--log-level", "error"])
    assert rc == 2 and "stopped before loading" in capsys.readouterr().err  # the fake engine's stop
    assert _spec(engine_kwargs) == {"speculative_model": "draft-m", "num_speculative_tokens": 5,
                                    "speculative_method": "draft"}


def test_serve_bad_combination_names_the_flag(engine_kwargs, capsys):
    rc = main(["serve", "--port", "0", "--speculative-method", "ngram", "--speculative-model", "m",
               "--log-level", "error"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("widebeam serve: error: argument --speculative-model: ") and "ngram" in err[0]


# -- bench ----------------------------------------------------------------------------------------

@pytest.fixture()
def no_transformers(monkeypatch):
    """bench imports transformers before building the engine (the fake engine stops first), and sets
    torch's thread count (kept as the suite set it)."""
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoModelForCausalLM=None))
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)


def test_bench_passes_the_flags_to_llm(engine_kwargs, no_transformers, monkeypatch, capsys):
    def fake_llm(model="m", **kwargs):  # bench's LLM stops once it has the arguments
        engine_kwargs.update(kwargs)
        raise Stop("stopped before loading")

    monkeypatch.setattr("widebeam.llm.LLM", fake_llm)
    assert main(["bench", "--no-wide", "--speculative-method", "ngram", "--num-speculative-tokens", "6"]) == 1
    assert _spec(engine_kwargs) == {"speculative_model": None, "num_speculative_tokens": 6,
                                    "speculative_method": "ngram"}
    assert "stopped before loading" in capsys.readouterr().err


def test_bench_bad_combination_names_the_flag(engine_kwargs, no_transformers, capsys):
    assert main(["bench", "--no-wide", "--num-speculative-tokens", "6"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("widebeam bench: error: argument --num-speculative-tokens: --num-speculative-tokens "
                    "needs --speculative-model or --speculative-method")]


# -- plan -----------------------------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "widebeam", *args], check=False, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args, flag, fragment", [
    (["--num-speculative-tokens", "4"], "--num-speculative-tokens", "needs --speculative-model"),
    (["--speculative-method", "draft"], "--speculative-model", "is required"),
    (["--speculative-method", "ngram", "--speculative-model", "smollm2-135m-instruct"], "--speculative-model",
     "takes no draft model"),
    (["--speculative-model", "no-such-model"], "--speculative-model", "unknown model"),
    (["--speculative-model", "smollm2-135m-instruct", "--num-speculative-tokens", "0"],
     "--num-speculative-tokens", "must be in [1, 64]"),
])
def test_plan_bad_speculative_input_is_one_line_exit_2(args, flag, fragment):
    proc = run_cli("plan", *args)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"argument {flag}: " in lines[0] and fragment in lines[0]
    assert "Traceback" not in proc.stderr


# -- metrics --------------------------------------------------------------------------------------

def _families(stats: dict) -> dict:
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from widebeam.server.metrics import ServerMetrics

    text = ServerMetrics(lambda: stats).render().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_export_the_speculative_counters_and_every_pool():
    stats = {"running": 1, "waiting": 0, "rejected": 0,
             "pools": {"self": {"total_blocks": 10, "free_blocks": 4},
                       "sliding_512": {"total_blocks": 8, "free_blocks": 8},
                       "draft": {"total_blocks": 6, "free_blocks": 2},
                       "draft/sliding_512": {"total_blocks": 5, "free_blocks": 1}},
             "speculative": {"method": "draft", "num_speculative_tokens": 4, "rounds": 3,
                             "drafted_tokens": 12, "accepted_tokens": 7}}
    families = _families(stats)
    free = {s.labels["pool"]: s.value for s in families["widebeam_kv_blocks_free"].samples}
    assert free == {"self": 4, "sliding_512": 8, "draft": 2, "draft/sliding_512": 1}
    values = {}
    for name in ("widebeam_speculative_rounds", "widebeam_speculative_drafted_tokens",
                 "widebeam_speculative_accepted_tokens", "widebeam_speculative_num_tokens"):
        (sample,) = families[name].samples
        assert sample.labels == {"method": "draft"}
        values[sample.name] = sample.value
    assert values == {"widebeam_speculative_rounds_total": 3, "widebeam_speculative_drafted_tokens_total": 12,
                      "widebeam_speculative_accepted_tokens_total": 7, "widebeam_speculative_num_tokens": 4}


def test_metrics_without_speculation_have_no_speculative_metrics():
    families = _families({"running": 0, "waiting": 0, "rejected": 0,
                          "pools": {"self": {"total_blocks": 10, "free_blocks": 10}}})
    assert not [name for name in families if "speculative" in name]
