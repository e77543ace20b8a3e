"""The `pagedkv` command line, run in-process on the embedded model with tiny workloads."""

from __future__ import annotations

import pytest

from pagedkv.engine.cli import build_parser, main

SMALL = ["--device", "cpu", "--kv-cache-gb", "0.05", "--swap-space", "0.01"]


def test_help_lists_every_subcommand_and_engine_option(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    for cmd in ("generate", "chat", "bench", "simulate", "serve"):
        assert cmd in top
    gen_help = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for flag in ("--block-size", "--gpu-memory-utilization", "--swap-space", "--max-num-seqs",
                 "--max-num-batched-tokens", "--max-model-len", "--enable-prefix-caching",
                 "--preemption-mode", "--dtype", "--load-format", "--enforce-eager", "--seed"):
        assert flag in gen_help


def test_generate_prints_completions(capsys):
    assert main(["generate", "The capital of France is", "--max-tokens", "4", "--quiet", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out


def test_bad_option_is_a_clear_error(capsys):
    assert main(["generate", "hi", "--max-tokens", "0", "--quiet", *SMALL]) == 2
    assert "max_tokens" in capsys.readouterr().err


def _without_pagedkv_bench(monkeypatch):
    """The `pagedkv` command as it is when pagedkv-bench is not installed: its entry points are
    not found."""
    from pagedkv.engine import cli

    real = cli.entry_points

    def entry_points(group):
        return [ep for ep in real(group=group) if not ep.value.startswith("pagedkv.bench")]

    monkeypatch.setattr(cli, "entry_points", entry_points)


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "throughput", "--num-prompts", "3", "--device", "cpu"],
        ["bench", "sharing"],
        ["bench"],
        ["bench", "--help"],
        ["simulate", "--workload", "sharegpt", "--rates", "2"],
        ["simulate"],
    ],
)
def test_bench_and_simulate_without_pagedkv_bench_say_what_to_install(monkeypatch, capsys, argv):
    _without_pagedkv_bench(monkeypatch)
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert f"pagedkv {argv[0]}: needs the pagedkv-bench package" in captured.err
    assert "pip install pagedkv-bench" in captured.err
    assert "pip install packages/bench" in captured.err
    assert captured.out == ""


def test_help_without_pagedkv_bench_still_lists_bench_and_simulate(monkeypatch, capsys):
    _without_pagedkv_bench(monkeypatch)
    with pytest.raises(SystemExit):
        main(["--help"])
    top = " ".join(capsys.readouterr().out.split())  # argparse wraps the help lines
    assert top.count("(needs pagedkv-bench)") == 2
    assert "generate" in top and "serve" in top


def test_unknown_options_are_still_an_error(capsys):
    """The stand-ins take any arguments; every other command still refuses unknown ones."""
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--no-such-option", *SMALL])
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err
