"""What carries sessions across a daemon restart (--state-dir): the journal
(journal.py), the page store (keeper.py: a keeper process, or systemd's fd
store), and ResumeSession with the orphans of a previous daemon
(resume.py's Recovery, which the core reaches through core/ledger.py's
RecoveryPort)."""
