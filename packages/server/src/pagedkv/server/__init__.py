"""OpenAI-compatible HTTP server for the pagedkv engine, with Prometheus metrics."""

from pagedkv.server.__about__ import __version__

__all__ = ["__version__"]
