"""Running the daemon: the entry point and its life cycle (main.py), the
Prometheus metrics (metrics.py), what systemd is told (systemd.py)."""
