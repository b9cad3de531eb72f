"""kvcached-service: a per-host GPU memory daemon for KV caches."""

__version__ = "0.1.0"
