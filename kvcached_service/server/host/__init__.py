"""What the daemon asks of the host (the bottom layer; kvcached_service/server/__init__.py
lists them all): socket paths and their permissions (sockets.py), systemd's
notify protocol (sdnotify.py), other processes' liveness (procs.py)."""
