"""kvcached-serve, the daemon, in five layers. A module imports only its own
layer and the layers below it (tests/test_layers.py checks the import
graph against LAYERS, bottom first):

- host/        what the daemon asks of the host: socket paths and
               permissions, systemd's notify protocol, other processes
               (/proc)
- core/        the books and the core: sessions, who asks (identity), the
               page pools (pool/), elasticity, the device workers, the
               Daemon itself, and the seam to recovery (ledger.py)
- recovery/    what carries sessions across a restart: the journal, the
               page store (keeper), ResumeSession (resume.py)
- transports/  how requests arrive: the control socket and its relay, the
               fd channel, the gRPC service, health
- ops/         running it: the entry point (main.py), metrics, what
               systemd is told

docs/architecture.md draws them, from the socket to a mapped page.
"""

LAYERS = ("host", "core", "recovery", "transports", "ops")
