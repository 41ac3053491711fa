#!/usr/bin/env bash
# Builds everything (CUDA targets too when nvcc is there) and runs the test suite. The last line is
# "N passed, N failed, N skipped", counted per test case from the real results.
set -uo pipefail
cd "$(dirname "$0")/.."
# The PyTorch module: torch in its venv (scripts/setup-torch.sh), moefold_torch built into it;
# its tests join the suite (-Dtorch_python). MOEFOLD_NO_TORCH=1 leaves both out.
torch_py=""
if [ "${MOEFOLD_NO_TORCH:-0}" != 1 ]; then
  t0=$(date +%s)
  torch_py=$(bash scripts/setup-torch.sh | tail -n 1) || exit 1
  echo "test.sh: torch ready in $(($(date +%s) - t0)) s ($torch_py)"
  t0=$(date +%s)
  MAX_JOBS=2 "$torch_py" -m pip install --quiet --disable-pip-version-check --no-build-isolation \
    --no-deps ./python || { echo "test.sh: building moefold_torch failed"; exit 1; }
  echo "test.sh: moefold_torch built in $(($(date +%s) - t0)) s"
fi
bash scripts/configure.sh build -Dwerror=true -Dtorch_python="$torch_py" || exit 1
ninja -C build || exit 1
meson test -C build --no-rebuild --print-errorlogs "$@" >build/meson-test.log 2>&1
tail -n 12 build/meson-test.log
python3 scripts/count_tests.py build/meson-logs/testlog.json
