#!/usr/bin/env python3
"""The code the docs show compiles: every fenced block of README.md and docs/*.md opened with
```cpp compile or ```cuda compile is a whole translation unit, compiled as the docs show it
(cpp with the C++ compiler, -Wall -Wextra -Werror; cuda with nvcc, when given). A cpp or cuda
block that names `moe_layer` must be so marked, so every snippet of the layer is compiled; other
blocks may be excerpts. Prints one line per block; exits 1 on any failure."""
import argparse
import pathlib
import re
import subprocess
import sys
import tempfile

FENCE = re.compile(r"^```(\w*)((?:\s+\w+)*)\s*$")


def blocks(path):
    """(first line, info string, text) of every fenced block of a markdown file."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        info, words, start, body = m.group(1), m.group(2).split(), i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        yield start, info, "compile" in words, "\n".join(body) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--cxx", nargs="+", required=True)
    ap.add_argument("--nvcc")
    ap.add_argument("--cuda-include")
    a = ap.parse_args()
    root = pathlib.Path(a.root)
    docs = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    compiled = failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for doc in docs:
            for line, info, marked, text in blocks(doc):
                if info not in ("cpp", "cuda"):
                    continue
                where = f"{doc.relative_to(root)}:{line}"
                if not marked:
                    if "moe_layer" in text:
                        print(f"FAIL {where}: a snippet of the layer must be a whole unit "
                              f"(its #include lines and every name it uses) marked ```{info} "
                              "compile, so that it is compiled")
                        failed += 1
                    continue
                src = pathlib.Path(tmp) / f"snippet_{compiled + failed}.{'cu' if info == 'cuda' else 'cpp'}"
                src.write_text(text)
                inc = ["-I", str(root / "include"), "-I", str(root)]
                if info == "cuda":
                    if not a.nvcc:
                        print(f"FAIL {where}: a cuda snippet and no nvcc to compile it")
                        failed += 1
                        continue
                    cmd = [a.nvcc, "-std=c++20", "--expt-relaxed-constexpr", "-c", "-o",
                           str(src) + ".o"] + inc + [str(src)]
                else:
                    cmd = a.cxx + ["-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror"]
                    if a.cuda_include:
                        cmd += ["-isystem", a.cuda_include]
                    cmd += inc + [str(src)]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    print(f"FAIL {where} ({info}):\n{r.stderr[-4000:]}")
                    failed += 1
                else:
                    print(f"ok   {where} ({info})")
                    compiled += 1
    print(f"{compiled} snippets compiled, {failed} failed")
    if compiled == 0:
        print("FAIL: no snippet found (the docs show the layer in whole units)")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
