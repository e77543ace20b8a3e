"""`AsyncLLMEngine` over the real engine core (in a thread of this process; the server's tests
run the same core in its own process): its outputs are the offline `LLM`'s, request for request
(greedy, stop strings, stop tokens, seeded sampling with n and best_of, logprobs, beam search);
a closed stream is aborted in the core within one step; and when the core dies /health turns
503 and streams in flight end with an error at once."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from pagedkv.engine import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.server.app import build_app

ARGS = dict(kv_cache_gb=0.25, swap_space=0.05)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ARGS)


def engine_sharing_weights(llm: LLM) -> LLMEngine:
    """A second engine (own KV cache and scheduler) on the same loaded weights."""
    return LLMEngine(EngineArgs(**ARGS), model=llm.engine.runner.model)


def cases(llm: LLM) -> list[tuple[str | list[int], SamplingParams]]:
    """Requests covering the output paths; stop strings and stop tokens are taken from a
    greedy reference output so that they do occur."""
    tok = llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=False,
                                   add_generation_prompt=True)
    base = llm.generate(["The capital of France is"], SamplingParams(max_tokens=12,
                                                                      temperature=0.0),
                        use_tqdm=False)[0].outputs[0]
    stop = base.text[4:7]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    return [
        ("The capital of France is", greedy),
        ("The capital of France is", SamplingParams(max_tokens=12, temperature=0.0, stop=[stop])),
        ("The capital of France is", SamplingParams(max_tokens=12, temperature=0.0, stop=[stop],
                                                    include_stop_str_in_output=True)),
        ("The capital of France is", SamplingParams(max_tokens=12, temperature=0.0,
                                                    stop_token_ids=[base.token_ids[3]])),
        (chat, SamplingParams(max_tokens=16, temperature=0.0, logprobs=2)),
        ([504, 1160, 1023, 253], SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6,
                                                logprobs=1)),
        ("Once upon a time", SamplingParams(n=2, best_of=3, temperature=0.9, seed=3,
                                            max_tokens=5)),
        ("Once upon a time", SamplingParams(n=2, use_beam_search=True, temperature=0.0,
                                            max_tokens=5)),
        ("Once upon a time", SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0,
                                            ignore_eos=True)),
    ]


def same_completion(got, want) -> None:
    assert got.index == want.index
    assert got.text == want.text
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    assert got.stop_reason == want.stop_reason
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)
    if want.logprobs is None:
        assert got.logprobs is None
    else:
        assert [list(p) for p in got.logprobs] == [list(p) for p in want.logprobs]
        for gp, wp in zip(got.logprobs, want.logprobs):
            for t in wp:
                assert gp[t].logprob == pytest.approx(wp[t].logprob, abs=1e-4)
                assert gp[t].rank == wp[t].rank


async def collect(engine: AsyncLLMEngine, prompt, params, rid: str, kind: str):
    outs = [o async for o in engine.generate(prompt, params, rid, output_kind=kind)]
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    return outs


@pytest.mark.slow
def test_async_engine_gives_the_offline_outputs(llm: LLM) -> None:
    requests = cases(llm)
    # One request at a time on both sides: the same batches, so the same numerics.
    want = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in requests]

    async def go() -> None:
        engine = AsyncLLMEngine(engine_sharing_weights(llm))
        try:
            for i, ((prompt, params), ref) in enumerate(zip(requests, want)):
                final = (await collect(engine, prompt, params, f"f{i}", "final"))[-1]
                assert final.prompt_token_ids == ref.prompt_token_ids
                assert len(final.outputs) == len(ref.outputs)
                for g, w in zip(final.outputs, ref.outputs):
                    same_completion(g, w)
                streamable = not params.use_beam_search and params.best_of == params.n
                if not streamable:
                    continue
                deltas = await collect(engine, prompt, params, f"d{i}", "delta")
                for w in ref.outputs:
                    parts = [c for o in deltas for c in o.outputs if c.index == w.index]
                    assert "".join(c.text for c in parts) == w.text
                    assert [t for c in parts for t in c.token_ids] == w.token_ids
                    assert [c.finish_reason for c in parts][-1] == w.finish_reason
                    assert all(c.finish_reason is None for c in parts[:-1])
                if i in (1, 5):  # a stop string, and n=2: the cumulative kind too
                    cum = await collect(engine, prompt, params, f"c{i}", "cumulative")
                    for g, w in zip(cum[-1].outputs, ref.outputs):
                        same_completion(g, w)
            assert len(engine.outputs) == 0  # nothing left behind
        finally:
            engine.shutdown()

    asyncio.run(go())


@pytest.mark.slow
def test_closed_stream_is_aborted_within_one_step(llm: LLM) -> None:
    core = engine_sharing_weights(llm)
    steps: list[tuple[float, set[str]]] = []
    core.add_step_observer(
        lambda rec: steps.append((time.monotonic(), {s.request_id for s in rec.scheduled}))
    )

    async def go() -> float:
        engine = AsyncLLMEngine(core)
        try:
            params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            gen = engine.generate("Count:", params, "long", output_kind="delta")
            got = 0
            async for out in gen:
                got += len(out.outputs[0].token_ids) if out.outputs else 0
                if got >= 3:
                    break
            closed = time.monotonic()
            await gen.aclose()
            for _ in range(200):  # the core reports the abort, then idles
                await asyncio.sleep(0.05)
                if not core.has_unfinished_requests():
                    break
            assert not core.has_unfinished_requests()
            assert engine.get_stats().num_running == 0
            return closed
        finally:
            engine.shutdown()

    closed = asyncio.run(go())
    after = [ids for end, ids in steps if end > closed and "long" in ids]
    assert len(after) <= 1, f"{len(after)} steps ran the request after its stream closed"
    assert core.scheduler.block_manager.num_free_blocks == core.scheduler.config.num_gpu_blocks


@pytest.mark.slow
def test_core_death_is_503_and_ends_streams_at_once(llm: LLM) -> None:
    core = engine_sharing_weights(llm)
    real_step = core.step
    calls = 0

    def dying_step():
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("boom: the device fell off the bus")
        return real_step()

    core.step = dying_step
    died: list[BaseException] = []

    async def go() -> None:
        engine = AsyncLLMEngine(core)
        engine.on_dead = died.append
        app = build_app(engine, served_model_names=["m"])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            assert (await c.get("/health")).status_code == 200
            start = time.monotonic()
            resp = await c.post("/v1/completions", json={
                "prompt": "Count:", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
                "stream": True})
            elapsed = time.monotonic() - start
            assert resp.status_code == 200
            events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and "error" in events[-2]
            assert "boom" in events[-2] and "service_unavailable" in events[-2]
            assert elapsed < 5
            health = await c.get("/health")
            assert health.status_code == 503 and "boom" in health.text
            late = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert late.status_code == 503
        engine.shutdown()

    asyncio.run(go())
    assert len(died) == 1 and "boom" in str(died[0])
    assert not any(t.name == "pagedkv-engine" and t.is_alive() for t in threading.enumerate())
