"""Structured output: constrain a request's tokens to a JSON schema, a regex, a choice or a
grammar.

`StructuredOutputsParams` (params.py) says what the output must match and compiles it to a
grammar text; `GrammarBackend` / `StructuredRequest` (matchers.py) keep one llguidance matcher
per sequence; `bitmask.py` holds the batched token bitmask (one int32 word per 32 tokens) and its
application to the logits. The runner builds a step's bitmask on the host while the forward
pass runs and the sampler applies it with one op (see `pagedkv.engine.worker.token_masks`).
"""

from pagedkv.engine.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "StructuredOutputsParams"]
