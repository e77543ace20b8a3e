"""Per-token cost of three grammar engines on the CPU: the measurement behind pagedkv's choice.

For structured output the host computes, before every sampling step, a bitmask of the tokens
each constrained sequence may take next (a row of ceil(V / 32) int32 words), and advances each
sequence's matcher by the token it took. This script times exactly that for xgrammar,
llguidance and outlines-core on the embedded model's tokenizer (SmolLM2, vocabulary 49,152):
a batch of rows, each walking its own grammar (a JSON schema, a regex) by random allowed tokens,
and reports per backend the compile time, the mean (and median, p90) microseconds per row per
token for the mask, the mean for the accept, single-threaded (what one engine loop pays), and
the mean wall time of one whole batch's masks with the library's own parallel fill (threads).

    python scripts/structured_backends.py                 # 32 rows, 48 steps, 3 rounds
    python scripts/structured_backends.py --rows 128 --steps 32

Prints a table and one line of JSON. Needs `pip install xgrammar llguidance outlines-core`
(whichever is missing is skipped).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}, [0-9]{1,5} [A-Za-z ]{3,30}, [0-9]{5}"


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten()


class _Backend:
    """One grammar engine behind four calls: compile, new matcher, fill a row, accept."""

    name: str

    def compile(self, kind: str): ...
    def matcher(self, compiled): ...
    def fill(self, m, bitmask: torch.Tensor, row: int) -> None: ...
    def accept(self, m, token: int) -> bool: ...
    def done(self, m) -> bool: ...
    def fill_batch(self, ms, bitmask: torch.Tensor) -> None:
        for i, m in enumerate(ms):
            self.fill(m, bitmask, i)


class XGrammar(_Backend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher() if hasattr(xgr, "BatchGrammarMatcher") else None

    def compile(self, kind):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        return self.compiler.compile_regex(REGEX)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask, row):
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m, token):
        return m.accept_token(token)

    def done(self, m):
        return m.is_terminated()

    def fill_batch(self, ms, bitmask):
        if self.batch is None:
            return super().fill_batch(ms, bitmask)
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)


class LLGuidance(_Backend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.executor = llguidance.LLExecutor()

    def compile(self, kind):
        LLM = self.ll.LLMatcher
        if kind == "json":
            g = LLM.grammar_from_json_schema(
                json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
            )
        else:
            g = LLM.grammar_from_regex(REGEX)
        err = LLM.validate_grammar(g, self.tok)
        if err:
            raise ValueError(err)
        return g

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled)

    def fill(self, m, bitmask, row):
        self.ll.torch.fill_next_token_bitmask(m, bitmask, row)

    def accept(self, m, token):
        return m.consume_token(token)

    def done(self, m):
        return m.is_stopped()

    def fill_batch(self, ms, bitmask):
        self.ll.torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(ms)], bitmask
        )


def _byte_vocabulary(tokenizer) -> dict[bytes, list[int]]:
    """Token bytes of a byte-level BPE tokenizer (GPT-2's unicode mapping undone)."""
    # GPT-2's printable stand-ins for the 256 byte values.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    stand_in = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in stand_in:
            stand_in[b] = chr(256 + extra)
            extra += 1
    inv = {c: b for b, c in stand_in.items()}
    special = set(tokenizer.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for tok, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        try:
            b = bytes(inv[c] for c in tok)
        except KeyError:
            b = tok.encode()
        out.setdefault(b, []).append(i)
    return out


class OutlinesCore(_Backend):
    name = "outlines-core"

    def __init__(self, tokenizer, vocab: int) -> None:
        import outlines_core

        self.oc = outlines_core
        self.vocab = outlines_core.Vocabulary(tokenizer.eos_token_id, _byte_vocabulary(tokenizer))

    def compile(self, kind):
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(SCHEMA)) if kind == "json" else REGEX
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, m, bitmask, row):
        r = bitmask[row]
        m.write_mask_into(r.data_ptr(), r.numel(), r.element_size())

    def accept(self, m, token):
        m.advance(token)
        return True

    def done(self, m):
        return m.is_finished()


def run(backend: _Backend, kind: str, rows: int, steps: int, vocab: int, seed: int) -> dict:
    t0 = time.perf_counter()
    compiled = backend.compile(kind)
    compile_ms = 1e3 * (time.perf_counter() - t0)
    rng = random.Random(seed)
    ms = [backend.matcher(compiled) for _ in range(rows)]
    bitmask = torch.zeros((rows, (vocab + 31) // 32), dtype=torch.int32)
    fill_us: list[float] = []
    accept_us: list[float] = []
    batch_ms: list[float] = []
    clock = time.perf_counter
    for step in range(steps):
        for i, m in enumerate(ms):
            if backend.done(m):
                ms[i] = backend.matcher(compiled)
        # Even steps: one row at a time (timed per row); odd steps: the library's batch fill.
        # Never both on one state: a second fill of the same state would hit a cache.
        if step % 2 == 0:
            for i, m in enumerate(ms):
                t = clock()
                backend.fill(m, bitmask, i)
                fill_us.append(1e6 * (clock() - t))
        else:
            t = clock()
            backend.fill_batch(ms, bitmask)
            batch_ms.append(1e3 * (clock() - t))
        for i, m in enumerate(ms):
            allowed = _allowed(bitmask[i], vocab).tolist()
            tok = rng.choice(allowed)
            t = clock()
            ok = backend.accept(m, tok)
            accept_us.append(1e6 * (clock() - t))
            if ok is False:
                raise RuntimeError(f"{backend.name} refused token {tok} it allowed")
    return {
        "backend": backend.name, "grammar": kind, "compile_ms": round(compile_ms, 1),
        "mask_us_per_row": round(statistics.fmean(fill_us), 1),
        "mask_us_median": round(statistics.median(fill_us), 1),
        "mask_us_p90": round(sorted(fill_us)[int(0.9 * len(fill_us))], 1),
        "accept_us": round(statistics.fmean(accept_us), 1),
        "batch_mask_ms": round(statistics.fmean(batch_ms), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="best mean of this many rounds")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from pagedkv.engine.config import ModelConfig

    tokenizer = ModelConfig.from_model(None, device="cpu").get_tokenizer()
    vocab = 49152
    makers: list[Callable] = [XGrammar, LLGuidance, OutlinesCore]
    results = []
    for make in makers:
        try:
            backend = make(tokenizer, vocab)
        except ImportError as exc:
            print(f"skipping {make.name}: {exc}")
            continue
        for kind in ("json", "regex"):
            best = None
            for r in range(args.rounds):
                res = run(backend, kind, args.rows, args.steps, vocab, seed=r)
                if best is None or res["mask_us_per_row"] < best["mask_us_per_row"]:
                    best = res
            results.append(best)
    print(f"{'backend':>14} {'grammar':>7} {'compile ms':>10} {'mask us/row':>11} {'median':>7} "
          f"{'p90':>8} {'accept us':>9} {'batch ms':>8}")
    for r in results:
        print(f"{r['backend']:>14} {r['grammar']:>7} {r['compile_ms']:>10.1f} "
              f"{r['mask_us_per_row']:>11.1f} {r['mask_us_median']:>7.1f} {r['mask_us_p90']:>8.1f} "
              f"{r['accept_us']:>9.1f} {r['batch_mask_ms']:>8.2f}")
    print(f"rows {args.rows}, steps {args.steps}, vocabulary {vocab}, torch threads "
          f"{args.threads}; batch ms: one whole batch's masks with the library's parallel fill")
    print(json.dumps({"rows": args.rows, "steps": args.steps, "vocab": vocab,
                      "cpu": platform.processor() or platform.machine(),
                      "results": results}))


if __name__ == "__main__":
    main()
