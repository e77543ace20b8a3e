"""pagedkv's LLM engine: model runner, models, weight loading, sampling, offline LLM API and the pagedkv CLI."""

from pagedkv.engine.__about__ import __version__

__all__ = ["__version__"]
