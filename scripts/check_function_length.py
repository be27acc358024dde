#!/usr/bin/env python3
"""Lists the functions longer than a limit (default 80 lines) in the given C++ files.

    scripts/check_function_length.py [--max N] FILE...

Prints "file:line: name is L lines (max N)" for each, and exits 1 if there is any.
Length counts from the first line of the signature to the line of the closing brace.

The heuristic, good enough for ctitan's style (not a C++ parser):
  - comments, string and character literals (raw strings included) and preprocessor lines are
    blanked first, keeping line numbers;
  - the code is scanned brace by brace with a stack of scopes. A '{' opens a namespace-like
    scope (namespace, extern "C", class, struct, union, enum: whose members are looked at
    again) or a function body, or a brace initializer (`= {...}`, `member_{...}` in a
    constructor's initializer list), which is skipped;
  - a '{' met at namespace or class scope is a function body when the text since the last
    ';', '{' or '}' of that scope (the "head") has a parenthesis and the '{' follows ')',
    a qualifier (const, override, noexcept, final, mutable, try) or a trailing return type;
    lambdas and blocks inside a function belong to that function;
  - the head starts after access labels (public:, private:, protected:); template<...> lines
    belong to it.
"""
import argparse
import re
import sys

QUALIFIERS = {"const", "override", "noexcept", "final", "mutable", "try", "volatile"}
SCOPE_KEYWORDS = re.compile(r"\b(namespace|class|struct|union|enum|extern)\b")
ACCESS_LABEL = re.compile(r"^\s*(public|private|protected)\s*:(?!:)")


def blank(text):
    """Comments, literals and preprocessor lines replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c == "#" or (line_start and c in " \t" and text[i:].lstrip(" \t").startswith("#")):
            # A preprocessor line, with its continuations.
            j = i
            while j < n:
                k = text.find("\n", j)
                if k < 0:
                    k = n
                if k > 0 and text[k - 1] == "\\":
                    j = k + 1
                    continue
                break
            out.append(re.sub(r"[^\n]", " ", text[i:k]))
            i = k
            continue
        if text.startswith("//", i):
            k = text.find("\n", i)
            k = n if k < 0 else k
            out.append(" " * (k - i))
            i = k
            continue
        if text.startswith("/*", i):
            k = text.find("*/", i + 2)
            k = n if k < 0 else k + 2
            out.append(re.sub(r"[^\n]", " ", text[i:k]))
            i = k
            continue
        m = re.match(r'R"([^(\s]*)\(', text[i:i + 20]) if c == "R" and (i == 0 or not text[i - 1].isalnum()) else None
        if m:
            end = text.find(")" + m.group(1) + '"', i)
            k = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:k]))
            i = k
            continue
        if c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # a digit separator: 1'000
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            k = min(j + 1, n)
            out.append(c + re.sub(r"[^\n]", " ", text[i + 1:k - 1]) + c)
            i = k
            continue
        out.append(c)
        line_start = c == "\n"
        i += 1
    return "".join(out)


def function_name(head):
    depth = 0
    for m in re.finditer(r"[()]|[~A-Za-z_][\w:~]*(?:\s*(?:operator\s*\S+?))?", head):
        tok = m.group(0)
        if tok == "(":
            if depth == 0:
                before = head[:m.start()].rstrip()
                name = re.search(r"(operator\s*\S+|[~A-Za-z_][\w:~<>]*)$", before)
                return name.group(1) if name else "?"
            depth += 1
        elif tok == ")":
            depth -= 1
    return "?"


def is_function_head(head):
    if "(" not in head or SCOPE_KEYWORDS.search(head.split("(")[0]):
        return False
    stripped = head.rstrip()
    if stripped.endswith("=") or re.search(r"=\s*$", stripped):
        return False
    last = re.search(r"(\)|[\w>]+)\s*$", stripped)
    if not last:
        return False
    tok = last.group(1)
    if tok == ")" or tok in QUALIFIERS:
        return True
    after_paren = stripped[stripped.rfind(")") + 1:]
    return "->" in after_paren  # trailing return type; else a brace initializer


def long_functions(path, limit):
    text = blank(open(path, encoding="utf-8", errors="replace").read())
    found = []
    stack = []  # (kind, start_line, name): kind in ns, fn, init
    head_start = 0
    line = 1
    i = 0
    for i, c in enumerate(text):
        if c == "\n":
            line += 1
        in_code_scope = not stack or stack[-1][0] == "ns"
        if c == "{":
            if stack and stack[-1][0] in ("fn", "inner"):
                stack.append(("inner", 0, ""))
                continue
            head = text[head_start:i]
            label = ACCESS_LABEL.match(head)
            while label:
                head_start += label.end()
                head = text[head_start:i]
                label = ACCESS_LABEL.match(head)
            offset = len(head) - len(head.lstrip())
            start_line = text.count("\n", 0, head_start + offset) + 1
            if in_code_scope and is_function_head(head):
                stack.append(("fn", start_line, function_name(head)))
            elif in_code_scope and SCOPE_KEYWORDS.search(head) and "=" not in head:
                stack.append(("ns", start_line, ""))
                head_start = i + 1
            else:
                stack.append(("init", start_line, ""))
        elif c == "}":
            if not stack:
                continue
            kind, start_line, name = stack.pop()
            if kind == "fn":
                length = line - start_line + 1
                if length > limit:
                    found.append((path, start_line, name, length))
                head_start = i + 1
            elif kind == "ns":
                head_start = i + 1
        elif c == ";" and in_code_scope:
            head_start = i + 1
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max", type=int, default=80)
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    bad = []
    for f in args.files:
        bad += long_functions(f, args.max)
    for path, line, name, length in bad:
        print(f"{path}:{line}: {name} is {length} lines (max {args.max})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
