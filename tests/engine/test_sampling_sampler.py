"""The batched sampler against straightforward per-row reference implementations."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.worker.logits_processors import (
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_k_top_p,
    penalty_pairs,
)
from pagedkv.engine.worker.sampler import (
    Sampler,
    SamplingBatch,
    SamplingRow,
    child_seed,
    prompt_logprobs,
    seeded_uniform,
)

V = 97


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny tensors: one thread is much faster than several fighting on a busy 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _logits(n: int, v: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale


def _sample(logits, rows, **kw):
    batch = SamplingBatch(rows, vocab_size=logits.shape[1], **kw)
    return Sampler()(logits.clone(), batch)


# ---- reference implementations (one row at a time, plain Python / float64) ----------------


def ref_top_k(row: list[float], k: int) -> list[bool]:
    kth = sorted(row, reverse=True)[k - 1]
    return [x >= kth for x in row]


def ref_top_p(row: list[float], p: float) -> list[bool]:
    finite = [x for x in row if x != -math.inf]
    mx = max(finite)
    z = sum(math.exp(x - mx) for x in finite)
    order = sorted(range(len(row)), key=lambda i: -row[i])
    keep = [False] * len(row)
    mass = 0.0
    for i in order:
        if row[i] == -math.inf:
            break
        keep[i] = True
        mass += math.exp(row[i] - mx) / z
        if mass >= p:
            break
    return keep


def ref_min_p(row: list[float], min_p: float) -> list[bool]:
    mx = max(row)
    z = sum(math.exp(x - mx) for x in row)
    probs = [math.exp(x - mx) / z for x in row]
    return [pr >= min_p * max(probs) for pr in probs]


def ref_penalties(row, prompt, output, rep, freq, pres):
    out = list(row)
    seen = set(prompt) | set(output)
    for t in seen:
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def _kept(t: torch.Tensor) -> list[list[bool]]:
    return (t != -math.inf).tolist()


# ---- logits processors --------------------------------------------------------------------


def test_top_k_matches_reference():
    logits = _logits(12)
    ks = [1, 2, 5, 17, 50, V, V, 3, 96, 1, 40, 8]
    got = apply_top_k(logits.clone(), torch.tensor(ks), max_k=96)
    want = [ref_top_k(r, k) for r, k in zip(logits.tolist(), ks)]
    assert _kept(got) == want
    # Same masks through the sorting path with top_p off.
    got2 = apply_top_k_top_p(logits.clone(), torch.tensor(ks), torch.ones(12))
    assert _kept(got2) == want
    # Kept values are untouched.
    assert torch.equal(got[got != -math.inf], logits[got != -math.inf])


@pytest.mark.parametrize("num_candidates", [None, 4, 20])
def test_top_p_matches_reference(num_candidates):
    # num_candidates (the CPU path): rows whose nucleus closes within the best 4 / 20 logits
    # use them, the others fall back to the full sort; both must give the reference mask.
    logits = _logits(16, seed=1)
    ps = [0.05, 0.1, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99, 1.0, 0.2, 0.4, 0.6, 0.8, 0.85, 0.999, 0.01]
    got = apply_top_k_top_p(
        logits.clone(), torch.full((16,), V), torch.tensor(ps), num_candidates=num_candidates
    )
    want = [ref_top_p(r, p) if p < 1 else [True] * V for r, p in zip(logits.tolist(), ps)]
    assert _kept(got) == want


@pytest.mark.parametrize("num_candidates", [None, 50, 60])
def test_top_k_then_top_p_matches_reference(num_candidates):
    logits = _logits(10, seed=2)
    ks = [3, 10, 50, 1, V, 20, 5, 7, 30, 2]
    ps = [0.5, 0.8, 0.9, 0.3, 0.6, 0.95, 0.99, 0.2, 0.7, 0.999]
    got = apply_top_k_top_p(
        logits.clone(), torch.tensor(ks), torch.tensor(ps), num_candidates=num_candidates
    )
    want = []
    for r, k, p in zip(logits.tolist(), ks, ps):
        kept_k = ref_top_k(r, k)
        masked = [x if keep else -math.inf for x, keep in zip(r, kept_k)]
        want.append(ref_top_p(masked, p))
    assert _kept(got) == want


def test_min_p_matches_reference():
    logits = _logits(8, seed=3)
    mps = [0.0, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0]
    got = apply_min_p(logits.clone(), torch.tensor(mps))
    assert _kept(got) == [ref_min_p(r, m) for r, m in zip(logits.tolist(), mps)]


def test_penalties_match_reference():
    logits = _logits(5, seed=4)
    prompts = [[1, 2, 3, 3], [], [5, 6], [7], [9]]
    outputs = [[3, 4, 4, 4], [9, 9], [], [7, 8, 8], [9, 1]]
    rep = [1.3, 0.7, 2.0, 1.0, 1.5]
    freq = [0.5, -1.0, 1.5, 0.0, 0.2]
    pres = [1.0, 0.3, -2.0, 0.0, 0.1]
    rows = [0, 1, 2, 3]  # row 4 has no penalties: left out, must stay untouched
    pairs = penalty_pairs(rows, prompts[:4], outputs[:4], V)
    per_row = torch.tensor([rep, freq, pres]).T
    pp = per_row.index_select(0, pairs.rows)
    got = apply_penalties(
        logits.clone(), pairs.keys, pairs.output_counts, pp[:, 0], pp[:, 1], pp[:, 2]
    )
    for i in range(4):
        want = ref_penalties(logits[i].tolist(), prompts[i], outputs[i], rep[i], freq[i], pres[i])
        assert got[i].tolist() == pytest.approx(want, abs=1e-5)
    assert torch.equal(got[3], logits[3])  # neutral penalties change nothing
    assert torch.equal(got[4], logits[4])
    assert pairs.keys.tolist() == sorted({r * V + t for r in rows for t in prompts[r] + outputs[r]})
    with pytest.raises(ValueError, match="token ids"):
        penalty_pairs([0], [[V]], [[]], V)
    # Through the sampler (greedy rows, so the argmax shows the penalised logits).
    sp = [
        SamplingParams(
            temperature=0,
            repetition_penalty=rep[i],
            frequency_penalty=freq[i],
            presence_penalty=pres[i],
        )
        for i in range(5)
    ]
    out = _sample(logits, [SamplingRow(sp[i], prompts[i], outputs[i]) for i in range(5)])
    for i in range(5):
        want = ref_penalties(logits[i].tolist(), prompts[i], outputs[i], rep[i], freq[i], pres[i])
        assert out.rows[i].token_ids == [max(range(V), key=lambda j: want[j])]


# ---- the sampler --------------------------------------------------------------------------


def test_greedy_is_argmax_and_penalties_apply_to_greedy():
    logits = _logits(9, seed=5)
    rows = [SamplingRow(SamplingParams(temperature=0), [1], []) for _ in range(9)]
    out = _sample(logits, rows)
    assert [r.token_ids for r in out.rows] == [[t] for t in logits.argmax(-1).tolist()]
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    # A huge repetition penalty on the argmax token moves greedy elsewhere.
    best = int(logits[0].argmax())
    logits[0, best] = 100.0
    p = SamplingParams(temperature=0, repetition_penalty=100.0)
    out = _sample(logits[:1], [SamplingRow(p, [best], [])])
    assert out.rows[0].token_ids[0] != best


def test_sampled_tokens_stay_inside_the_kept_set():
    logits = _logits(6, seed=6)
    params = [
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.2),
        SamplingParams(top_k=10, top_p=0.7, min_p=0.1, temperature=2.0),
        SamplingParams(temperature=0),
        SamplingParams(top_k=1, temperature=3.0),
    ]
    allowed = []
    for r, p in zip(logits.tolist(), params):
        keep = [True] * V
        if p.temperature == 0:
            keep = [i == max(range(V), key=lambda j: r[j]) for i in range(V)]
        if p.top_k > 0:
            keep = ref_top_k(r, p.top_k)
        scaled = [x / max(p.temperature, 1e-9) if k else -math.inf for x, k in zip(r, keep)]
        if p.top_p < 1:
            keep = ref_top_p(scaled, p.top_p)
            scaled = [x if k else -math.inf for x, k in zip(scaled, keep)]
        if p.min_p > 0:
            finite = [x for x in scaled]
            mx = max(finite)
            keep = [k and math.exp(x - mx) >= p.min_p for x, k in zip(scaled, keep)]
        allowed.append({i for i, k in enumerate(keep) if k})
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        rows = [SamplingRow(p, [], [], num_samples=2) for p in params[:4]]
        rows += [SamplingRow(p, [], []) for p in params[4:]]
        out = _sample(logits, rows, generator=gen)
        for r, ok in zip(out.rows, allowed):
            assert set(r.token_ids) <= ok
    assert allowed[5] == {int(logits[5].argmax())}


def _chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize(("temperature", "top_k"), [(0.7, 0), (1.0, 0), (1.8, 3)])
def test_sample_frequencies_follow_the_tempered_distribution(temperature, top_k):
    v = 6
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n = 30000
    params = SamplingParams(temperature=temperature, top_k=top_k)
    rows = [SamplingRow(params, [], [])] * n
    out = _sample(base.expand(n, v).contiguous(), rows, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(out.sampled_token_ids, minlength=v).tolist()
    scaled = (base / temperature).tolist()
    if top_k:
        keep = ref_top_k(scaled, top_k)
        assert all(c == 0 for c, k in zip(counts, keep) if not k)
        scaled = [x for x, k in zip(scaled, keep) if k]
        counts = [c for c, k in zip(counts, keep) if k]
    z = sum(math.exp(x) for x in scaled)
    probs = [math.exp(x) / z for x in scaled]
    # chi-square with <= 5 degrees of freedom: 20.5 is the 0.999 quantile.
    assert _chi_square(counts, probs) < 20.5


class _FakeModel:
    """Deterministic 'model': the next logits depend only on a sequence's last token."""

    def __init__(self, v: int = V) -> None:
        self.table = _logits(v, v, seed=11, scale=2.0)

    def logits(self, seqs: list[list[int]]) -> torch.Tensor:
        return self.table[torch.tensor([s[-1] for s in seqs])].clone()


def _run_steps(model, layout, steps=40):
    """layout: per step, a list of (name, params, seed or None). Returns tokens by name."""
    seqs: dict[str, list[int]] = {}
    shared = torch.Generator().manual_seed(999)
    for step in range(steps):
        entries = layout(step)
        rows = []
        for name, params, _seed in entries:
            seqs.setdefault(name, [5])
            rows.append(SamplingRow(params, [5], seqs[name][1:], position=len(seqs[name])))
        out = _sample(model.logits([seqs[n] for n, _, _ in entries]), rows, generator=shared)
        for (name, _, _), r in zip(entries, out.rows):
            seqs[name].append(r.token_ids[0])
    return {k: v[1:] for k, v in seqs.items()}


def test_seeded_rows_are_reproducible_whatever_the_batch():
    model = _FakeModel()
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    other_seeded = SamplingParams(temperature=1.2, seed=7)
    noisy = SamplingParams(temperature=1.0)
    greedy = SamplingParams(temperature=0)

    alone = _run_steps(model, lambda s: [("t", target, 1234)])["t"]

    def crowded(step):
        others = [("a", noisy, None), ("b", other_seeded, 7), ("c", greedy, None)]
        others += [(f"x{step}_{i}", noisy, None) for i in range(step % 4)]
        pos = step % (len(others) + 1)
        return [*others[:pos], ("t", target, 1234), *others[pos:]]

    assert _run_steps(model, crowded)["t"] == alone
    # Different seed -> different stream (sanity: the seed matters).
    other = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4321)
    assert _run_steps(model, lambda s: [("t", other, 4321)])["t"] != alone


def test_seeded_draws_are_a_pure_function_of_seed_index_position_and_draw():
    u = seeded_uniform(7, 0, 10, 0)
    assert 0.0 <= u < 1.0 and u == seeded_uniform(7, 0, 10, 0)
    # Any change of one of the four ints gives another number.
    others = {seeded_uniform(8, 0, 10, 0), seeded_uniform(7, 1, 10, 0),
              seeded_uniform(7, 0, 11, 0), seeded_uniform(7, 0, 10, 1)}
    assert u not in others and len(others) == 4
    # Roughly uniform: the mean of many draws is near 1/2 and they fill [0, 1).
    draws = [seeded_uniform(3, 0, pos) for pos in range(20000)]
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert min(draws) < 0.001 and max(draws) > 0.999


def test_seeded_row_samples_the_same_token_at_a_position_after_a_preemption():
    """A recomputed sequence samples position p again with the same draw: no generator state
    that the first attempt advanced."""
    logits = _logits(1, seed=21, scale=0.3)
    p = SamplingParams(temperature=1.0, seed=11)
    first = [_sample(logits, [SamplingRow(p, [1], [], position=pos)]).rows[0].token_ids
             for pos in range(30)]
    again = [_sample(logits, [SamplingRow(p, [1], [], position=pos)]).rows[0].token_ids
             for pos in range(30)]
    assert first == again
    assert len({t[0] for t in first}) > 1  # the draws differ with the position


def test_parallel_samples_from_one_row_are_seeded_and_independent():
    logits = _logits(1, seed=12, scale=0.5)
    p = SamplingParams(temperature=1.0, n=8, seed=3)
    a = _sample(logits, [SamplingRow(p, [], [], num_samples=8)])
    b = _sample(
        torch.cat([_logits(2, seed=13), logits]),
        [
            SamplingRow(SamplingParams(), [], [], num_samples=3),
            SamplingRow(SamplingParams(temperature=0), [], []),
            SamplingRow(p, [], [], num_samples=8),
        ],
    )
    assert a.rows[0].token_ids == b.rows[2].token_ids
    assert len(set(a.rows[0].token_ids)) > 1  # 8 draws from a flat distribution differ
    assert b.sampled_token_ids.shape == (3 + 1 + 8,)
    assert b.sampled_token_ids[4:].tolist() == b.rows[2].token_ids
    assert child_seed(3, 0) == 3 and len({child_seed(3, i) for i in range(8)}) == 8


def test_min_tokens_masks_eos_and_stop_tokens():
    eos, stop = 4, 9
    logits = torch.zeros(3, V)
    logits[:, eos] = 50.0
    logits[:, stop] = 40.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop])
    rows = [SamplingRow(p, [1], [7] * k) for k in (0, 2, 3)]
    out = _sample(logits, rows, eos_token_ids=[eos])
    toks = [r.token_ids[0] for r in out.rows]
    assert toks[0] not in (eos, stop) and toks[1] not in (eos, stop) and toks[2] == eos
    # ignore_eos: EOS is an ordinary token, stop_token_ids stay masked until min_tokens.
    p2 = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop], ignore_eos=True)
    out = _sample(logits[:1], [SamplingRow(p2, [1], [])], eos_token_ids=[eos])
    assert out.rows[0].token_ids == [eos]
    # Random rows too.
    p3 = SamplingParams(temperature=1.0, min_tokens=1)
    out = _sample(
        logits[:1].expand(200, V).contiguous(), [SamplingRow(p3, [], [])] * 200, eos_token_ids=[eos]
    )
    assert eos not in out.sampled_token_ids.tolist()


def test_logprobs_are_the_raw_distribution_with_ranks():
    logits = _logits(4, seed=14)
    raw = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.5, logprobs=5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, logprobs=20, n=3),
    ]
    rows = [SamplingRow(p, [1, 2], [3]) for p in params[:3]]
    rows.append(SamplingRow(params[3], [], [], num_samples=3))
    out = _sample(logits, rows, generator=torch.Generator().manual_seed(0))
    assert out.rows[2].logprobs is None
    for i in (0, 1, 3):
        n = params[i].logprobs
        assert len(out.rows[i].logprobs) == len(out.rows[i].token_ids)
        want_vals, want_ids = torch.topk(raw[i], n) if n else (torch.empty(0), torch.empty(0))
        for tl, tok in zip(out.rows[i].logprobs, out.rows[i].token_ids):
            assert tl.token_id == tok
            assert tl.logprob == pytest.approx(float(raw[i, tok]), abs=1e-6)
            assert tl.rank == 1 + int((raw[i] > raw[i, tok]).sum())
            assert tl.top_token_ids == want_ids.tolist()
            assert tl.top_logprobs == pytest.approx(want_vals.tolist(), abs=1e-6)
            assert tl.top_logprobs == sorted(tl.top_logprobs, reverse=True)
            d = tl.to_dict()
            assert next(iter(d)) == tok and d[tok].rank == tl.rank
            for r, t in enumerate(tl.top_token_ids, start=1):
                assert d[t].rank == (tl.rank if t == tok else r)
            assert len(d) in (n, n + 1)
    assert out.rows[1].logprobs[0].rank == 1  # greedy picks the rank-1 token


def test_beam_rows_give_top_candidates_of_penalised_logprobs():
    logits = _logits(2, seed=15)
    p = SamplingParams(use_beam_search=True, best_of=3, temperature=0, repetition_penalty=1.2)
    rows = [SamplingRow(p, [1, 2], [3]), SamplingRow(SamplingParams(temperature=0), [], [])]
    out = _sample(logits, rows, eos_token_ids=[0])
    ref = torch.tensor(ref_penalties(logits[0].tolist(), [1, 2], [3], 1.2, 0.0, 0.0))
    vals, ids = torch.topk(torch.log_softmax(ref, -1), 6)  # K = max(2, 1 + 1 eos) * 3
    assert out.rows[0].beam_token_ids == ids.tolist()
    assert out.rows[0].beam_logprobs == pytest.approx(vals.tolist(), abs=1e-5)
    assert out.rows[0].token_ids == []
    assert out.rows[1].token_ids == [int(logits[1].argmax())]


def test_bad_batches_raise_clear_errors():
    with pytest.raises(ValueError, match="num_samples"):
        SamplingBatch([SamplingRow(SamplingParams(), [], [], num_samples=0)], vocab_size=V)
    batch = SamplingBatch([SamplingRow(SamplingParams(), [], [])], vocab_size=V)
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, V), batch)
    with pytest.raises(ValueError, match="vocabulary"):
        Sampler()(torch.zeros(1, V + 1), batch)


@pytest.mark.gpu
def test_sampler_on_cuda_matches_cpu_for_greedy_and_is_seed_stable():
    logits = _logits(5, seed=16)
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=3), [1], [2]) for _ in range(5)]
    cpu = _sample(logits, rows)
    gpu = _sample(logits.cuda(), rows, device="cuda")
    assert [r.token_ids for r in cpu.rows] == [r.token_ids for r in gpu.rows]
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    a = _sample(logits.cuda()[4:], [SamplingRow(p, [], [], position=3)], device="cuda")
    b = _sample(
        logits.cuda(),
        [SamplingRow(SamplingParams(), [], [])] * 4 + [SamplingRow(p, [], [], position=3)],
        device="cuda",
    )
    assert a.rows[0].token_ids == b.rows[4].token_ids


def test_prompt_logprobs_and_inference_tensors():
    logits = _logits(4, seed=17)
    nxt = [5, 0, 96, 5]
    got = prompt_logprobs(logits, nxt, 3)
    raw = torch.log_softmax(logits, -1)
    for j, pos in enumerate(got):
        first = next(iter(pos))
        assert first == nxt[j]
        assert pos[first].logprob == pytest.approx(float(raw[j, nxt[j]]), abs=1e-6)
        assert pos[first].rank == 1 + int((raw[j] > raw[j, nxt[j]]).sum())
        top = torch.topk(raw[j], 3).indices.tolist()
        assert all(t in pos for t in top) and len(pos) in (3, 4)
    assert all(len(p) == 1 for p in prompt_logprobs(logits, nxt, 0))
    with pytest.raises(ValueError, match="next_token_ids"):
        prompt_logprobs(logits, nxt[:2], 1)
    # Logits made under inference_mode (as a runner makes them) can be sampled in place.
    with torch.inference_mode():
        inf_logits = _logits(2, seed=18)
    rows = [SamplingRow(SamplingParams(temperature=0, min_tokens=1), [], [])] * 2
    out = Sampler()(inf_logits, SamplingBatch(rows, vocab_size=V, eos_token_ids=[0]))
    assert len(out.rows) == 2
