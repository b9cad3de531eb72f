"""Which lines of each decoder the committed corpus and seeds reach
(stdlib `trace`, no engine): a check on what the fuzz runs explored, for
docs/fuzzing.md. Python targets only (the C and Go engines print their own
coverage).  .venv/bin/python tests/fuzz/linecov.py"""

from __future__ import annotations

import dis
import sys
import trace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import targets  # noqa: E402
from kvcached_service import config, fdchannel  # noqa: E402
from kvcached_service.server import journal, keeper  # noqa: E402

DECODERS = {
    "fdchannel": [fdchannel.decode, fdchannel._decode_request, fdchannel.decode_hot],
    "journal": [journal.Journal.read, journal.Journal._parse, journal.Journal._check_format, journal.Journal._apply,
                journal.validate, journal._session_fields, journal._labels, journal._bounded_int],
    "keeper_names": [keeper.page_of, keeper.store_format_of, keeper.listen_fds, keeper.SystemdStore.take_all],
    "keeper_records": [keeper.decode, keeper._page_ids, keeper.Keeper.handle, keeper.take_reply],
    "config": [config.load_settings, config.parse_size, config.MemoryLimit.parse, config.Settings._uid_list,
               config.Settings._mode, config.Settings._group, config.Settings._address, config.Settings._paths,
               config.Settings._backend, config.Settings._opt_size, config.Settings._size, config.Settings._limit],
}


def lines(code) -> set[int]:
    out = {ln for _, ln in dis.findlinestarts(code) if ln is not None and ln != code.co_firstlineno}
    for c in code.co_consts:
        if hasattr(c, "co_code"):
            out |= lines(c)
    return out


def main() -> None:
    for target, funcs in DECODERS.items():
        inputs = [p.read_bytes() for p in sorted((targets.CORPUS / target).glob("*"))] + targets.seeds(target)
        if target == "fdchannel":
            inputs += [p.read_bytes() for t in ("c_fdchannel", "go_fdchannel") for p in sorted((targets.CORPUS / t).glob("*"))]
        tr = trace.Trace(count=1, trace=0)
        fn = getattr(targets, target)
        for data in inputs:
            tr.runfunc(fn, data)
        counts = tr.results().counts
        total = hit = 0
        missed = []
        for f in funcs:
            f = getattr(f, "__func__", f)
            code = f.__code__
            want = lines(code)
            got = {ln for ln in want if (code.co_filename, ln) in counts}
            total, hit = total + len(want), hit + len(got)
            missed += [f"{f.__qualname__}:{ln}" for ln in sorted(want - got)]
        print(f"{target:15s} {len(inputs):4d} inputs: {hit}/{total} lines of its decoder functions reached"
              + (f"; not: {', '.join(missed)}" if missed else ""))


if __name__ == "__main__":
    main()
