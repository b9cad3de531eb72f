"""Run one Python fuzz target under atheris (libFuzzer's engine, coverage of
the kvcached_service modules it imports). docs/fuzzing.md says how.

  python tests/fuzz/run.py TARGET [libFuzzer flags] [CORPUS_DIR...]

With no corpus dir given, the target's committed corpus
(tests/fuzz/corpus/TARGET) and its seeds (written to build/fuzz/seeds/TARGET)
are read and new inputs go to build/fuzz/work/TARGET. The first directory
given is where libFuzzer writes new inputs (and -merge=1 its output); the
seeds are added after the directories given, except with -merge=1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))
import targets  # noqa: E402  (not instrumented: the harness, not the code under test)

with atheris.instrument_imports(include=["kvcached_service"]):
    import kvcached_service.config  # noqa: F401
    import kvcached_service.fdchannel  # noqa: F401
    import kvcached_service.server.recovery.journal  # noqa: F401
    import kvcached_service.server.recovery.keeper  # noqa: F401


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in targets.TARGETS:
        sys.exit(f"usage: run.py {{{','.join(targets.TARGETS)}}} [libFuzzer flags] [CORPUS_DIR...]")
    name = sys.argv[1]
    # argv[0] is what libFuzzer runs again for -merge=1 (through sh): this
    # interpreter, this script and the target
    args = [f"{sys.executable} {Path(__file__).resolve()} {name}"] + sys.argv[2:]
    dirs = [a for a in args[1:] if not a.startswith("-")]
    if not dirs:
        work = targets.ROOT / "build" / "fuzz" / "work" / name
        work.mkdir(parents=True, exist_ok=True)
        args += [str(work), str(targets.CORPUS / name), str(targets.write_seeds(name, targets.ROOT / "build" / "fuzz" / "seeds" / name))]
    elif "-merge=1" not in args and all(Path(d).is_dir() for d in dirs):  # (files given: run just those)
        args.append(str(targets.write_seeds(name, targets.ROOT / "build" / "fuzz" / "seeds" / name)))
    atheris.Setup(args, getattr(targets, name))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
