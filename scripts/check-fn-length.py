#!/usr/bin/env python3
"""Fail if a function in the given C/C++ sources is longer than a limit.

Usage: check-fn-length.py [--max N] [--list] PATH...   (PATH: a file or a folder;
a folder means its *.c, *.cc, *.cpp, *.h, *.hpp files)

A function's length is counted from the first line of its signature (the
return type) to its closing brace, both included; lambdas and local blocks
count towards the function that holds them. Exits 1 naming each function
over the limit (file:line name length), 0 otherwise; --list prints every
function with its length.

How it reads the code: comments, string and character literals (raw strings
too) and preprocessor lines (with their continuations) are blanked first, so
braces inside them do not count. Then braces are matched; a brace block at
file, namespace, extern "C" or class/struct scope whose header (the text
since the previous ';', '{' or '}') has a parameter list, and is not an
initializer ('= {'), is a function body. This is not a full C++ parser; it is
checked against universal-ctags's function ranges on clients/c/src (same
functions, same closing lines) and fails loudly (exit 2) on unbalanced
braces rather than guess.
"""
import argparse
import os
import re
import sys

EXTS = (".c", ".cc", ".cpp", ".h", ".hpp")
ATTR_RE = re.compile(r"__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)")
SCOPE_RE = re.compile(r"^(?:namespace\b[\w:\s]*|extern\s*|(?:typedef\s+)?(?:class|struct|union)\b[^()=]*)$")


def blank(text):
    """The text with comments, literals and preprocessor lines turned into
    spaces (newlines kept, so line numbers hold)."""
    out = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if line_start and c == "#":  # a preprocessor line, with its continuations
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                out.append(" ")
                i += 1
            continue
        line_start = False
        if c == "\n":
            line_start = True
            out.append(c)
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise ValueError("unterminated comment")
            out.append(re.sub(r"[^\n]", " ", text[i:j + 2]))
            i = j + 2
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^()\\\s]{0,16})\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = ")" + m.group(1) + '"'
            j = text.find(end, i + m.end())
            if j < 0:
                raise ValueError("unterminated raw string")
            out.append(re.sub(r"[^\n]", " ", text[i:j + len(end)]))
            i = j + len(end)
        elif c in "\"'":
            # a digit separator (1'000) is no literal
            if c == "'" and i > 0 and text[i - 1].isalnum() and text[i - 1] not in "uUL":
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c:
                if text[j] == "\\":
                    j += 1
                elif text[j] == "\n":
                    raise ValueError("unterminated literal")
                j += 1
            out.append(" " * (j + 1 - i))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(text):
    """(name, first line, last line) of every function body in the text."""
    code = blank(text)
    line_of = [0] * (len(code) + 1)
    ln = 1
    for k, ch in enumerate(code):
        line_of[k] = ln
        if ch == "\n":
            ln += 1
    line_of[len(code)] = ln
    found = []
    stack = []  # one entry per open brace: True when it opens a scope that holds declarations
    header_start = 0
    k = 0
    while k < len(code):
        ch = code[k]
        if ch == ";":
            header_start = k + 1
        elif ch == "}":
            if not stack:
                raise ValueError(f"line {line_of[k]}: '}}' with no '{{'")
            stack.pop()
            header_start = k + 1
        elif ch == "{":
            if stack and not stack[-1]:  # inside a function or an initializer: a local block
                stack.append(False)
                k += 1
                continue
            header = code[header_start:k]
            flat = " ".join(header.split())
            if SCOPE_RE.match(flat) or flat.startswith("enum") or not flat:
                stack.append(not flat.startswith("enum") and bool(flat))
                k += 1
                header_start = k
                continue
            is_init = "=" in flat.split("(")[0] or flat.endswith("=") or "(" not in flat
            if is_init:
                stack.append(False)
                k += 1
                continue
            end = match_brace(code, k)
            named = ATTR_RE.sub(" ", flat)
            m = re.search(r"([~\w:]+(?:\s*operator\s*\S+?)?)\s*\(", named)
            name = m.group(1) if m else flat[:40]
            first = header_start + (len(header) - len(header.lstrip()))
            found.append((name, line_of[first], line_of[end]))
            k = end + 1
            header_start = k
            continue
        k += 1
    if stack:
        raise ValueError("a '{' is never closed")
    return found


def match_brace(code, k):
    depth = 0
    for j in range(k, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError("a function's '{' is never closed")


def sources(paths):
    for p in paths:
        if os.path.isdir(p):
            for name in sorted(os.listdir(p)):
                if name.endswith(EXTS):
                    yield os.path.join(p, name)
        else:
            yield p


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max", type=int, default=60, help="most lines a function may have (60)")
    ap.add_argument("--list", action="store_true", help="print every function and its length")
    ap.add_argument("paths", nargs="+")
    a = ap.parse_args()
    over = []
    count = 0
    for path in sources(a.paths):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            fns = functions(text)
        except ValueError as e:
            print(f"check-fn-length: {path}: cannot read: {e}", file=sys.stderr)
            return 2
        for name, first, last in fns:
            count += 1
            length = last - first + 1
            if a.list:
                print(f"{length:5d} {path}:{first} {name}")
            if length > a.max:
                over.append(f"{path}:{first}: {name} is {length} lines (at most {a.max})")
    if count == 0:
        print("check-fn-length: found no function in " + " ".join(a.paths), file=sys.stderr)
        return 2
    for o in over:
        print("check-fn-length: " + o, file=sys.stderr)
    if over:
        print(f"check-fn-length: {len(over)} of {count} functions are longer than {a.max} lines: "
              "split them into named steps", file=sys.stderr)
        return 1
    print(f"check-fn-length: {count} functions, none longer than {a.max} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
