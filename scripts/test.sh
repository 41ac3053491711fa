#!/usr/bin/env bash
# Builds everything (CUDA targets too when nvcc is there) and runs the test suite. The last line is
# "N passed, N failed, N skipped", counted per test case from the real results.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/configure.sh build -Dwerror=true || exit 1
ninja -C build || exit 1
meson test -C build --no-rebuild --print-errorlogs "$@" >build/meson-test.log 2>&1
tail -n 12 build/meson-test.log
python3 scripts/count_tests.py build/meson-logs/testlog.json
