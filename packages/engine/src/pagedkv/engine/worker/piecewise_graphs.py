"""Batches that carry a prompt chunk, replayed as CUDA graphs between attention calls
("piecewise" CUDA graphs, the way vLLM V1 captures its forward pass).

A decode batch replays one captured graph (`cuda_graphs`). A batch with a prompt chunk in it
ran eagerly: for Llama-3-8B about 1,400 Python-launched ops, ~25 ms of host time for a pass
an H200 computes in ~10 ms (measured under a serving load, where such steps come every few
decode steps and set the time per output token). Yet every op of a layer but attention works
token by token: run on T rows, the first n of them are the same whatever the other T - n rows
hold. So for each bucket of token counts T the forward pass is captured as a chain of graphs
cut at each attention call, and attention, whose work depends on the batch's sequences and not
only on its size, runs eagerly between them on the n real rows:

```
graph 0: embed, norm, Q/K/V projection, rotary, copy Q/K/V into static buffers
attention of layer 0 on rows [:n] (eager: reshape_and_cache, decode and prefill kernels)
graph 1: output projection, norm, MLP, next layer's norm and Q/K/V ... copy Q/K/V
...
graph L: the last output projection, MLP, final norm -> hidden states [T]; rows [:n] are real
```

The cut happens inside `Attention.forward` (`attention.graph_breaks`): while capturing, it
copies the layer's Q/K/V into static buffers shared by every layer and bucket, ends the graph
being captured, begins the next, and hands back a static output buffer that the eager
attention writes at replay time. Graphs of all buckets share one memory pool and are replayed
in the order they were captured, as one graph would be.
"""

from __future__ import annotations

import logging

import torch

from pagedkv.engine.attention import Attention, AttentionMetadata, graph_breaks

logger = logging.getLogger(__name__)

_GB = 1 << 30


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    """Token counts that get a captured chain: 64 to 512 in steps of 64, then 768, 1,024,
    1,536 and 2,048, at most `max_tokens` (larger passes are long enough on the device to hide
    their host work and run eagerly)."""
    sizes = [*range(64, 513, 64), 768, 1024, 1536, 2048]
    return [s for s in sizes if s <= max_tokens]


class PiecewiseGraphs:
    """Static inputs, the Q/K/V and attention-output buffers, and one chain of graphs per
    token-count bucket (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, *, sizes: list[int],
                 device: torch.device, dtype: torch.dtype) -> None:
        """`dtype`: the model's activations' (Q/K/V and the attention output)."""
        layer = next(m for m in model.modules() if isinstance(m, Attention))
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.device = device
        top = self.sizes[-1] if self.sizes else 0
        h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.pos = torch.zeros(top, dtype=torch.long, device=device)
        self.q = torch.zeros(top, h, d, dtype=dtype, device=device)
        self.k = torch.zeros(top, kvh, d, dtype=dtype, device=device)
        self.v = torch.zeros(top, kvh, d, dtype=dtype, device=device)
        self.out = torch.zeros(top, h * d, dtype=dtype, device=device)
        # per size: (graphs, the attention layers and caches between them, hidden states)
        self.chains: dict[int, tuple[list[torch.cuda.CUDAGraph], list, torch.Tensor]] = {}

    def size_for(self, num_tokens: int) -> int | None:
        """The bucket a pass of `num_tokens` tokens pads to (None: larger than any)."""
        if not self.chains:
            return None
        for t in self.sizes:
            if t >= num_tokens:
                return t
        return None

    # ---- the cut at attention -----------------------------------------------------------------
    def _stage(self, layer: Attention, query, key, value) -> torch.Tensor:
        """Copy a layer's Q/K/V (T rows) into the static buffers; its static output rows."""
        t = query.shape[0]
        self.q[:t].copy_(query.view(t, layer.num_heads, layer.head_dim))
        self.k[:t].copy_(key.view(t, layer.num_kv_heads, layer.head_dim))
        self.v[:t].copy_(value.view(t, layer.num_kv_heads, layer.head_dim))
        return self.out[:t]

    def _attend(self, layer: Attention, kv_cache, n: int, meta: AttentionMetadata) -> None:
        """A layer's attention on the first `n` staged rows, into the static output."""
        layer(self.q[:n], self.k[:n], self.v[:n], kv_cache, meta, out=self.out[:n])

    def forward_split(self, t: int, n: int, meta: AttentionMetadata) -> torch.Tensor:
        """The forward pass as the chain computes it, run eagerly: every op but attention on
        `t` rows of the static inputs, attention on the first `n` (tests compare this with the
        plain forward pass on the CPU, where no graph is captured)."""

        def cut(layer, query, key, value, kv_cache):
            out = self._stage(layer, query, key, value)
            with graph_breaks(None):
                self._attend(layer, kv_cache, n, meta)
            return out

        with graph_breaks(cut):
            return self.model(self.ids[:t], self.pos[:t], self.kv_caches, meta)

    # ---- capture and replay -------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture a chain per size, largest first, into one memory pool."""
        dev = self.device
        start = torch.cuda.memory_allocated(dev)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        for t in reversed(self.sizes):
            # Warm up: Triton compiles and cuBLAS picks its kernels outside the capture.
            with graph_breaks(lambda layer, q, k, v, cache: self._stage(layer, q, k, v)):
                self.model(self.ids[:t], self.pos[:t], self.kv_caches, None)
            torch.cuda.synchronize(dev)
            self.chains[t] = self._capture_chain(t, pool, stream)
        torch.cuda.synchronize(dev)
        logger.info("captured piecewise CUDA graphs for passes of %s tokens, %.2f GB",
                    self.sizes, (torch.cuda.memory_allocated(dev) - start) / _GB)

    def _capture_chain(self, t: int, pool, stream: torch.cuda.Stream):
        graphs: list[torch.cuda.CUDAGraph] = []
        calls: list = []
        current = torch.cuda.CUDAGraph()

        def cut(layer, query, key, value, kv_cache):
            nonlocal current
            out = self._stage(layer, query, key, value)
            current.capture_end()
            graphs.append(current)
            calls.append((layer, kv_cache))
            current = torch.cuda.CUDAGraph()
            current.capture_begin(pool=pool)
            return out

        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            current.capture_begin(pool=pool)
            with graph_breaks(cut):
                hidden = self.model(self.ids[:t], self.pos[:t], self.kv_caches, None)
            current.capture_end()
            graphs.append(current)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graphs, calls, hidden

    def release(self) -> None:
        self.chains.clear()

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               t: int) -> torch.Tensor:
        """The forward pass of `input_ids` / `positions` (n <= t tokens, on the device) through
        the chain of size `t`; the hidden states of the n real rows."""
        n = input_ids.shape[0]
        self.ids[:n].copy_(input_ids)
        self.pos[:n].copy_(positions)
        return self.run_chain(t, n, meta)[:n]

    def run_chain(self, t: int, n: int, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the chain of size `t` on the static inputs, attention on `n` rows between
        its graphs; its hidden states (`t` rows). `forward_split` computes the same eagerly."""
        graphs, calls, hidden = self.chains[t]
        attend = self._attend
        for graph, (layer, kv_cache) in zip(graphs, calls):
            graph.replay()
            attend(layer, kv_cache, n, meta)
        graphs[-1].replay()
        return hidden
