"""How requests reach the core: the control socket's front door (control.py)
and its byte relay (relay.py, relay.c), the fd channel (channel.py), the
gRPC service (service.py) and health (health.py)."""
