"""Torch-free FCFS iteration-level scheduler with chunked prefill and preemption (swap or recompute), and a trace-driven simulator."""

from pagedkv.scheduler.__about__ import __version__

__all__ = ["__version__"]
