#!/usr/bin/env python3
"""The README's code snippet is tests/docs/readme_example.cpp verbatim (which the build compiles and
runs), so the README never shows code that does not compile."""
import sys

readme, example = open(sys.argv[1]).read(), open(sys.argv[2]).read()
block = "```cpp\n" + example + "```"
ok = block in readme
print("README snippet matches tests/docs/readme_example.cpp" if ok else
      "README snippet differs from tests/docs/readme_example.cpp: copy the file into the README")
sys.exit(0 if ok else 1)
