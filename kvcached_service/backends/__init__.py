"""Page backends: `host` (memfd) and `cuda` (driver VMM API)."""
