"""The engine's block sizes: 8 to 128 (the kernels are tested for each in
tests/kernels/test_large_block_sizes.py), anything else a clear error naming the choices."""

from __future__ import annotations

import argparse

import pytest

from pagedkv.engine.arg_utils import SUPPORTED_BLOCK_SIZES, EngineArgs


def test_supported_block_sizes_are_the_paper_sweep_from_8_to_128():
    assert SUPPORTED_BLOCK_SIZES == (8, 16, 32, 64, 128)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_engine_args_take_block_sizes_8_to_128(block_size):
    assert EngineArgs(block_size=block_size).block_size == block_size


@pytest.mark.parametrize("block_size", [4, 256, 48, 0])
def test_other_block_sizes_are_refused_with_the_choices(block_size):
    with pytest.raises(ValueError, match="block_size") as info:
        EngineArgs(block_size=block_size)
    if block_size in (4, 256):  # powers of two the kernels are not built for
        assert "(8, 16, 32, 64, 128)" in str(info.value)


def test_cli_parses_block_size_128_and_refuses_256(capsys):
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli_args(p.parse_args(["--block-size", "128"])).block_size == 128
    with pytest.raises(SystemExit):
        p.parse_args(["--block-size", "256"])
    assert "invalid choice" in capsys.readouterr().err
