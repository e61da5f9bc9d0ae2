"""kiln's version, in one place (the artifact manifest, the cache key and ``kiln --version`` read it)."""
__version__ = "0.1.0"
