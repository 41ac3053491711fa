#!/usr/bin/env python3
"""Every declaration of the library sits in its inline ABI namespace (version.hpp): v<major>, and
while the major version is 0 (a minor release may change the API) v0_<minor>, e.g. moefold::v0_1,
so objects built against headers of another ABI fail to link instead of mixing silently. A header
that opens `namespace moefold {` must open `inline namespace <abi> {` on the next line, and close
both.

Usage: abi_namespace_check.py <include root>. Exits 1 naming each file:line that breaks the rule.
The checker first checks itself on a planted sample.
"""
import pathlib
import re
import sys

ABI = None  # from version.hpp


def abi_of(version_hpp):
    text = version_hpp.read_text()
    major = int(re.search(r"#define MOEFOLD_VERSION_MAJOR (\d+)", text).group(1))
    minor = int(re.search(r"#define MOEFOLD_VERSION_MINOR (\d+)", text).group(1))
    return f"v0_{minor}" if major == 0 else f"v{major}"


def problems(name, text):
    lines = text.split("\n")
    out = []
    opened = closed = 0
    for i, line in enumerate(lines):
        if line.startswith("namespace moefold"):
            if line != "namespace moefold {":
                out.append(f"{name}:{i + 1}: opens '{line.strip()}' (open 'namespace moefold {{' "
                           f"then 'inline namespace {ABI} {{')")
            elif i + 1 >= len(lines) or lines[i + 1] != f"inline namespace {ABI} {{":
                out.append(f"{name}:{i + 1}: namespace moefold without 'inline namespace {ABI}' "
                           "on the next line")
            opened += 1
        if line == f"}}  // namespace {ABI}":
            closed += 1
    if opened != closed:
        out.append(f"{name}: opens moefold {opened} times but closes {ABI} {closed} times")
    return out


def main():
    global ABI
    root = pathlib.Path(sys.argv[1])
    ABI = abi_of(root / "moefold" / "version.hpp")
    planted = "namespace moefold {\nint x;\n}  // namespace moefold\n"
    if not problems("planted", planted):
        print("abi_namespace_check: the checker misses a header without the ABI namespace")
        return 1
    good = f"namespace moefold {{\ninline namespace {ABI} {{\nint x;\n}}  // namespace {ABI}\n}}  // namespace moefold\n"
    if problems("good", good):
        print("abi_namespace_check: the checker refuses a correct header")
        return 1
    found = []
    checked = 0
    for p in sorted(root.rglob("*")):
        if p.suffix not in (".hpp", ".cuh", ".cu") or not p.is_file():
            continue
        text = p.read_text()
        if "namespace moefold" not in text:
            continue
        checked += 1
        found += problems(str(p.relative_to(root)), text)
    for f in found:
        print(f)
    print(f"abi_namespace_check: {checked} headers in moefold::{ABI}, {len(found)} problems")
    return 1 if found or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
