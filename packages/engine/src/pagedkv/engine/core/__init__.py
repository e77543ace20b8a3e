"""The engine core: the engine's step loop as its own process, and how the API process talks
to it.

```
API process (asyncio)                                 engine core (busy loop, no asyncio)
  AsyncLLMEngine: check, tokenize    --requests, aborts-->   EngineCore: LLMEngine.step()
  FrontendOutputs: detokenize,       <--one message/step--   (new token ids per request,
  stop strings, logprobs, streams                           finish reasons, logprobs if asked)
```

* `messages`: the wire format (msgspec structs over ZMQ);
* `engine_core`: `EngineCore`, an `LLMEngine` that answers each step with one message;
* `process`: the core's process (`python -m pagedkv.engine.core`) and its busy loop;
* `client`: `MPClient` (that process) and `InprocClient` (a thread, for tests and notebooks);
* `frontend`: what the API process does with each step message.

The offline `LLM` does not use any of this: it steps its `LLMEngine` in-process.
"""
