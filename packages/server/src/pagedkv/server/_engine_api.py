"""The engine names the server uses, from `pagedkv.engine`'s public API.

The contract (docs/dev/engine-api.md) exports them from `pagedkv.engine`; while an engine
release does not re-export one yet, it is taken from the module that defines it.
"""

from __future__ import annotations

try:
    from pagedkv.engine import SamplingParams
except ImportError:  # pragma: no cover - engines that do not re-export it
    from pagedkv.engine.sampling_params import SamplingParams

try:
    from pagedkv.engine import EngineArgs
except ImportError:  # pragma: no cover
    from pagedkv.engine.arg_utils import EngineArgs

try:
    from pagedkv.engine import AsyncLLMEngine
except ImportError:  # pragma: no cover
    from pagedkv.engine.async_engine import AsyncLLMEngine

__all__ = ["AsyncLLMEngine", "EngineArgs", "SamplingParams"]
