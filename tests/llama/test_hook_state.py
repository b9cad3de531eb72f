"""Issue 47 item 3: the llama.cpp hook keeps no process-wide state outside
its entry points. One object (kvcached_kv_hook.h) holds the hook's state;
the entry points (kvcached_kv.cpp) make it, once per process, and hand it to
the parts (kvcached_kv_*.{h,cpp}), which keep nothing of their own: no
variable at namespace scope (constexpr constants aside), no static or
thread_local variable in a function or class. Read from the real sources,
no build needed."""

from __future__ import annotations

import pathlib
import re

from kvtest import ROOT

HOOK = ROOT / "integrations" / "llama.cpp"
ENTRY = "kvcached_kv.cpp"
# what the entry file may hold (name -> why): the process's hook, and two
# things that are not the hook's state
ENTRY_ALLOWED = {
    "h": "the_hook(): the one hook of the process",
    "once": "the pass-through build's one warning (no hook there)",
    "out": "llama_kvcached_decode_error's per-thread answer (thread_local)",
}

_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|[A-Za-z_]\w*|::|->|[^\s\w]')


def _code(text: str) -> str:
    """The source without comments and preprocessor lines (continued lines
    included); string and character literals stay (as single tokens)."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: " " if m.group(0).startswith("/*") else "", text, flags=re.S)
    out, cont = [], False
    for line in text.splitlines():
        if cont or line.lstrip().startswith("#"):
            cont = line.rstrip().endswith("\\")
            continue
        out.append(line)
    return "\n".join(out)


def _is_variable(stmt: list[str]) -> bool:
    """Whether a statement at namespace scope defines a variable (not a
    function, type, alias, constant or declaration of something else)."""
    if not stmt or stmt[0] in ("using", "typedef", "template", "namespace", "friend", "static_assert"):
        return False
    if stmt[0] in ("struct", "class", "enum", "union") and "=" not in stmt:
        return False  # a forward declaration (a definition ends at its brace: see _scan)
    if "constexpr" in stmt:
        return False
    if stmt[0] == "extern" and (len(stmt) < 2 or not stmt[1].startswith('"')):
        return False  # a declaration of a variable defined elsewhere: its definition is checked there
    eq = stmt.index("=") if "=" in stmt else len(stmt)
    return "(" not in stmt[:eq] or stmt[stmt.index("(") + 1: stmt.index("(") + 2] == ["*"]


def state_of(path: pathlib.Path) -> list[tuple[str, str]]:
    """(kind, statement) of every variable the file keeps beyond a call:
    namespace-scope variables and static / thread_local ones anywhere."""
    tokens = _TOKEN.findall(_code(path.read_text()))
    found: list[tuple[str, str]] = []
    scopes: list[str] = ["ns"]  # ns, class, block
    stmt: list[str] = []
    for i, tok in enumerate(tokens):
        if tok == "{":
            if scopes[-1] == "ns" and (stmt[:1] == ["namespace"] or stmt[:2] == ["extern", '"C"']):
                kind = "ns"
            elif scopes[-1] in ("ns", "class") and stmt[:1] in (["struct"], ["class"], ["union"], ["enum"]) \
                    and "=" not in stmt and "(" not in stmt:
                kind = "class"
            else:
                kind = "block"
            if kind == "block" and scopes[-1] == "ns" and _is_variable(stmt):
                found.append(("namespace scope", " ".join(stmt)))  # int x{...} / T x = {...}
            scopes.append(kind)
            stmt = [] if kind != "block" or scopes[-2] != "block" else stmt + [tok]
            continue
        if tok == "}":
            kind = scopes.pop()
            if kind != "block" or scopes[-1] != "block":
                stmt = []
            continue
        if tok == ";":
            if scopes[-1] == "ns" and _is_variable(stmt):
                found.append(("namespace scope", " ".join(stmt)))
            stmt = []
            continue
        stmt.append(tok)
        if tok == "thread_local" or (tok == "static" and scopes[-1] == "block"):
            found.append((f"{tok} in a function", " ".join(tokens[i:i + 8])))
        elif tok == "static" and scopes[-1] == "class":
            found.append(("static member", " ".join(tokens[i:i + 8])))
    return found


def _names(path: pathlib.Path) -> set[str]:
    """The names of the static / thread_local locals a file declares."""
    code = _code(path.read_text())
    return set(re.findall(r"\b(?:static|thread_local)\b[^;=({]*?(\w+)\s*(?:[;=({]|$)", code, flags=re.M))


def test_the_parts_keep_no_process_wide_state():
    parts = sorted(p for p in HOOK.glob("kvcached_kv*") if p.name != ENTRY and p.suffix in (".h", ".cpp", ".inc"))
    assert len(parts) >= 6, parts
    bad = {p.name: state_of(p) for p in parts if state_of(p)}
    assert not bad, f"process-wide state outside the entry points ({ENTRY}): {bad}"


def test_the_entry_points_hold_the_one_hook():
    entry = HOOK / ENTRY
    found = state_of(entry)
    assert not [f for f in found if f[0] == "namespace scope"], found
    names = _names(entry)
    assert names <= set(ENTRY_ALLOWED), f"{ENTRY}: static / thread_local beyond {sorted(ENTRY_ALLOWED)}: {names}"
    text = entry.read_text()
    assert len(re.findall(r"\bstatic hook \* const h = new hook\(", text)) == 1, "one hook per process, in the_hook()"


def test_the_check_finds_state(tmp_path):
    """The checker itself: each way a part could keep state is found (as in
    the hook before issue 47: accessors with a static local), and what is no
    state is not."""
    cases = {
        "static local": "settings & CFG() {\n    static settings * s = new settings();\n    return *s;\n}\n",
        "namespace variable": "namespace x {\nint calls = 0;\n}\n",
        "namespace object": "namespace x {\nstd::mutex mu;\n}\n",
        "braced": "namespace x {\nstd::atomic<bool> on{ false };\n}\n",
        "thread_local": "const char * f() {\n    thread_local std::string s;\n    return s.c_str();\n}\n",
        "static member": "struct a {\n    static int n;\n};\n",
        "function pointer": "namespace x {\nvoid (*cb)(int) = nullptr;\n}\n",
    }
    for what, src in cases.items():
        p = tmp_path / "part.cpp"
        p.write_text(src)
        assert state_of(p), what
    clean = ("namespace x {\nconstexpr double MiB = 1024.0 * 1024.0;\nstruct s {\n    int a = 0;\n    std::mutex m;\n};\n"
             "enum class mode { a, b };\nstruct kv;\nint f(int a);\nbool g(hook & h) {\n    int n = 0;\n"
             "    std::vector<int> v{ 1, 2 };\n    for (int i = 0; i < 3; ++i) {\n        n += i;\n    }\n"
             "    static_assert(sizeof(int) == 4, \"int\");\n    return static_cast<bool>(n);\n}\n"
             "using plan = std::function<void(int)>;\nconstexpr const char * NAMES[2] = { \"a\", \"b\" };\n}\n"
             "extern \"C\" {\nvoid llama_kvcached_poll(void) {}\n}\n")
    p = tmp_path / "clean.cpp"
    p.write_text(clean)
    assert state_of(p) == [], state_of(p)
