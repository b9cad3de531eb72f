"""The daemon's journal: the least state it needs to check resume claims.

When the daemon dies, the pages its clients have mapped stay alive (the
clients' mappings and imported handles keep them). A restarted daemon reads
this journal to know which sessions existed, who owned them (uid), their
resume-token hashes, limits, and which pages each held with the page's
identity, so that it can adopt exactly the pages a returning client proves
it holds, and refuse claims that do not add up.

Format: `<state_dir>/journal.jsonl`, one JSON object per line, appended and
flushed (not fsynced: it must survive the daemon's death, not the host's).
Records: open, alloc, free, close, and a snapshot written at start-up and on
compaction (when the log grows past twice the live state). Compaction
writes a new file and renames it over the old one, atomically.
Writing costs O(pages in the call), never O(pages tracked).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("kvcached.journal")

NAME = "journal.jsonl"


@dataclass
class JSession:
    sid: int
    uid: int
    name: str
    resume_hash: str
    guaranteed_bytes: int = 0
    max_bytes: int = 0
    priority: int = 0
    labels: dict = field(default_factory=dict)
    pages: dict = field(default_factory=dict)  # page id -> (device uuid, identity)


class Journal:
    def __init__(self, state_dir: str):
        self.dir = Path(state_dir)
        self.path = self.dir / NAME
        self.sessions: dict[int, JSession] = {}
        self.next_session_id = 1
        self.next_page_id = 1
        self._lines = 0
        self._fh = None

    # ---- reading --------------------------------------------------------
    def load(self) -> None:
        """Read what a previous daemon left. A torn last line (the daemon
        died mid-write) is ignored; anything else malformed is an error."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines) - 1:
                    log.warning("journal: ignoring a torn last record")
                    continue
                raise ValueError(f"journal {self.path} line {n + 1} is corrupt") from None
            self._apply(rec)

    def _apply(self, rec: dict) -> None:
        op = rec["op"]
        if op == "snapshot":
            self.sessions = {}
            self.next_session_id = rec["next_session_id"]
            self.next_page_id = rec["next_page_id"]
            for js in rec["sessions"]:
                pages = {int(k): tuple(v) for k, v in js.pop("pages").items()}
                self.sessions[js["sid"]] = JSession(**js, pages=pages)
        elif op == "open":
            self.sessions[rec["sid"]] = JSession(
                rec["sid"], rec["uid"], rec["name"], rec["rh"], rec.get("g", 0), rec.get("m", 0), rec.get("p", 0), rec.get("labels", {})
            )
            self.next_session_id = max(self.next_session_id, rec["sid"] + 1)
        elif op == "alloc":
            js = self.sessions.get(rec["sid"])
            for pid, ident in rec["pages"]:
                if js is not None:
                    js.pages[pid] = (rec["dev"], ident)
                self.next_page_id = max(self.next_page_id, pid + 1)
        elif op == "free":
            js = self.sessions.get(rec["sid"])
            if js is not None:
                for pid in rec["pages"]:
                    js.pages.pop(pid, None)
        elif op == "close":
            self.sessions.pop(rec["sid"], None)
        elif op == "limits":
            js = self.sessions.get(rec["sid"])
            if js is not None:
                js.guaranteed_bytes, js.max_bytes, js.priority = rec["g"], rec["m"], rec["p"]
        else:
            raise ValueError(f"journal: unknown record {op!r}")

    # ---- writing --------------------------------------------------------
    def start(self, sessions: dict[int, JSession], next_session_id: int, next_page_id: int) -> None:
        """Begin a new journal with a snapshot of the given live state."""
        self._write_snapshot(sessions, next_session_id, next_page_id)

    def _write_snapshot(self, sessions: dict[int, JSession], next_session_id: int, next_page_id: int) -> None:
        snap = {
            "op": "snapshot",
            "next_session_id": next_session_id,
            "next_page_id": next_page_id,
            "sessions": [
                {
                    "sid": js.sid, "uid": js.uid, "name": js.name, "resume_hash": js.resume_hash,
                    "guaranteed_bytes": js.guaranteed_bytes, "max_bytes": js.max_bytes, "priority": js.priority,
                    "labels": js.labels, "pages": {str(k): list(v) for k, v in js.pages.items()},
                }
                for js in sessions.values()
            ],
        }
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(snap, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        if self._fh is not None:
            self._fh.close()
        self._fh = open(self.path, "a", buffering=1)
        self._lines = 1
        self._live = sum(len(js.pages) for js in sessions.values()) + len(sessions)

    def append(self, rec: dict) -> None:
        self._fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._lines += 1

    def wants_compaction(self, live_records: int) -> bool:
        return self._lines > 2 * max(live_records, 1024)

    def compact(self, sessions: dict[int, JSession], next_session_id: int, next_page_id: int) -> None:
        self._write_snapshot(sessions, next_session_id, next_page_id)

    def close(self, remove: bool = False) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if remove:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
