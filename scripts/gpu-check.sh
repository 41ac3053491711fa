#!/usr/bin/env bash
# The GPU check, run on a machine with an NVIDIA GPU (the device tool runs it in a fresh copy of
# the working tree): build with CUDA, run the gpu suite and the host suite, run the GPU tests under
# compute-sanitizer, and copy the logs to $OUT (default: gpu-out/).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  nvcc --version | tail -2
  meson --version
} >"$out/machine.txt" 2>&1
rm -rf build-gpu
meson setup build-gpu -Dcuda=enabled -Dmpi=auto >"$out/setup.log" 2>&1 || { tail -30 "$out/setup.log"; exit 1; }
ninja -C build-gpu >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
meson test -C build-gpu --no-rebuild --print-errorlogs >"$out/test.log" 2>&1
cp build-gpu/meson-logs/testlog.json "$out/testlog.json"
rc=0
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for t in build-gpu/tests/test-kernels-* build-gpu/tests/test-comm-gpu-collectives; do
  [ -x "$t" ] || continue
  "$sanitizer" --tool memcheck --error-exitcode 3 "$t" >"$out/sanitizer-$(basename "$t").log" 2>&1 || rc=1
done
# The loopback all_to_all_v benchmark (8 ranks on one GPU), nccl-tests style.
if [ -x build-gpu/benchmarks/comm/bench-comm-a2av-loopback ]; then
  build-gpu/benchmarks/comm/bench-comm-a2av-loopback 8 >"$out/bench-a2av-loopback.txt" 2>&1 || rc=1
fi
tail -n 12 "$out/test.log"
python3 scripts/count_tests.py "$out/testlog.json" | tee "$out/count.txt" || rc=1
exit $rc
