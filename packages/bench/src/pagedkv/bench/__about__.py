"""Version of this distribution (SemVer)."""

__version__ = "0.1.0"
