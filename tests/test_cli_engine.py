"""``hybrid-jax generate`` and ``hybrid-jax bench``: argument errors and an end-to-end run."""

from __future__ import annotations

import io
import json

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from hybrid_jax.cli import main

SMALL = ["--max-batch", "2", "--max-tokens", "16", "--max-context", "32", "--impl", "reference"]


def run(argv, capsys, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_generate_rejects_invalid_sampling_flags_before_building_a_model(capsys):
    code, _, err = run(["generate", "hi", "--top-p", "2"], capsys)
    assert code == 2 and "--top-p=2.0" in err
    code, _, err = run(["generate", "hi", "--logprobs", "21"], capsys)
    assert code == 2 and "--logprobs=21 must be None or an int in 0..20" in err


def test_generate_reports_a_bad_engine_size_without_a_traceback(capsys):
    code, _, err = run(["generate", "hi", "--max-context", "100"], capsys)
    assert code == 2 and "--max-context=100 is not a multiple of page_size=16" in err


def test_generate_without_prompts_says_so(capsys, monkeypatch):
    code, _, err = run(["generate"], capsys, stdin="\n  \n", monkeypatch=monkeypatch)
    assert code == 2 and "no prompt given" in err


@pytest.fixture
def restore_cache_config():
    """The engine points JAX's persistent cache at its directory, a process-wide setting."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.mark.slow
@pytest.mark.usefixtures("restore_cache_config")
def test_generate_streams_stdin_prompts_and_bench_prints_its_table(capsys, monkeypatch, tmp_path):
    cache = ["--cache-dir", str(tmp_path)]
    argv = ["generate", "--max-new-tokens", "3", "--logprobs", "2", *SMALL, *cache]
    code, out, err = run(argv, capsys, stdin="ab\ncd\n", monkeypatch=monkeypatch)
    assert code == 0 and out.startswith("[") and "2 requests, 6 tokens" in err
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert sorted(line["prompt"] for line in lines) == [0, 1]
    assert all(len(line["logprobs"]) == len(line["top_logprobs"]) == 3 for line in lines)
    argv = ["bench", "--num-prompts", "3", "--prompt-len", "5", "--new-tokens", "2", "--plot", ""]
    code, out, _ = run([*argv, *SMALL, *cache], capsys)
    assert code == 0 and "retraces after warm-up: 0" in out and "DECODE step" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--new-tokens", "0"], "--new-tokens=0 must be >= 1"),
        (["bench", "--num-prompts", "0"], "--num-prompts=0 must be >= 1"),
        (["bench", "--plot", "missing/dir/x.png"], "--plot=missing/dir/x.png: its folder"),
        (["generate", "hi", "--max-context", "0"], "--max-context=0 must be an int >= 1"),
        (
            ["generate", "hi", "--batch-invariant", "--speculative", "ngram"],
            "--batch-invariant=True with speculative decoding is not built",
        ),
    ],
)
def test_bad_flags_get_one_line_naming_the_flag_before_any_compile(capsys, argv, message):
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("hybrid-jax ")
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "(default: 32)" in capsys.readouterr().out


def test_a_prompt_that_is_not_utf8_is_refused(capsys):
    code, _, err = run(["generate", "bad \udcff byte"], capsys)
    assert code == 2 and "not valid UTF-8" in err


def test_ctrl_c_exits_130_without_a_traceback(capsys, monkeypatch):
    import hybrid_jax.cli.serving as serving

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(serving, "generate", interrupted)  # main() builds its parsers anew
    code, _, err = run(["generate", "hi"], capsys)
    assert code == 130 and err.strip() == "hybrid-jax: interrupted"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "x" * 40, "--max-context", "32"], "prompt 0 has 40 tokens, longer than "
         "--max-context=32"),
        (["generate", "hi", "--stop-token-id", "300"], "--stop-token-id 300 is outside the "
         "vocabulary"),
    ],
)  # fmt: skip
def test_prompt_problems_are_found_before_the_model_is_built(capsys, monkeypatch, argv, message):
    from hybrid_jax.engine.engine import Engine

    def not_now(*args, **kwargs):
        raise AssertionError("the model was built before the prompts were checked")

    monkeypatch.setattr(Engine, "from_preset", not_now)
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err
