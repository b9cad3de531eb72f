"""The books and the core: sessions and their ports (sessions.py), who asks
(identity.py), the page pool of each device (pool/), elasticity
(elastic.py), the device workers (worker.py), the Daemon (daemon.py), and
what the core shares with recovery and asks of it (ledger.py). No
transport, no journal: the layers above call in."""
