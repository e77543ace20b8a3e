"""pagedkv.bench: every benchmark, the paper's simulator, its workloads and cost models.

Why a distribution of its own: measuring code is not library code. The libraries (kvblocks,
pagedattn-kernels, pagedkv-scheduler, pagedkv-engine, pagedkv-server) ship without it, and this
package may import all of them. Each benchmark prints a readable table and ends its output with
one line of JSON; each records where it ran with :mod:`pagedkv.bench.env`.

Modules (each runnable as ``python -m pagedkv.bench.<module>``):

- ``throughput``: offline engine throughput against transformers (``pagedkv bench throughput``);
- ``sharing``: KV blocks saved by sharing (``pagedkv bench sharing``);
- ``serve``: load generator for OpenAI-compatible servers (``pagedkv bench serve``), the
  command; its parts are ``serve_requests``, ``serve_client``, ``serve_report``,
  ``serve_saturation`` and ``serve_compare``;
- ``sim``: trace-driven simulator, paging vs contiguous reservation (``pagedkv simulate``);
- ``kernels``: paged attention and fused kernels against copy bandwidth and SDPA (GPU);
- ``kvblocks``: the block manager's decode-step bookkeeping (CPU);
- ``scheduler``: one ``schedule()`` + ``update()`` (CPU);
- and the pieces they share: ``workloads`` (request traces), ``cost_model`` (the simulator's
  iteration time), ``roofline`` (a run against the GPU's limits), ``env``, ``common``.

Importing this package imports nothing heavy; torch is imported by the benchmarks that need it.
"""

from pagedkv.bench.__about__ import __version__

__all__ = ["__version__"]
