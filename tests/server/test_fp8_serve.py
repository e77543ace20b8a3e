"""`pagedkv serve --kv-cache-dtype fp8 --quantization fp8`: the server's command line hands both
options to the engine core (which runs them: tests/engine/test_fp8.py), and refuses bad values
before anything starts."""

from __future__ import annotations

import argparse

import pytest

from pagedkv.engine import EngineArgs
from pagedkv.server.cli import add_serve_args


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedkv serve")
    add_serve_args(parser)
    return parser.parse_args(argv)


def test_serve_passes_the_fp8_options_to_the_engine():
    args = EngineArgs.from_cli_args(_parse(["--kv-cache-dtype", "fp8", "--quantization", "fp8"]))
    assert args.kv_cache_dtype == "fp8" and args.quantization == "fp8"
    default = EngineArgs.from_cli_args(_parse([]))
    assert default.kv_cache_dtype == "auto" and default.quantization is None


@pytest.mark.parametrize("argv", [["--kv-cache-dtype", "fp9"], ["--quantization", "int4"]])
def test_serve_refuses_unknown_fp8_values(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(argv)
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
