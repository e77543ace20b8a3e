"""pagedkv.engine: models, model runner, sampling, the offline `LLM` API and the `pagedkv` CLI.

Quick use::

    from pagedkv.engine import LLM, SamplingParams

    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))[0]
    print(out.outputs[0].text)

Names are imported lazily so that `import pagedkv.engine` stays cheap (no torch until used).
"""

from __future__ import annotations

import importlib
from typing import Any

from pagedkv.engine.__about__ import __version__

_EXPORTS = {
    "LLM": "pagedkv.engine.llm",
    "LLMEngine": "pagedkv.engine.llm_engine",
    "EngineStats": "pagedkv.engine.llm_engine",
    "AsyncLLMEngine": "pagedkv.engine.async_engine",
    "EngineDeadError": "pagedkv.engine.core.client",
    "EngineArgs": "pagedkv.engine.arg_utils",
    "SamplingParams": "pagedkv.engine.sampling_params",
    "SamplingType": "pagedkv.engine.sampling_params",
    "StructuredOutputsParams": "pagedkv.engine.structured.params",
    "GuidedDecodingParams": "pagedkv.engine.structured.params",
    "RequestOutput": "pagedkv.engine.outputs",
    "CompletionOutput": "pagedkv.engine.outputs",
    "Logprob": "pagedkv.engine.outputs",
    "RequestMetrics": "pagedkv.engine.outputs",
    "ModelConfig": "pagedkv.engine.config",
    "RunnerOutput": "pagedkv.engine.outputs",
    "StepRecord": "pagedkv.engine.step_record",
    "SeqBlocks": "pagedkv.engine.step_record",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
