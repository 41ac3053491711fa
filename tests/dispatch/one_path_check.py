#!/usr/bin/env python3
"""The dispatcher and layer headers serve host and GPU alike: they move rows only through their
execution context's operations (exec/host_memory_ops.hpp, cuda_exec), so they contain no loop
(over rows, tokens, elements or anything else) and no `if constexpr` on the context type.

Usage: one_path_check.py <include root>. Exits 1 naming each file:line that breaks the rule.
"""
import pathlib
import re
import sys

HEADERS = [
    "moefold/dispatch/all_to_all_dispatcher.hpp",
    "moefold/dispatch/all_gather_dispatcher.hpp",
    "moefold/dispatch/dispatcher_common.hpp",
    "moefold/layer/moe_layer.hpp",
]
RULES = [
    (re.compile(r"\bfor\s*\("), "a for loop"),
    (re.compile(r"\bwhile\s*\("), "a while loop"),
    (re.compile(r"\bdo\s*\{"), "a do loop"),
    (re.compile(r"\bgoto\b"), "a goto"),
    (re.compile(r"\bif\s+constexpr\b"), "an if constexpr"),
    (re.compile(r"std::(for_each|transform|fill|copy|accumulate|generate)\b"),
     "an element loop in a standard algorithm"),
]


def code_only(text):
    """The text with comments and string literals blanked (line numbers kept)."""
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\\n])*"', '""', text)
    return re.sub(r"//[^\n]*", "", text)


def violations(text):
    out = []
    for n, line in enumerate(code_only(text).splitlines(), 1):
        for rule, what in RULES:
            if rule.search(line):
                out.append((n, what))
    return out


def main():
    # The checker itself must see what it forbids (a test that cannot fail is no test).
    planted = 'int f() {\n  // for (comment)\n  const char* s = "while (x)";\n  for (int i = 0;;) {}\n' \
              '  if constexpr (true) {}\n}\n'
    assert violations(planted) == [(4, "a for loop"), (5, "an if constexpr")], violations(planted)
    root = pathlib.Path(sys.argv[1])
    bad = 0
    for h in HEADERS:
        path = root / h
        if not path.is_file():
            print(f"error: {path} is missing")
            bad += 1
            continue
        for n, what in violations(path.read_text()):
            print(f"error: {h}:{n}: {what} (move rows through the execution context's operations)")
            bad += 1
    if bad:
        return 1
    print(f"{len(HEADERS)} headers: no loops, no if constexpr")
    return 0


if __name__ == "__main__":
    sys.exit(main())
