"""Batched token sampling on torch tensors (any device).

One step samples N rows at once. The host builds a `SamplingBatch` from each row's
`SamplingParams`, prompt/output token ids and (for seeded requests) the sequence's index and
position; the `Sampler` then applies, in vLLM's order, the token bitmask (grammars,
allowed_token_ids, bad_words: one tensor for the batch, one op), min_tokens masking, logit
bias, repetition / frequency / presence penalties, temperature, top-k, top-p and min-p, and picks
tokens: argmax for greedy rows; for random rows, the inverse CDF of the processed
distribution at one uniform draw per sample (an exact draw that needs one random number per
row, not one per vocabulary entry). Nothing is read back to the host until the final tokens
(and logprobs) are copied out in one go; on the CPU, where reading back is free, top-p skips
the full vocabulary sort when the nucleus lies within the best few hundred logits.

Reproducible seeds: a seeded row's uniform numbers are a pure function of (seed, sequence
index, position, draw) (`seeded_uniform`), so its token stream depends only on its seed and
its own history, never on what else is in the batch, where the row sits, or whether the
request was preempted and recomputed. Unseeded rows share one generator.

Log-probabilities are those of the model's raw distribution (log_softmax of the logits before
any processing, vLLM's default): the sampled token's logprob and rank, and the top-N
alternatives. Beam-search rows get their best `num_beam_candidates` next tokens by
log-probability (after penalties) instead of a sample; `beam_search.BeamSearch` picks among them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pagedkv.engine.beam_search import num_beam_candidates
from pagedkv.engine.outputs import Logprob, TokenLogprobs
from pagedkv.engine.sampling_params import SamplingParams, SamplingType
from pagedkv.engine.structured.bitmask import apply_token_bitmask, bitmask_width
from pagedkv.engine.worker.logits_processors import (
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_k_top_p,
    penalty_pairs,
)

_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1


def child_seed(seed: int, index: int) -> int:
    """Seed of the `index`-th sequence of a seeded request (index 0 keeps the request's seed).

    With parallel sampling (n > 1) the first tokens of all n sequences are drawn by sequence
    0's row; afterwards sequence i draws from the stream of `child_seed(seed, i)`, so every
    sequence's tokens depend only on the request's seed and its own history.
    """
    if index == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & _MASK63
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & _MASK63
    return x ^ (x >> 29)


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints that scrambles every bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, seq_index: int, position: int, draw: int = 0) -> float:
    """The uniform number in [0, 1) that a seeded sequence uses for its `draw`-th sample of
    the token at `position`.

    A pure function of those four ints, so it is batch-invariant (no generator state that
    other rows or an earlier batch could advance) and survives preemption (a recomputed
    sequence samples its next position with the same number). Sequence `seq_index` of a
    request with `n > 1` has its own stream (`child_seed`); `draw` separates the `best_of`
    first tokens that one row samples at once.
    """
    x = _mix64((child_seed(seed, seq_index) + 0x9E3779B97F4A7C15) & _MASK64)
    x = _mix64(x ^ ((position << 16 | draw) & _MASK64))
    return (x >> 11) * (1.0 / (1 << 53))


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits matrix: a sequence (or a prompt, for the first token) that samples.

    `num_samples` > 1 draws that many independent tokens from this row (parallel sampling's
    first token after the prompt: `best_of` of them). Beam-search rows get candidates instead.
    A seeded row (`params.seed` set) draws `seeded_uniform(seed, seq_index, position, j)`:
    `seq_index` is the sequence's index in its request, `position` that of the token sampled.
    Unseeded rows share the batch's generator.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    num_samples: int = 1
    seq_index: int = 0
    position: int = 0


@dataclass(slots=True)
class RowSample:
    """What the sampler decided for one row."""

    token_ids: list[int]  # num_samples tokens; empty for beam-search rows
    logprobs: list[TokenLogprobs] | None  # one per token when params.logprobs is set
    # Beam-search rows: the row's best next tokens and their log-probabilities, best first.
    beam_token_ids: list[int] | None = None
    beam_logprobs: list[float] | None = None
    # Beam-search rows with params.logprobs: the raw distribution's top-N (ids, logprobs).
    top_token_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


@dataclass(slots=True)
class SamplerOutput:
    rows: list[RowSample]
    # All sampled tokens on the device, rows in order, each row's num_samples in a run
    # (beam rows contribute none): lets the runner feed the next step without a host trip.
    sampled_token_ids: torch.Tensor


class _Pack:
    """Collects host lists and ships them to the device in one copy; hands back views."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.parts: list[Sequence[float] | Sequence[int]] = []

    def add(self, values: Sequence[float] | Sequence[int]) -> int:
        self.parts.append(values)
        return len(self.parts) - 1

    def ship(self, device: torch.device) -> list[torch.Tensor]:
        parts = [torch.as_tensor(p, dtype=self.dtype) for p in self.parts]
        if not parts:
            return []
        host = torch.cat(parts)
        if device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        return list(torch.split(dev, [len(p) for p in parts]))


@dataclass(slots=True)
class _ParamInfo:
    """What the batch builder needs from one SamplingParams, computed once per object."""

    sampling_type: SamplingType
    temperature: float  # 1.0 unless random
    top_k: int  # V when off
    top_p: float  # 1.0 when off
    min_p: float  # 0.0 when off
    top_k_or_p: bool
    penalties: bool
    logprobs: int | None
    min_tokens: int
    stop_ids: list[int]  # masked until min_tokens
    beam_candidates: int
    logit_bias: list[tuple[int, float]]

    @classmethod
    def of(cls, p: SamplingParams, vocab: int, eos: list[int]) -> _ParamInfo:
        st = p.sampling_type
        rand = st in (SamplingType.RANDOM, SamplingType.RANDOM_SEED)
        k = min(p.top_k, vocab) if (rand and p.top_k > 0) else vocab
        top_p = float(p.top_p) if rand else 1.0
        stop_ids = sorted(t for t in p.all_stop_token_ids(eos) if 0 <= t < vocab)
        return cls(
            sampling_type=st,
            temperature=float(p.temperature) if rand else 1.0,
            top_k=k,
            top_p=top_p,
            min_p=float(p.min_p) if rand else 0.0,
            top_k_or_p=rand and (k < vocab or top_p < 1.0),
            penalties=p.needs_penalties,
            logprobs=p.logprobs,
            min_tokens=p.min_tokens,
            stop_ids=stop_ids,
            beam_candidates=(
                min(vocab, num_beam_candidates(p.beam_width, len(p.all_stop_token_ids(eos))))
                if st == SamplingType.BEAM
                else 0
            ),
            logit_bias=sorted(p.logit_bias.items()) if p.logit_bias else [],
        )


class SamplingBatch:
    """Everything the sampler needs about this step's rows, as device tensors.

    Build it on the host right before sampling (it reads each row's token lists only when that
    row uses penalties). `eos_token_ids` are masked, with `stop_token_ids`, for rows that have
    not reached `min_tokens`. `generator` is shared by rows without their own.
    `token_bitmask` (host int32 `[rows, ceil(V / 32)]`, see `structured.bitmask`) masks the
    tokens each row may not take; it is copied to the device without waiting.
    """

    def __init__(
        self,
        rows: Sequence[SamplingRow],
        *,
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids: Iterable[int] = (),
        generator: torch.Generator | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> None:
        device = torch.device(device)
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if token_bitmask is not None and (
            token_bitmask.dtype != torch.int32
            or tuple(token_bitmask.shape) != (len(rows), bitmask_width(vocab_size))
        ):
            raise ValueError(
                f"token_bitmask must be int32 [{len(rows)}, {bitmask_width(vocab_size)}], got "
                f"{token_bitmask.dtype} {tuple(token_bitmask.shape)}"
            )
        self.rows = list(rows)
        self.vocab_size = vocab_size
        self.device = device
        self.generator = generator
        eos = [int(t) for t in eos_token_ids]
        V = vocab_size

        temps: list[float] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        min_ps: list[float] = []
        topkp_rows: list[int] = []
        top_k_only = True
        max_k = 0
        min_p_rows: list[int] = []
        pen_rows: list[int] = []
        min_tok_rows: list[int] = []
        min_tok_ids: list[int] = []
        greedy_rows: list[int] = []
        greedy_slot_rows: list[int] = []
        greedy_slot_pos: list[int] = []
        unseeded_slot_rows: list[int] = []
        unseeded_slot_pos: list[int] = []
        seeded_slot_rows: list[int] = []
        seeded_slot_pos: list[int] = []
        seeded_u: list[float] = []
        lp_rows: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_vals: list[float] = []
        beam_rows: list[int] = []
        beam_ks: list[int] = []
        self.row_slots: list[tuple[int, int]] = []  # (first slot, count) per row
        slot = 0
        lp_index_of_row: dict[int, int] = {}

        infos: dict[int, _ParamInfo] = {}  # rows often share one SamplingParams object
        for i, row in enumerate(self.rows):
            p = row.params
            info = infos.get(id(p))
            if info is None:
                if not isinstance(p, SamplingParams):
                    raise ValueError(
                        f"row {i}: params must be SamplingParams, got {type(p).__name__}"
                    )
                info = infos[id(p)] = _ParamInfo.of(p, V, eos)
            n = row.num_samples
            if n < 1:
                raise ValueError(f"row {i}: num_samples must be >= 1, got {n}")
            st = info.sampling_type
            if info.logprobs is not None:
                lp_index_of_row[i] = len(lp_rows)
                lp_rows.append(i)
            if info.min_tokens and len(row.output_token_ids) < info.min_tokens:
                min_tok_rows.extend([i] * len(info.stop_ids))
                min_tok_ids.extend(info.stop_ids)
            if info.penalties:
                pen_rows.append(i)
            if info.logit_bias:
                for t, b in info.logit_bias:
                    if t >= V:
                        raise ValueError(
                            f"row {i}: logit_bias token id {t} is outside the vocabulary [0, {V})"
                        )
                    bias_rows.append(i)
                    bias_ids.append(t)
                    bias_vals.append(b)
            temps.append(info.temperature)
            top_ks.append(info.top_k)
            top_ps.append(info.top_p)
            if info.top_k_or_p:
                topkp_rows.append(i)
                if info.top_k < V:
                    max_k = max(max_k, info.top_k)
                if info.top_p < 1.0:
                    top_k_only = False
            if info.min_p > 0.0:
                min_p_rows.append(i)
                min_ps.append(info.min_p)

            if st == SamplingType.BEAM:
                if n != 1:
                    raise ValueError(f"row {i}: beam-search rows take num_samples=1")
                beam_rows.append(i)
                beam_ks.append(info.beam_candidates)
                self.row_slots.append((slot, 0))
                continue
            self.row_slots.append((slot, n))
            if st == SamplingType.GREEDY:
                greedy_rows.append(i)
                if n == 1:
                    greedy_slot_rows.append(len(greedy_rows) - 1)
                    greedy_slot_pos.append(slot)
                else:
                    greedy_slot_rows.extend([len(greedy_rows) - 1] * n)
                    greedy_slot_pos.extend(range(slot, slot + n))
            elif st == SamplingType.RANDOM_SEED:
                seeded_slot_rows.extend([i] * n)
                seeded_slot_pos.extend(range(slot, slot + n))
                seed, index, pos = p.seed, row.seq_index, row.position
                seeded_u.extend(seeded_uniform(seed, index, pos, j) for j in range(n))
            elif n == 1:
                unseeded_slot_rows.append(i)
                unseeded_slot_pos.append(slot)
            else:
                unseeded_slot_rows.extend([i] * n)
                unseeded_slot_pos.extend(range(slot, slot + n))
            slot += n
        self.num_slots = slot
        self.num_rows = len(self.rows)

        N = self.num_rows
        # Random slots: unseeded ones first (one draw each from the shared generator), then
        # the seeded ones (their draws, `seeded_u`, computed above).
        rand_slot_rows = unseeded_slot_rows + seeded_slot_rows
        rand_slot_pos = unseeded_slot_pos + seeded_slot_pos
        self.num_unseeded_slots = len(unseeded_slot_rows)
        # Logprob rows: which lp row each logprob-wanting slot reads.
        lp_slot_pos: list[int] = []
        lp_slot_lprow: list[int] = []
        for i in lp_rows:
            start, n = self.row_slots[i]
            lp_slot_pos.extend(range(start, start + n))
            lp_slot_lprow.extend([lp_index_of_row[i]] * n)
        self.max_num_logprobs = max((self.rows[i].params.logprobs or 0 for i in lp_rows), default=0)

        self.has_random = bool(rand_slot_rows)
        self.has_greedy = bool(greedy_rows)
        self.do_temperature = any(t != 1.0 for t in temps)
        self.do_top_k_top_p = bool(topkp_rows)
        # On the CPU, top-p looks at the best few hundred logits instead of sorting V of them
        # (sorting is slow there, and the fallback check costs no device sync).
        self.top_p_candidates = max(256, max_k) if device.type == "cpu" else None
        self.top_k_only = top_k_only
        self.max_top_k = max_k
        self.do_min_p = bool(min_p_rows)
        self.do_penalties = bool(pen_rows)
        self.do_min_tokens = bool(min_tok_rows)
        self.do_logit_bias = bool(bias_rows)
        self.do_token_mask = token_bitmask is not None
        self.lp_rows = lp_rows
        self.beam_rows = beam_rows
        self.beam_ks = beam_ks
        self.lp_slot_pos_list = lp_slot_pos

        ident = list(range(N))
        self._identity = {
            "rand": rand_slot_rows == ident,
            "greedy": greedy_rows == ident and greedy_slot_rows == ident,
            "topkp": topkp_rows == ident,
            "min_p": min_p_rows == ident,
            "lp": lp_rows == ident,
            "lp_slots": lp_slot_lprow == list(range(len(lp_slot_lprow))),
        }

        if pen_rows:
            pairs = penalty_pairs(
                pen_rows,
                [self.rows[i].prompt_token_ids for i in pen_rows],
                [self.rows[i].output_token_ids for i in pen_rows],
                V,
            )
            row_params = torch.tensor(
                [
                    [p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                    for p in (r.params for r in self.rows)
                ],
                dtype=torch.float32,
            )
            pair_params = row_params.index_select(0, pairs.rows)
        floats = _Pack(torch.float32)
        longs = _Pack(torch.long)
        fi = {
            "temps": floats.add(temps),
            "top_p": floats.add([top_ps[i] for i in topkp_rows]),
            "min_p": floats.add(min_ps),
            "seeded_u": floats.add(seeded_u),
            "bias_vals": floats.add(bias_vals),
        }
        li = {
            "top_k": longs.add([top_ks[i] for i in topkp_rows]),
            "topkp_rows": longs.add(topkp_rows),
            "min_p_rows": longs.add(min_p_rows),
            "min_tok_rows": longs.add(min_tok_rows),
            "min_tok_ids": longs.add(min_tok_ids),
            "greedy_rows": longs.add(greedy_rows),
            "greedy_slot_rows": longs.add(greedy_slot_rows),
            "greedy_slot_pos": longs.add(greedy_slot_pos),
            "rand_slot_rows": longs.add(rand_slot_rows),
            "rand_slot_pos": longs.add(rand_slot_pos),
            "lp_rows": longs.add(lp_rows),
            "lp_slot_pos": longs.add(lp_slot_pos),
            "lp_slot_lprow": longs.add(lp_slot_lprow),
            "beam_rows": longs.add(beam_rows),
            "bias_rows": longs.add(bias_rows),
            "bias_ids": longs.add(bias_ids),
        }
        if pen_rows:
            fi["pen_counts"] = floats.add(pairs.output_counts)
            fi["pen_rep"] = floats.add(pair_params[:, 0])
            fi["pen_freq"] = floats.add(pair_params[:, 1])
            fi["pen_pres"] = floats.add(pair_params[:, 2])
            li["pen_keys"] = longs.add(pairs.keys)
        fv = floats.ship(device)
        lv = longs.ship(device)
        self.t: dict[str, torch.Tensor] = {k: fv[v] for k, v in fi.items()}
        self.t.update({k: lv[v] for k, v in li.items()})
        if token_bitmask is not None:
            self.t["token_bitmask"] = token_bitmask.to(device, non_blocking=True)


class Sampler:
    """Picks next tokens for a batch of rows. Stateless; one instance serves every step.

    `sampler(logits, batch)` overwrites `logits` (float32 `[N, V]`, rows in `batch` order)
    in place while processing them.
    """

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.forward(logits, batch)

    @torch.inference_mode()
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(
                f"logits must be [num_rows={batch.num_rows}, vocab], got {tuple(logits.shape)}"
            )
        if logits.shape[1] != batch.vocab_size:
            raise ValueError(
                f"logits have vocabulary {logits.shape[1]}, the batch was built for {batch.vocab_size}"
            )
        if logits.dtype != torch.float32:
            logits = logits.float()
        if not logits.is_contiguous():
            logits = logits.contiguous()
        t = batch.t
        ident = batch._identity

        def rows_of(name: str, idx: torch.Tensor) -> torch.Tensor:
            return logits if ident[name] else logits.index_select(0, idx)

        def put_back(name: str, idx: torch.Tensor, sub: torch.Tensor) -> None:
            if not ident[name]:
                logits.index_copy_(0, idx, sub)

        # Raw distribution's logprobs, before anything touches the logits.
        raw_lp = None
        if batch.lp_rows:
            raw_lp = torch.log_softmax(rows_of("lp", t["lp_rows"]), dim=-1)

        if batch.do_token_mask:
            apply_token_bitmask(logits, t["token_bitmask"])
        if batch.do_min_tokens:
            logits.index_put_((t["min_tok_rows"], t["min_tok_ids"]), logits.new_full((), -math.inf))
        if batch.do_logit_bias:
            logits.index_put_((t["bias_rows"], t["bias_ids"]), t["bias_vals"], accumulate=True)
        if batch.do_penalties:
            apply_penalties(
                logits, t["pen_keys"], t["pen_counts"], t["pen_rep"], t["pen_freq"], t["pen_pres"]
            )

        beam_vals = beam_ids = None
        if batch.beam_rows:
            beam_lp = torch.log_softmax(logits.index_select(0, t["beam_rows"]), dim=-1)
            beam_vals, beam_ids = torch.topk(beam_lp, max(batch.beam_ks), dim=-1)

        tokens = torch.empty(batch.num_slots, dtype=torch.long, device=logits.device)
        if batch.has_greedy:
            g = rows_of("greedy", t["greedy_rows"]).argmax(dim=-1)
            if ident["greedy"]:
                tokens = g
            else:
                tokens.index_copy_(
                    0, t["greedy_slot_pos"], g.index_select(0, t["greedy_slot_rows"])
                )

        if batch.has_random:
            if batch.do_temperature:
                apply_temperature(logits, t["temps"])
            if batch.do_top_k_top_p:
                sub = rows_of("topkp", t["topkp_rows"])
                if batch.top_k_only:
                    apply_top_k(sub, t["top_k"], batch.max_top_k)
                else:
                    apply_top_k_top_p(
                        sub,
                        t["top_k"],
                        t["top_p"],
                        num_candidates=batch.top_p_candidates,
                    )
                put_back("topkp", t["topkp_rows"], sub)
            if batch.do_min_p:
                sub = rows_of("min_p", t["min_p_rows"])
                apply_min_p(sub, t["min_p"])
                put_back("min_p", t["min_p_rows"], sub)
            r = _sample_inverse_cdf(
                torch.softmax(rows_of("rand", t["rand_slot_rows"]), dim=-1),
                batch.num_unseeded_slots,
                t["seeded_u"],
                batch.generator,
            )
            if ident["rand"]:
                tokens = r
            else:
                tokens.index_copy_(0, t["rand_slot_pos"], r)

        # Logprobs of the sampled tokens and the top-N alternatives (raw distribution).
        tok_lp = tok_rank = top_vals = top_ids = None
        if raw_lp is not None:
            if batch.max_num_logprobs > 0:
                top_vals, top_ids = torch.topk(raw_lp, batch.max_num_logprobs, dim=-1)
            if batch.lp_slot_pos_list:
                slot_lp = (
                    raw_lp if ident["lp_slots"] else raw_lp.index_select(0, t["lp_slot_lprow"])
                )
                slot_tok = tokens.index_select(0, t["lp_slot_pos"])
                tok_lp = slot_lp.gather(1, slot_tok.unsqueeze(1))
                tok_rank = (slot_lp > tok_lp).sum(dim=-1).add_(1)
                tok_lp = tok_lp.squeeze(1)

        host = _to_host([tokens, tok_lp, tok_rank, top_vals, top_ids, beam_vals, beam_ids])
        h_tokens, h_tok_lp, h_rank, h_top_vals, h_top_ids, h_beam_vals, h_beam_ids = host
        return SamplerOutput(
            rows=self._assemble(
                batch, h_tokens, h_tok_lp, h_rank, h_top_vals, h_top_ids, h_beam_vals, h_beam_ids
            ),
            sampled_token_ids=tokens,
        )

    @staticmethod
    def _assemble(
        batch, h_tokens, h_tok_lp, h_rank, h_top_vals, h_top_ids, h_beam_vals, h_beam_ids
    ):
        out: list[RowSample] = []
        lp_index = {r: j for j, r in enumerate(batch.lp_rows)}
        beam_index = {r: j for j, r in enumerate(batch.beam_rows)}
        slot_lp_index = {pos: j for j, pos in enumerate(batch.lp_slot_pos_list)}
        for i, row in enumerate(batch.rows):
            start, n = batch.row_slots[i]
            toks = h_tokens[start : start + n]
            nlp = row.params.logprobs
            rs = RowSample(token_ids=toks, logprobs=None)
            if i in beam_index:
                j = beam_index[i]
                k = batch.beam_ks[j]
                rs.beam_token_ids = h_beam_ids[j][:k]
                rs.beam_logprobs = h_beam_vals[j][:k]
                if nlp is not None and nlp > 0:
                    rs.top_token_ids = h_top_ids[lp_index[i]][:nlp]
                    rs.top_logprobs = h_top_vals[lp_index[i]][:nlp]
            elif nlp is not None:
                j = lp_index[i]
                tids = h_top_ids[j][:nlp] if nlp > 0 else []
                tvals = h_top_vals[j][:nlp] if nlp > 0 else []
                rs.logprobs = [
                    TokenLogprobs(
                        token_id=toks[s],
                        logprob=h_tok_lp[slot_lp_index[start + s]],
                        rank=h_rank[slot_lp_index[start + s]],
                        top_token_ids=tids,
                        top_logprobs=tvals,
                    )
                    for s in range(n)
                ]
            out.append(rs)
        return out


@torch.inference_mode()
def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: Sequence[int], num_logprobs: int
) -> list[dict[int, Logprob]]:
    """Log-probabilities of prompt tokens (`SamplingParams.prompt_logprobs`).

    `logits[j]` are the model's logits at prompt position `j` (a chunk of positions is fine)
    and `next_token_ids[j]` the prompt token that follows it. Returns, per position, the
    following token's logprob and rank plus the top `num_logprobs` alternatives. vLLM reports
    the first prompt token as `None` (nothing predicts it): prepend that yourself.
    """
    if logits.dim() != 2 or logits.shape[0] != len(next_token_ids):
        raise ValueError(
            f"logits must be [len(next_token_ids)={len(next_token_ids)}, vocab], "
            f"got {tuple(logits.shape)}"
        )
    lp = torch.log_softmax(logits.float(), dim=-1)
    nxt = torch.as_tensor(list(next_token_ids), dtype=torch.long, device=lp.device).unsqueeze(1)
    tok_lp = lp.gather(1, nxt)
    rank = (lp > tok_lp).sum(dim=-1).add_(1)
    tensors: list[torch.Tensor | None] = [tok_lp.squeeze(1), rank, None, None]
    if num_logprobs > 0:
        tensors[2], tensors[3] = torch.topk(lp, num_logprobs, dim=-1)
    h_lp, h_rank, h_vals, h_ids = _to_host(tensors)
    return [
        TokenLogprobs(
            token_id=int(next_token_ids[j]),
            logprob=h_lp[j],
            rank=h_rank[j],
            top_token_ids=h_ids[j] if h_ids is not None else [],
            top_logprobs=h_vals[j] if h_vals is not None else [],
        ).to_dict()
        for j in range(len(next_token_ids))
    ]


def _sample_inverse_cdf(
    probs: torch.Tensor,
    num_unseeded: int,
    seeded_u: torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per row of `probs` by inverting its CDF at a uniform draw.

    One uniform number per row: the unseeded rows (first `num_unseeded`) draw from the shared
    generator, the seeded rows after them take `seeded_u` (see `seeded_uniform`). A token of probability 0 is never picked
    (its CDF step is empty), and the draw is kept strictly below the row's total so rounding
    cannot run past the last possible token.
    """
    u = torch.empty((probs.shape[0], 1), dtype=probs.dtype, device=probs.device)
    if num_unseeded:
        u[:num_unseeded].uniform_(generator=generator)
    if seeded_u.numel():
        u[num_unseeded:, 0] = seeded_u
    cdf = probs.cumsum_(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u.mul_(total), torch.nextafter(total, torch.zeros_like(total)))
    # A row whose probabilities are not finite would search past the end; keep ids valid so a
    # bad row can never crash the next forward pass.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _to_host(tensors: list[torch.Tensor | None]) -> list[list | None]:
    """Copy every result to the host with a single synchronisation, as Python lists."""
    cuda = any(x is not None and x.is_cuda for x in tensors)
    moved = [None if x is None else x.to("cpu", non_blocking=cuda) for x in tensors]
    if cuda:
        torch.cuda.current_stream().synchronize()
    return [None if x is None else x.tolist() for x in moved]
