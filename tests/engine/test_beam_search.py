"""Beam-search bookkeeping: hand-checked steps, and the same results as transformers' beam
search on small random-weight models (our sampler + BeamSearch driven by full-sequence logits)."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.engine.beam_search import Beam, BeamSearch, num_beam_candidates
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.worker.sampler import Sampler, SamplingBatch, SamplingRow

EOS = 3


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny tensors: one thread is much faster than several fighting on a busy 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _params(width=2, **kw):
    return SamplingParams(use_beam_search=True, best_of=width, n=width, temperature=0, **kw)


def _lp(probs: dict[int, float]) -> tuple[list[int], list[float]]:
    return list(probs), [math.log(p) for p in probs.values()]


def test_step_ranks_across_beams_and_plans_forks():
    bs = BeamSearch.from_params(_params(2, max_tokens=10), [EOS])
    assert bs.num_candidates == num_beam_candidates(2, 1) == 4
    r = bs.step([Beam(0, [], 0.0)], [_lp({5: 0.6, 6: 0.3, EOS: 0.05, 7: 0.05})])
    assert [(c.parent_seq_id, c.token_id) for c in r.beams] == [(0, 5), (0, 6)]
    assert r.beams[0].cum_logprob == pytest.approx(math.log(0.6))
    plan = r.fork_plan([0])
    assert [c.token_id for c in plan.continues] == [5] and [c.token_id for c in plan.forks] == [6]
    assert plan.dropped == [] and not r.done and r.finished == []
    beams = [Beam(0, [5], math.log(0.6)), Beam(1, [6], math.log(0.3))]
    # Both continuations of beam 0 beat beam 1's; beam 1 is dropped, beam 0 forks.
    r = bs.step(beams, [_lp({8: 0.5, 9: 0.4, EOS: 0.1}), _lp({8: 0.2, 9: 0.1, EOS: 0.1})])
    assert [(c.parent_seq_id, c.token_id) for c in r.beams] == [(0, 8), (0, 9)]
    plan = r.fork_plan([0, 1])
    assert plan.dropped == [1] and len(plan.forks) == 1


def test_eos_only_counts_within_the_top_beam_width_and_is_length_normalised():
    bs = BeamSearch.from_params(_params(2, max_tokens=10, length_penalty=2.0), [EOS])
    beams = [Beam(0, [5], -1.0), Beam(1, [6], -2.0)]
    # Candidates ranked: (0,EOS)=-1.1, (0,7)=-1.5, (1,EOS)=-2.1 (rank 3: not admitted), (1,7)...
    r = bs.step(
        beams,
        [
            _lp({EOS: math.exp(-0.1), 7: math.exp(-0.5)}),
            _lp({EOS: math.exp(-0.1), 7: math.exp(-0.6)}),
        ],
    )
    assert [h.output_token_ids for h in r.finished] == [[5, EOS]]
    assert r.finished[0].score == pytest.approx(-1.1 / 2**2.0)
    assert r.finished[0].stop_token_id == EOS and r.finished[0].finish_reason == "stop"
    assert [c.token_id for c in r.beams] == [7, 7]  # the two best unfinished continuations


def test_done_when_no_live_beam_can_win_and_at_max_tokens():
    bs = BeamSearch.from_params(_params(1, max_tokens=10), [EOS])
    r = bs.step([Beam(0, [], 0.0)], [_lp({EOS: 0.9, 5: 0.1})])
    # One hypothesis (-0.105) kept; best live beam at -2.3 cannot beat it: done.
    assert r.done and r.beams == [] and bs.results()[0].output_token_ids == [EOS]
    with pytest.raises(ValueError, match="already finished"):
        bs.step([Beam(0, [], 0.0)], [_lp({5: 1.0})])
    bs = BeamSearch.from_params(_params(2, max_tokens=2), [EOS])
    r = bs.step([Beam(0, [], 0.0)], [_lp({5: 0.5, 6: 0.4, 7: 0.1})])
    beams = [Beam(0, [5], math.log(0.5)), Beam(1, [6], math.log(0.4))]
    r = bs.step(beams, [_lp({8: 0.5, 9: 0.5}), _lp({8: 0.9, 9: 0.1})])
    assert r.done
    res = bs.results()
    assert [h.output_token_ids for h in res] == [[6, 8], [5, 8]]
    assert all(h.finish_reason == "length" for h in res)
    # finish(): context full before max_tokens.
    bs = BeamSearch.from_params(_params(2, max_tokens=50), [EOS])
    got = bs.finish([Beam(0, [5, 6], -1.0), Beam(1, [5, 7], -3.0)])
    assert [h.output_token_ids for h in got] == [[5, 6], [5, 7]] and bs.done


def test_bad_calls_raise():
    with pytest.raises(ValueError, match="use_beam_search"):
        BeamSearch.from_params(SamplingParams(temperature=0))
    bs = BeamSearch.from_params(_params(2), [EOS])
    with pytest.raises(ValueError, match="one candidate list per live beam"):
        bs.step([Beam(0, [], 0.0)], [])
    with pytest.raises(ValueError, match="same number"):
        bs.step([Beam(0, [1], 0.0), Beam(1, [], 0.0)], [_lp({5: 1.0}), _lp({5: 1.0})])


# ---- against transformers ------------------------------------------------------------------


def _tiny_model(kind: str, seed: int, vocab: int):
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=2,
            initializer_range=0.3,
            bos_token_id=1,
            eos_token_id=EOS,
            pad_token_id=0,
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=0.3,
            bos_token_id=1,
            eos_token_id=EOS,
            pad_token_id=0,
        )
        model = transformers.LlamaForCausalLM(cfg)
    model.eval()
    # Make "EOS" a token the model often predicts, so hypotheses do finish on it.
    with torch.no_grad():
        x = torch.randint(4, vocab, (16, 8), generator=torch.Generator().manual_seed(seed))
        top = torch.bincount(model(x).logits.argmax(-1).flatten(), minlength=vocab)
    top[:4] = -1
    return model, int(top.argmax())


@torch.no_grad()
def _ours(model, prompt, params, vocab, eos):
    bs = BeamSearch.from_params(params, [eos])
    sampler = Sampler()
    beams = [Beam(0, [], 0.0)]
    next_id = 1
    while True:
        seqs = torch.tensor([prompt + list(b.output_token_ids) for b in beams])
        logits = model(seqs).logits[:, -1, :].float()
        rows = [SamplingRow(params, prompt, b.output_token_ids) for b in beams]
        out = sampler(logits, SamplingBatch(rows, vocab_size=vocab, eos_token_ids=[eos]))
        res = bs.step(beams, [(r.beam_token_ids, r.beam_logprobs) for r in out.rows])
        if res.done:
            return bs.results()
        plan = res.fork_plan([b.seq_id for b in beams])
        forked = {id(c) for c in plan.forks}
        by_id = {b.seq_id: b for b in beams}
        new = []
        for c in res.beams:
            sid = c.parent_seq_id
            if id(c) in forked:
                sid, next_id = next_id, next_id + 1
            new.append(
                Beam(sid, [*by_id[c.parent_seq_id].output_token_ids, c.token_id], c.cum_logprob)
            )
        assert len({b.seq_id for b in new}) == len(new)
        beams = new


CASES = [
    # (model, seed, width, max_new, length_penalty, early_stopping)
    ("gpt2", 0, 4, 12, 1.0, False),
    ("gpt2", 1, 4, 10, 0.0, False),
    ("gpt2", 2, 3, 12, 2.0, False),
    ("gpt2", 3, 4, 12, 1.0, True),
    ("gpt2", 4, 2, 12, 1.5, "never"),
    ("llama", 5, 4, 12, 1.0, False),
    ("llama", 6, 4, 12, -0.5, False),
    ("llama", 7, 3, 10, 1.0, "never"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "seed", "width", "max_new", "lp", "es"), CASES)
def test_same_beams_as_transformers(kind, seed, width, max_new, lp, es):
    vocab = 48
    model, eos = _tiny_model(kind, seed, vocab)
    g = torch.Generator().manual_seed(100 + seed)
    saw_eos = saw_length = False
    for _ in range(3):
        prompt = torch.randint(
            4, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g
        ).tolist()
        params = _params(width, max_tokens=max_new, length_penalty=lp, early_stopping=es)
        ours = _ours(model, prompt, params, vocab, eos)
        hf = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_new,
            length_penalty=lp,
            early_stopping=es,
            eos_token_id=eos,
            pad_token_id=2,
            return_dict_in_generate=True,
            output_scores=True,
        )
        assert len(ours) == width
        for h, seq, score in zip(ours, hf.sequences.tolist(), hf.sequences_scores.tolist()):
            gen = seq[len(prompt) :]
            assert gen[: len(h.output_token_ids)] == h.output_token_ids
            assert all(t == 2 for t in gen[len(h.output_token_ids) :])  # only padding after
            assert h.score == pytest.approx(score, abs=1e-4)
            saw_eos |= h.output_token_ids[-1] == eos
            saw_length |= len(h.output_token_ids) == max_new
    # Every case sees hypotheses that end at max_tokens; those without a length bonus
    # also see hypotheses that end on EOS (the EOS admission and early-stop paths).
    assert saw_length and (saw_eos or lp > 1.0)
