#!/usr/bin/env python3
"""docs/install.md quotes the consumer projects verbatim: every block between
'# example-begin NAME' and '# example-end NAME' in tests/packaging/*/{CMakeLists.txt,meson.build}
appears in the page as it is in the file, less the indentation common to its lines (a block inside
an if reads as the top-level code a user writes), so the snippets there are the ones CI builds.
Usage: install_doc.py docs/install.md tests/packaging"""
import pathlib
import re
import sys
import textwrap

doc = pathlib.Path(sys.argv[1]).read_text()
root = pathlib.Path(sys.argv[2])
BLOCK = re.compile(r"^[ \t]*# example-begin (\S+)\n(.*?)^[ \t]*# example-end \1\n", re.M | re.S)
blocks = []
for f in sorted(list(root.glob("*/CMakeLists.txt")) + list(root.glob("*/meson.build"))):
    blocks += [(f"{f.parent.name}/{f.name}: {m.group(1)}", textwrap.dedent(m.group(2)))
               for m in BLOCK.finditer(f.read_text())]
failed = 0
for name, text in blocks:
    ok = text in doc
    failed += not ok
    print(f"[{'ok' if ok else 'FAIL'}] {name}")
    if not ok:
        print(text)
print(f"[doctest] test cases: {len(blocks)} | {len(blocks) - failed} passed | {failed} failed | 0 skipped")
sys.exit(1 if failed or len(blocks) < 5 else 0)
