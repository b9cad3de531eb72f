#!/usr/bin/env python3
"""Put kvcached-service's KV-cache hook into a llama.cpp build.

Two forms of the same change:

  apply.py TREE                      patch a llama.cpp source tree in place: the
                                     hook's sources are copied to src/ and the
                                     call sites inserted
  apply.py TREE --emit-patch FILE    the same as one git-style diff (new files
                                     included); the tree is left alone
  apply.py TREE --emit-compat DIR    Ollama's compat form, for DIR =
                                     <ollama>/llama/compat: writes
                                       DIR/kvcached_kv.h, DIR/kvcached_kv.cpp,
                                       DIR/kvcached_kv_*.{h,cpp} (its parts)
                                         (beside Ollama's own compat sources:
                                         llama/server/CMakeLists.txt compiles
                                         DIR/*.cpp into the llama target)
                                       DIR/010-kvcached-kv-cache.patch
                                         (call sites and CMake glue only, made
                                         from TREE; Ollama applies DIR/*.patch
                                         in filename order with git apply)
                                     and leaves TREE alone. --patch-name NAME
                                     changes the patch's file name.
  apply.py TREE --check              only check that every anchor is found
  apply.py TREE --list               the files the in-place form edits or adds
  apply.py TREE --onto DEST          the in-place form on DEST, made TREE's pristine
                                     copy first: copied whole (through DEST.tmp)
                                     when DEST is missing or of another llama.cpp
                                     build (TREE/.kvc-llama-build), else only the
                                     files the hook edits or adds restored from
                                     TREE (mtimes kept: a build of DEST rebuilds
                                     little); TREE is left alone

TREE is the pristine llama.cpp source the change is for (for Ollama: the
tree given as -DFETCHCONTENT_SOURCE_DIR_LLAMA_CPP=, e.g. the pinned
llama-cpp-python sdist's vendor/llama.cpp; Ollama's own 001 and models/003
patches touch other files, so the order does not matter). Exit status 0 on
success, 1 when an anchor is missing or ambiguous (the message names it and
nothing is written), 2 on bad arguments.

The call sites are found by function and call names; if an anchor is missing
or ambiguous (llama.cpp moved on), the script stops with a message naming it
and changes nothing. Applying twice is refused (the tree carries a marker).

Building: the hook is active only when CMake finds the C client
(find_package(kvcached 1.2 CONFIG QUIET): CMAKE_PREFIX_PATH=<prefix of a
clients/c install>). Without it every call site is a pass-through and the
build is the upstream one. With it, libllama carries the hook and reaches the
C client at run time; llama-server links the self-contained static client
(kvcached::kvcached_embed: gRPC, protobuf and abseil inside, nothing of them
exported), so the shipped binaries need no library beyond llama.cpp's own.
docs/llama-cpp.md has the details.
"""

from __future__ import annotations

import argparse
import difflib
import pathlib
import re
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
MARKER = "kvcached-service hook"
# the hook: its header, its entry points (kvcached_kv.cpp) and its parts
# (kvcached_kv_*.{h,cpp}: each owns one concern; kvcached_kv_hook.h, the
# state they are given), every .cpp a translation unit of its own
HOOK_PARTS = sorted(p.name for p in HERE.glob("kvcached_kv_*") if p.suffix in (".h", ".cpp"))
HOOK_FILES = ["kvcached_kv.h", "kvcached_kv.cpp", *HOOK_PARTS]
HOOK_SOURCES = [n for n in HOOK_FILES if n.endswith(".cpp")]
COMPAT_PATCH = "010-kvcached-kv-cache.patch"


class AnchorError(Exception):
    pass


def sub_once(text: str, pattern: str, repl, what: str, flags: int = re.M) -> str:
    """Replace the single match of `pattern`; fail when it matches 0 or >1 times."""
    matches = list(re.finditer(pattern, text, flags))
    if len(matches) != 1:
        raise AnchorError(f"anchor {what!r}: pattern /{pattern}/ matched {len(matches)} times (expected exactly 1)")
    m = matches[0]
    new = repl(m) if callable(repl) else m.expand(repl)
    return text[: m.start()] + new + text[m.end() :]


def after_function_open(text: str, signature: str, insert: str, what: str) -> str:
    """Insert `insert` as the first statement of the function whose definition
    line matches `signature` (a regex for the line up to and including '{')."""
    return sub_once(text, r"^(" + signature + r")\n", lambda m: m.group(1) + "\n" + insert, what)


# ---------------------------------------------------------------------------
# src/llama-kv-cache.cpp

KV_INCLUDE = '#include "kvcached_kv.h" // kvcached-service hook: KV cache in daemon pages\n'

KV_ALLOC = """{
                // kvcached-service hook: with OLLAMA_KVCACHED_SOCKET / KVCACHED_SOCKET set, one daemon
                // region per buffer type, the K/V tensors packed as below; else exactly the call below
                llama_kvcached_cache_info kvc_info;
                kvc_info.owner      = this;
                kvc_info.kv_size    = kv_size;
                kvc_info.n_stream   = n_stream;
                kvc_info.n_pad      = std::max(n_pad, 256u);
                kvc_info.v_trans    = v_trans;
                kvc_info.is_v       = [this](const ggml_tensor * t) {
                    for (const auto & l : layers) { if (l.v == t) { return true; } }
                    return false;
                };
                kvc_info.used_cells = [this](uint32_t s) { return v_cells[s].used_max_p1(); };
                buf = llama_kvcached_alloc_kv(ctx.get(), buft, kvc_info); // real buffer: ggml_backend_alloc_ctx_tensors_from_buft without the daemon
            }"""

KV_PREPARE_MAP = """    // kvcached-service hook: back cells [0, n_kv) of every K/V tensor for all ubatches (one Allocate);
    // a batch that found no slot only resets the hook's last error
    if (llama_kvcached_active(this)) {
        std::vector<uint32_t> kvc_need(n_stream, 0);
        for (const auto & kvc_si : res) {
            const uint32_t kvc_n = get_n_kv(kvc_si);
            for (uint32_t s = kvc_si.s0; s <= kvc_si.s1 && s < n_stream; ++s) {
                kvc_need[s] = std::max(kvc_need[s], kvc_n);
            }
        }
        if (!llama_kvcached_map(this, success ? kvc_need.data() : nullptr, success ? n_stream : 0)) {
            success = false;
        }
    }

"""

KV_UPDATE_MAP = """    // kvcached-service hook: K shift and stream copies read whole tensors
    if ((do_shift || !sc_info.empty()) && !llama_kvcached_map_all(this)) {
        GGML_ABORT("kvcached: cannot back the whole KV cache for a K shift / stream copy (the reason is logged above)");
    }
"""

KV_STATE_MAP = """    // kvcached-service hook: the restored cells must be backed before their data is written
    if (!llama_kvcached_map_used(this)) {
        return false;
    }
"""

KV_TRIM = "    llama_kvcached_trim_on_exit kvc_trim(this); // kvcached-service hook: give back pages past the used cells\n"


def patch_kv_cache(text: str) -> str:
    text = sub_once(text, r'^#include "llama-kv-cache\.h"\n', lambda m: m.group(0) + KV_INCLUDE, "#include llama-kv-cache.h")
    # constructor: the one ggml_backend_alloc_ctx_tensors_from_buft call
    text = sub_once(
        text,
        r"buf = ggml_backend_alloc_ctx_tensors_from_buft\(ctx\.get\(\), buft\);[^\n]*",
        KV_ALLOC,
        "llama_kv_cache::llama_kv_cache: ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft)",
    )
    # the "KV buffer size" log line reports the physical size
    text = sub_once(
        text,
        r'(KV buffer size = [^\n]*?)ggml_backend_buffer_get_size\(buf\)',
        r"\1llama_kvcached_buffer_size(buf)",
        'LLAMA_LOG_INFO("... KV buffer size ...", ggml_backend_buffer_get_size(buf))',
    )
    # memory_breakdown: physical size
    text = sub_once(
        text,
        r"ret\[buft\] \+= ggml_backend_buffer_get_size\(buf\.get\(\)\);",
        "ret[buft] += llama_kvcached_buffer_size(buf.get()); // kvcached-service hook: physical size",
        "llama_kv_cache::memory_breakdown: ret[buft] += ggml_backend_buffer_get_size(buf.get())",
    )
    # prepare(): map before the cells are restored
    text = sub_once(
        text,
        r"^(    // iterate backwards and restore the cells to their original state\n)?    for \(auto it = states\.rbegin\(\); it != states\.rend\(\); \+\+it\) \{\n",
        lambda m: KV_PREPARE_MAP + m.group(0),
        "llama_kv_cache::prepare: for (auto it = states.rbegin(); ...)",
    )
    text = after_function_open(
        text,
        r"bool llama_kv_cache::update\(llama_context \* lctx, bool do_shift, const stream_copy_info & sc_info\) \{",
        KV_UPDATE_MAP,
        "llama_kv_cache::update(lctx, do_shift, sc_info)",
    )
    text = after_function_open(
        text,
        r"bool llama_kv_cache::state_read_data\([^)]*\) \{",
        KV_STATE_MAP,
        "llama_kv_cache::state_read_data(...)",
    )
    for sig, what in [
        (r"void llama_kv_cache::clear\(bool data\) \{", "llama_kv_cache::clear(bool data)"),
        (r"bool llama_kv_cache::seq_rm\(llama_seq_id seq_id, llama_pos p0, llama_pos p1\) \{", "llama_kv_cache::seq_rm"),
        (r"void llama_kv_cache::seq_keep\(llama_seq_id seq_id\) \{", "llama_kv_cache::seq_keep"),
    ]:
        text = after_function_open(text, sig, KV_TRIM, what)
    return text


# ---------------------------------------------------------------------------
# tools/server/server-context.cpp

SERVER_DECLS = """
// kvcached-service hook (kvcached_kv.h in src/ or llama/compat/): the server holds this lock
// while its main loop touches slots, so the daemon's reclaim callback can
// release idle slots from its own thread at any time.
extern "C" {
void         llama_kvcached_lock(void);
void         llama_kvcached_unlock(void);
void         llama_kvcached_set_idle_release(void (*fn)(void * user, uint64_t bytes), void * user);
uint64_t     llama_kvcached_held_bytes(void);
void         llama_kvcached_poll(void);
const char * llama_kvcached_decode_error(const char * fallback);
}
namespace {
struct llama_kvcached_guard {
    bool held;
    explicit llama_kvcached_guard(bool take) : held(take) { if (held) { llama_kvcached_lock(); } }
    ~llama_kvcached_guard() { if (held) { llama_kvcached_unlock(); } }
    llama_kvcached_guard(const llama_kvcached_guard &) = delete;
    llama_kvcached_guard & operator=(const llama_kvcached_guard &) = delete;
};
}
"""

SERVER_REGISTER = """        // kvcached-service hook: a reclaim request from the daemon clears idle slots,
        // least recently used first, until enough pages went back
        llama_kvcached_set_idle_release([](void * user, uint64_t bytes) {
            auto * self = static_cast<server_context_impl *>(user);
            const uint64_t held0 = llama_kvcached_held_bytes();
            std::vector<server_slot *> idle;
            for (auto & slot : self->slots) {
                if (!slot.is_processing() && !slot.prompt.tokens.empty()) {
                    idle.push_back(&slot);
                }
            }
            std::sort(idle.begin(), idle.end(), [](const server_slot * a, const server_slot * b) {
                return a->t_last_used < b->t_last_used;
            });
            for (auto * slot : idle) {
                SLT_INF(*slot, "%s", "kvcached: clearing idle slot for a reclaim request\\n");
                slot->prompt_clear();
                if (held0 - std::min(held0, llama_kvcached_held_bytes()) >= bytes) {
                    break;
                }
            }
        }, this);
"""


def patch_server(text: str) -> str:
    text = sub_once(text, r'^#include "server-context\.h"\n', lambda m: m.group(0) + SERVER_DECLS, '#include "server-context.h"')
    text = sub_once(
        text,
        r"^([ \t]*)return process_single_task\(std::move\(task\), is_yielding\);",
        lambda m: f"{m.group(1)}llama_kvcached_guard kvc_guard(!is_yielding); // kvcached-service hook\n{m.group(0)}",
        "queue_tasks.on_new_task: return process_single_task(std::move(task), is_yielding)",
    )
    text = sub_once(
        text,
        r"(queue_tasks\.on_update_slots\(\[this\]\(\) \{\n)([ \t]*)(update_slots\(\);)",
        lambda m: (
            f"{m.group(1)}{m.group(2)}llama_kvcached_guard kvc_guard(true); // kvcached-service hook\n"
            f"{m.group(2)}llama_kvcached_poll(); // kvcached-service hook: answer a pending reclaim request\n"
            f"{m.group(2)}{m.group(3)}"
        ),
        "queue_tasks.on_update_slots([this]() { update_slots(); })",
    )
    # a batch the daemon could not back fails with the hook's reason, not "context size exceeded"
    text = sub_once(
        text,
        r'^([ \t]*)err = "Context size has been exceeded\.";',
        lambda m: (
            f'{m.group(1)}err = llama_kvcached_decode_error("Context size has been exceeded."); '
            "// kvcached-service hook: names the daemon when it could not lend memory"
        ),
        'update_slots: err = "Context size has been exceeded."',
    )
    text = sub_once(
        text,
        r"^([ \t]*)queue_tasks\.on_new_task\(\[this\]",
        lambda m: SERVER_REGISTER + m.group(0),
        "queue_tasks.on_new_task([this] ...) (register the idle release)",
    )
    text = after_function_open(
        text,
        r"    ~server_context_impl\(\) \{",
        "        llama_kvcached_set_idle_release(nullptr, nullptr); // kvcached-service hook\n",
        "~server_context_impl()",
    )
    return text


# ---------------------------------------------------------------------------
# src/CMakeLists.txt

CMAKE_BLOCK = """
# kvcached-service hook: llama.cpp's KV cache in kvcached-serve pages
# (integrations/llama.cpp and docs/llama-cpp.md of kvcached-service). The hook's
# sources are src/kvcached_kv*.cpp (apply.py) or in Ollama's llama/compat/ (added to
# this target by Ollama's llama/server/CMakeLists.txt). It is on only when the C
# client is found (CMAKE_PREFIX_PATH=<its install prefix>); without it every
# call site is a pass-through and nothing else changes. Only the hook's own
# sources get the client's definitions and include directories.
set(LLAMA_KVCACHED_NAMES @SOURCES@)
if (EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/kvcached_kv.cpp)
    set(LLAMA_KVCACHED_DIR ${CMAKE_CURRENT_SOURCE_DIR})
    target_sources(llama PRIVATE ${LLAMA_KVCACHED_NAMES} @HEADERS@)
elseif (DEFINED OLLAMA_LLAMA_CPP_COMPAT_DIR AND EXISTS ${OLLAMA_LLAMA_CPP_COMPAT_DIR}/kvcached_kv.cpp)
    set(LLAMA_KVCACHED_DIR ${OLLAMA_LLAMA_CPP_COMPAT_DIR})
else()
    message(FATAL_ERROR "kvcached: the KV-cache hook's call sites are patched in, but kvcached_kv.cpp is neither "
                        "in ${CMAKE_CURRENT_SOURCE_DIR} nor in Ollama's llama/compat/ (apply.py puts it there)")
endif()
set(LLAMA_KVCACHED_SOURCES "")
foreach(name ${LLAMA_KVCACHED_NAMES})
    if (NOT EXISTS ${LLAMA_KVCACHED_DIR}/${name})
        message(FATAL_ERROR "kvcached: ${LLAMA_KVCACHED_DIR} has kvcached_kv.cpp but not ${name} (apply.py puts "
                            "all of the hook's sources there)")
    endif()
    list(APPEND LLAMA_KVCACHED_SOURCES ${LLAMA_KVCACHED_DIR}/${name})
endforeach()
set_source_files_properties(${LLAMA_KVCACHED_SOURCES} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
find_package(kvcached 1.2 CONFIG QUIET)
if (kvcached_FOUND)
    get_target_property(LLAMA_KVCACHED_INCLUDE kvcached::kvcached INTERFACE_INCLUDE_DIRECTORIES)
    set_property(SOURCE ${LLAMA_KVCACHED_SOURCES} APPEND PROPERTY COMPILE_DEFINITIONS LLAMA_KVCACHED)
    set_property(SOURCE ${LLAMA_KVCACHED_SOURCES} APPEND PROPERTY INCLUDE_DIRECTORIES
                 ${CMAKE_CURRENT_SOURCE_DIR}/../ggml/src ${LLAMA_KVCACHED_INCLUDE})
    target_link_libraries(llama PRIVATE ${CMAKE_DL_LIBS})
    message(STATUS "kvcached: KV-cache hook on (C client ${kvcached_VERSION} in ${kvcached_DIR})")
else()
    message(STATUS "kvcached: C client not found (CMAKE_PREFIX_PATH): KV-cache hook compiled as pass-through")
endif()
"""

SERVER_CMAKE_BLOCK = """
# kvcached-service hook (see src/CMakeLists.txt): the C client, self-contained
# and static, goes into the executable; libllama's hook finds it there
find_package(kvcached 1.2 CONFIG QUIET)
if (TARGET kvcached::kvcached_embed)
    target_link_libraries(${TARGET} PRIVATE kvcached::kvcached_embed)
endif()
"""


def patch_cmake(text: str) -> str:
    block = (CMAKE_BLOCK.replace("@SOURCES@", " ".join(HOOK_SOURCES))
             .replace("@HEADERS@", " ".join(n for n in HOOK_FILES if n.endswith(".h"))))
    return sub_once(
        text,
        r"^target_link_libraries\(llama PUBLIC ggml\)\n",
        lambda m: m.group(0) + block,
        "src/CMakeLists.txt: target_link_libraries(llama PUBLIC ggml)",
    )


def patch_server_cmake(text: str) -> str:
    return sub_once(
        text,
        r"^target_link_libraries\(\$\{TARGET\} PRIVATE llama-server-impl\)\n",
        lambda m: m.group(0) + SERVER_CMAKE_BLOCK,
        "tools/server/CMakeLists.txt: target_link_libraries(${TARGET} PRIVATE llama-server-impl)",
    )


EDITS = {
    "src/llama-kv-cache.cpp": patch_kv_cache,
    "tools/server/server-context.cpp": patch_server,
    "src/CMakeLists.txt": patch_cmake,
    "tools/server/CMakeLists.txt": patch_server_cmake,
}


def compute(tree: pathlib.Path, with_sources: bool = True) -> dict[str, tuple[str | None, str]]:
    """{path: (old text or None for a new file, new text)}; without
    with_sources only the edits of existing files (the compat patch)."""
    out: dict[str, tuple[str | None, str]] = {}
    for rel, fn in EDITS.items():
        p = tree / rel
        if not p.is_file():
            raise AnchorError(f"file {rel} is missing from {tree}")
        old = p.read_text()
        if MARKER in old:
            raise AnchorError(f"{rel} already carries the hook ({MARKER!r}); start from a clean tree")
        out[rel] = (old, fn(old))
    if not with_sources:
        return out
    for name in HOOK_FILES:
        rel = f"src/{name}"
        old = (tree / rel).read_text() if (tree / rel).exists() else None
        out[rel] = (old, (HERE / name).read_text())
    return out


def git_diff(changes: dict[str, tuple[str | None, str]]) -> str:
    parts = []
    for rel in sorted(changes):
        old, new = changes[rel]
        a = [] if old is None else old.splitlines(keepends=True)
        b = new.splitlines(keepends=True)
        head = f"diff --git a/{rel} b/{rel}\n"
        if old is None:
            head += "new file mode 100644\n"
        body = list(difflib.unified_diff(a, b, "/dev/null" if old is None else f"a/{rel}", f"b/{rel}", n=3))
        if not body:
            continue
        # difflib puts a space after ---/+++ names only when dates are given; git wants none
        body[0] = body[0].rstrip() + "\n"
        body[1] = body[1].rstrip() + "\n"
        for i, line in enumerate(body):
            if not line.endswith("\n"):
                body[i] = line + "\n\\ No newline at end of file\n"
        parts.append(head + "".join(body))
    return "".join(parts)


def emit_compat(tree: pathlib.Path, out_dir: pathlib.Path, patch_name: str) -> int:
    changes = compute(tree, with_sources=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in HOOK_FILES:
        (out_dir / name).write_text((HERE / name).read_text())
        written.append(name)
    (out_dir / patch_name).write_text(git_diff(changes))
    written.append(patch_name)
    if not (out_dir / "compat.cmake").exists():
        print(f"apply.py: note: {out_dir} has no compat.cmake (is it an Ollama llama/compat directory?)", file=sys.stderr)
    print(f"apply.py: wrote {', '.join(written)} to {out_dir} (patch: {', '.join(sorted(changes))})")
    return 0


def pristine_copy(tree: pathlib.Path, dest: pathlib.Path) -> None:
    """DEST as TREE is, for the files the hook touches (see --onto)."""
    stamp = ".kvc-llama-build"
    same = (tree / stamp).is_file() and (dest / stamp).is_file() \
        and (tree / stamp).read_bytes() == (dest / stamp).read_bytes()
    if dest.exists() and not same:  # another llama.cpp (the pin moved), or one that does not say
        shutil.rmtree(dest)
    if not dest.exists():
        tmp = dest.with_name(dest.name + ".tmp")  # whole or not at all
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(tree, tmp, symlinks=True)
        tmp.rename(dest)
        return
    for rel in [*EDITS, *(f"src/{n}" for n in HOOK_FILES)]:
        (dest / rel).unlink(missing_ok=True)
        if (tree / rel).is_file():
            shutil.copy2(tree / rel, dest / rel)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", type=pathlib.Path, help="llama.cpp source tree (has src/llama-kv-cache.cpp)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--emit-patch", type=pathlib.Path, metavar="FILE", help="write the change as a patch; leave the tree alone")
    mode.add_argument("--emit-compat", type=pathlib.Path, metavar="DIR",
                      help="write Ollama's compat form into DIR (<ollama>/llama/compat); leave the tree alone")
    mode.add_argument("--check", action="store_true", help="only check the anchors")
    mode.add_argument("--list", action="store_true", help="print the files the hook edits or adds and exit")
    mode.add_argument("--onto", type=pathlib.Path, metavar="DEST",
                      help="make DEST a pristine copy of the tree (whole, or the hook's files), then apply the hook to DEST")
    ap.add_argument("--patch-name", default=COMPAT_PATCH, metavar="NAME",
                    help=f"file name of the compat patch (default {COMPAT_PATCH}; Ollama applies DIR/*.patch in name order)")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join([*EDITS, *(f"src/{n}" for n in HOOK_FILES)]))
        return 0
    if not (args.tree / "src" / "llama-kv-cache.cpp").is_file():
        print(f"apply.py: {args.tree} is not a llama.cpp source tree (no src/llama-kv-cache.cpp)", file=sys.stderr)
        return 1
    if "/" in args.patch_name or not args.patch_name.endswith(".patch"):
        ap.error(f"--patch-name {args.patch_name!r}: a file name ending in .patch")
    target = args.tree
    try:
        if args.emit_compat:
            return emit_compat(args.tree, args.emit_compat, args.patch_name)
        changes = compute(args.tree)
        if args.onto:
            pristine_copy(args.tree, args.onto)
            target = args.onto
    except AnchorError as e:
        print(f"apply.py: {e}", file=sys.stderr)
        print("apply.py: nothing was changed", file=sys.stderr)
        return 1
    if args.check:
        print(f"apply.py: all anchors found in {args.tree}")
        return 0
    if args.emit_patch:
        args.emit_patch.write_text(git_diff(changes))
        print(f"apply.py: wrote {args.emit_patch} ({len(changes)} files); apply with: git apply {args.emit_patch.name}")
        return 0
    for rel, (_, new) in changes.items():
        p = target / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(new)
        print(f"apply.py: {rel}")
    print(f"apply.py: hook applied to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
