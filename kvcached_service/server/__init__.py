"""kvcached-serve, the daemon."""
