#!/usr/bin/env bash
# The GPU check: one prepared run for a short GPU window (docs/gpu.md, gpu-design.md section 4).
#
#   here:        python3 scripts/gpu-bin.py build gpu-bin        # the GPU programs, built here
#   on the GPU:  OUT=$OUT bash scripts/gpu-check.sh              # (device tool: carry gpu-bin)
#   dry run:     bash scripts/gpu-check.sh --dry-run --bin-dir DIR   (CI: no GPU needed)
#
# Steps, each under `timeout`: facts (GPU, driver, toolkit, compute-sanitizer) -> start-up (every
# carried program starts; if one cannot, they are rebuilt here, on the GPU machine, once) ->
# smoke (one seam kernel on the GPU equals the CPU executor; stop if not) -> correctness (every
# GPU test program; the library GEMM backends' program as the `gemm` step, 60 s; the fast layer's
# as the `layer` step, 25 s, and the `graph` step, 15 s) -> sanitizers (memcheck, racecheck,
# synccheck, initcheck on the seam tests;
# a runtime where compute-sanitizer cannot run is detected and reported) -> benchmark (the layer
# against its GEMMs and PyTorch, the GEMM backends, within 150 s with `layer` and `graph`).
# A GPU test that skips (exit 77) while a GPU is present fails the run, as does a missing
# program or a timed-out step. Output: $OUT/summary.json (docs/gpu-check-summary.schema.json)
# and $OUT/logs.tar.gz, nothing else. Exit 0 only when the run passed.
#
# The whole run keeps within MOEFOLD_GPU_CHECK_BUDGET seconds (default 1500): each step's limit is
# cut to what is left, so that a device lease's timeout never kills the run before it writes its
# summary; the benchmarks run before the sanitizers, which are the first to lose time. cuBLAS and
# NCCL are shared libraries: where the loader cannot find them, the folders of the Python
# packages that ship them (nvidia-cublas, nvidia-nccl) are added to LD_LIBRARY_PATH. A program
# that cannot start only because the machine has no MPI library is recorded as `unavailable`
# (its log names the library), not rebuilt and not counted as run.
#
# --dry-run: no GPU is needed; MOEFOLD_GPU_CHECK_FAKE_GPU=1 makes the script act as if one were
# present (so that a skipping program must fail the run: CI checks that it does).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=${OUT:-gpu-out}
bin_dir=gpu-bin
dry_run=0
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) dry_run=1 ;;
    --bin-dir) bin_dir=$2; shift ;;
    *) echo "gpu-check.sh: unknown argument $1 (--dry-run, --bin-dir DIR)"; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
steps="$logs/steps.jsonl"
: >"$steps"
budget=${MOEFOLD_GPU_CHECK_BUDGET:-1500}
deadline=$(($(date +%s) + budget))
reasons=()
result=pass

# step NAME SECONDS CMD...: runs CMD under timeout with its output in logs/NAME.log and records
# {name, rc, seconds, status}; returns CMD's exit status (124: timed out).
step() {
  local name=$1 limit=$2 t0 rc status left
  shift 2
  t0=$(date +%s)
  left=$((deadline - t0 - 20)) # 20 s kept for the summary and the archive
  if [ $left -lt 5 ]; then
    echo "not run: the check's budget (MOEFOLD_GPU_CHECK_BUDGET=$budget s) is spent" >"$logs/$name.log"
    printf '{"name": "%s", "rc": 124, "seconds": 0, "status": "timeout"}\n' "$name" >>"$steps"
    return 124
  fi
  [ "$limit" -gt $left ] && limit=$left
  timeout --kill-after=10 "$limit" "$@" </dev/null >"$logs/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    77) status=skipped ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  printf '{"name": "%s", "rc": %d, "seconds": %d, "status": "%s"}\n' "$name" "$rc" \
    $(($(date +%s) - t0)) "$status" >>"$steps"
  return $rc
}
fail() {
  result=fail
  reasons+=("$1")
}

# The tree that ran, named by the summary and by the calibration file: the device tool sends a
# working tree over the git metadata of the session's start, so HEAD alone can name an older
# commit; the caller may name the tree's commit, and a tree that differs from HEAD is marked.
commit=${MOEFOLD_GPU_CHECK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
if [ -z "${MOEFOLD_GPU_CHECK_COMMIT:-}" ] && ! git diff --quiet HEAD -- 2>/dev/null; then
  commit+=" with uncommitted changes"
fi

# Facts.
gpu_present=0
if [ "${MOEFOLD_GPU_CHECK_FAKE_GPU:-0}" = 1 ]; then
  gpu_present=1
elif [ $dry_run = 0 ] && nvidia-smi -L >/dev/null 2>&1; then
  gpu_present=1
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
  (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>&1 | tail -2
  (compute-sanitizer --version || /usr/local/cuda/bin/compute-sanitizer --version) 2>&1 | head -2
} >"$logs/facts.log" 2>&1
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
[ $gpu_present = 1 ] || { [ $dry_run = 1 ] || fail "no GPU found (nvidia-smi -L)"; }

# cuBLAS and NCCL from the Python packages that ship them, where the loader has neither.
if [ $dry_run = 0 ]; then
  for d in /usr/local/cuda/lib64 $(python3 -c 'import glob, site
print(" ".join(d for p in site.getsitepackages() for d in sorted(glob.glob(p + "/nvidia/*/lib"))))' \
      2>/dev/null); do
    [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
  done
  export LD_LIBRARY_PATH
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" >>"$logs/facts.log"
fi

# The programs: carried (built here), or rebuilt on this machine when one cannot start.
manifest="$bin_dir/manifest.txt"
unavailable=() # programs that cannot start only for want of an MPI library on this machine
rebuild() {
  step rebuild-setup 300 bash scripts/configure.sh build-gpu -Dcuda=enabled -Dmpi=auto &&
    step rebuild-build 600 ninja -C build-gpu $(python3 scripts/gpu-bin.py build-gpu --targets) &&
    step rebuild-collect 60 python3 scripts/gpu-bin.py build-gpu "$bin_dir"
}
starts() {  # every program loads (a loader failure is exit 127 or a message naming a library)
  local name prog
  while IFS=$'\t' read -r name prog; do
    [ -x "$bin_dir/$prog" ] || return 1
    if ldd "$bin_dir/$prog" 2>/dev/null | grep "not found" >"$logs/missing-$name.log" &&
       ! grep -qvE "lib(mpi|open-rte|open-pal|pmix|hwloc|event)" "$logs/missing-$name.log"; then
      unavailable+=("$name")
      continue
    fi
    timeout 30 "$bin_dir/$prog" --help </dev/null >"$logs/start-$name.log" 2>&1
    [ $? = 127 ] && return 1
    grep -q "error while loading shared libraries" "$logs/start-$name.log" && return 1
  done <"$manifest"
  return 0
}
if [ ! -f "$manifest" ] || ! starts; then
  if [ $dry_run = 1 ]; then
    fail "the carried programs in $bin_dir do not start (dry run: no rebuild)"
  elif ! rebuild || ! starts; then
    fail "the GPU programs could not be built or started here"
  fi
fi

ran=()
if [ -f "$manifest" ]; then
  # Smoke: the seam's first test on the GPU (cuda_exec equals cpu_exec); stop early if not.
  if grep -q "^simt-gpu	" "$manifest"; then
    prog=$(grep "^simt-gpu	" "$manifest" | cut -f2)
    step smoke 120 "$bin_dir/$prog" -tc='*shuffles*'
    rc=$?
    if [ $rc = 77 ] && [ $gpu_present = 1 ]; then
      fail "smoke: simt-gpu skipped while a GPU is present"
    elif [ $rc != 0 ] && [ $rc != 77 ]; then
      fail "smoke: simt-gpu failed (rc $rc): nothing else was run"
      ran=(stop)
    fi
  else
    fail "the manifest has no simt-gpu"
  fi
fi

if [ "${ran[*]:-}" != stop ] && [ -f "$manifest" ]; then
  # Correctness: every GPU test program (benchmarks after).
  while IFS=$'\t' read -r name prog; do
    case $name in bench-*) continue ;; esac
    if [[ " ${unavailable[*]:-} " == *" $name "* ]]; then
      cp "$logs/missing-$name.log" "$logs/test-$name.log"
      printf '{"name": "%s", "rc": 127, "seconds": 0, "status": "unavailable"}\n' "test-$name" >>"$steps"
      echo "  $name: unavailable (no MPI library here: $(tr -s ' \t\n' ' ' <"$logs/missing-$name.log"))"
      continue
    fi
    [ -x "$bin_dir/$prog" ] || { fail "$name: $bin_dir/$prog is missing"; continue; }
    # The library GEMM backends against simt_gemm: the `gemm` step, 60 s at most. The fast layer
    # against the SIMT layer (`layer`) and captured in a CUDA graph (`graph`): one program, two
    # steps (rc: the worse of the two).
    if [ "$name" = exec-gpu-gemm ]; then
      step gemm 60 "$bin_dir/$prog"
    elif [ "$name" = layer-gpu ]; then
      step layer 25 "$bin_dir/$prog" -tc='layer:*'
      rc=$?
      step graph 15 "$bin_dir/$prog" -tc='graph:*'
      rc2=$?
      [ $rc = 0 ] && rc=$rc2
      (exit $rc)
    else
      step "test-$name" 300 "$bin_dir/$prog"
    fi
    rc=$?
    if [ $rc = 77 ]; then
      [ $gpu_present = 1 ] && fail "$name skipped while a GPU is present"
    elif [ $rc = 124 ] || [ $rc = 137 ]; then
      fail "$name timed out"
    elif [ $rc != 0 ]; then
      fail "$name failed (rc $rc)"
    fi
    ran+=("$name")
  done <"$manifest"

  # Benchmark: the loopback all_to_all_v, 8 ranks on one GPU.
  if grep -q "^bench-comm-a2av-loopback	" "$manifest" && [ $gpu_present = 1 ] && [ $dry_run = 0 ]; then
    step bench-a2av-loopback 120 "$bin_dir/bench-comm-a2av-loopback" 8 ||
      fail "bench-comm-a2av-loopback failed"
  fi
  # Benchmark: permute / un-permute against a device copy, the router against PyTorch's
  # routing (benchmarks/kernels/router_peer.py, reading bench-kernels' lines for the ratios).
  if grep -q "^bench-kernels	" "$manifest" && [ $gpu_present = 1 ] && [ $dry_run = 0 ]; then
    step bench-kernels 180 "$bin_dir/bench-kernels" || fail "bench-kernels failed"
    step bench-router-peer 180 python3 benchmarks/kernels/router_peer.py \
      --ours "$logs/bench-kernels.log"
    rc=$?
    [ $rc = 0 ] || [ $rc = 77 ] || fail "router_peer.py failed (rc $rc)"
  fi
  # The layer against its GEMMs and PyTorch (bench-layer, then benchmarks/layer/torch_peer.py on
  # its lines: ratios to torch._grouped_mm), and each GEMM backend against dense cuBLAS
  # (bench-gemm). With the `layer` and `graph` steps: 150 s at most.
  if grep -q "^bench-layer	" "$manifest" && [ $gpu_present = 1 ] && [ $dry_run = 0 ]; then
    step bench-layer 50 "$bin_dir/bench-layer" || fail "bench-layer failed"
    step bench-layer-peer 40 python3 benchmarks/layer/torch_peer.py --ours "$logs/bench-layer.log"
    rc=$?
    [ $rc = 0 ] || [ $rc = 77 ] || fail "torch_peer.py failed (rc $rc)"
    step bench-gemm 20 "$bin_dir/bench-gemm" || fail "bench-gemm failed"
  fi
  # The planner's calibration rates (dense GEMM and attention, queued and single-call; PyTorch):
  # the file lands in logs.tar.gz as calibration.json (docs/planner.md, "Calibration").
  if [ $gpu_present = 1 ] && [ $dry_run = 0 ]; then
    step bench-plan-rates 120 python3 benchmarks/plan/gemm_attention_rates.py \
      "$logs/calibration.json" --commit "$commit"
    rc=$?
    [ $rc = 0 ] || [ $rc = 77 ] || fail "gemm_attention_rates.py failed (rc $rc)"
  fi
  # Sanitizers.
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  sanitizers_json=""
  # sanitize KEY STEP LIMIT TOOL NAME PROG FILTER: PROG (NAME in the manifest; empty: not carried)
  # under the tool as step STEP, its status recorded as KEY in the summary's sanitizers. Each tool
  # once; "not supported" means this runtime cannot run compute-sanitizer (seen on gVisor), which
  # is reported, not counted as a pass. --error-exitcode 3: 3 is the tool's finding; any other
  # failure is the program's own (its checks failed, or it timed out), and the tool is clean only
  # if it summed up.
  sanitize() {
    local key=$1 sname=$2 limit=$3 tool=$4 name=$5 prog=$6 filter=$7 status rc
    if [ $gpu_present = 0 ] || [ $dry_run = 1 ] || [ ! -x "$sanitizer" ] || [ -z "$prog" ]; then
      status=not_run
    else
      step "$sname" "$limit" "$sanitizer" --tool "$tool" --error-exitcode 3 "$bin_dir/$prog" \
        -tc="$filter"
      rc=$?
      if grep -qE "Device not supported|Unable to|error 999" "$logs/$sname.log"; then
        status=unavailable
      elif [ $rc = 3 ]; then
        status=errors
        fail "compute-sanitizer $tool reported errors in $name"
      elif grep -qE "ERROR SUMMARY: 0 errors|SUMMARY: 0 hazards" "$logs/$sname.log"; then
        status=clean
        [ $rc = 0 ] || fail "$name failed under compute-sanitizer $tool (rc $rc; the tool found nothing)"
      else
        status=not_run
        fail "compute-sanitizer $tool did not finish on $name (rc $rc)"
      fi
    fi
    sanitizers_json+="${sanitizers_json:+, }\"$key\": \"$status\""
  }
  # Every case of simt-gpu (the dispatchers and the layer too: 4-13 s per tool on an H200,
  # 2026-12-04); MOEFOLD_GPU_CHECK_SANITIZE_CASES narrows it (a doctest -tc filter).
  prog=$(grep "^simt-gpu	" "$manifest" | cut -f2)
  for tool in memcheck racecheck synccheck initcheck; do
    sanitize "$tool" "sanitizer-$tool" 120 "$tool" simt-gpu "$prog" \
      "${MOEFOLD_GPU_CHECK_SANITIZE_CASES:-*}"
  done
  # The library GEMM backends' small cases (CUTLASS's and cuBLAS's kernels) under memcheck and
  # initcheck: out-of-bounds accesses, and reads of memory nothing wrote.
  gemm_prog=$(grep "^exec-gpu-gemm	" "$manifest" | cut -f2)
  for tool in memcheck initcheck; do
    sanitize "gemm-$tool" "gemm-$tool" 60 "$tool" exec-gpu-gemm "$gemm_prog" 'small*'
  done

fi

# Counts: doctest summaries of the test programs; a program without one counts as one case.
read -r passed failed skipped < <(python3 - "$logs" <<'PY'
import json, pathlib, re, sys
logs = pathlib.Path(sys.argv[1])
p = f = s = 0
steps = [json.loads(l) for l in open(logs / "steps.jsonl")]
for st in steps:
    if not (st["name"].startswith("test-") or st["name"] in ("gemm", "layer", "graph")) \
            or st["status"] == "unavailable":
        continue
    text = (logs / (st["name"] + ".log")).read_text(errors="replace")
    m = re.findall(r"test cases:\s*(\d+) \|\s*(\d+) passed \|\s*(\d+) failed \|\s*(\d+) skipped", text)
    if st["status"] == "skipped":
        s += 1
    elif m:
        _, a, b, c = map(int, m[-1])
        p, f, s = p + a, f + b + (1 if st["status"] != "ok" and b == 0 else 0), s + c
    elif st["status"] == "ok":
        p += 1
    else:
        f += 1
print(p, f, s)
PY
)
[ "$failed" -gt 0 ] && fail "$failed test case(s) failed"

python3 - "$out/summary.json" "$steps" "$result" "$dry_run" "$gpu_present" "$commit" \
  "${gpu_name:-}" "${driver:-}" "$passed" "$failed" "$skipped" "{${sanitizers_json:-}}" \
  "${reasons[@]+"${reasons[@]}"}" <<'PY'
import datetime, json, sys
(path, steps, result, dry, gpu, commit, name, driver, p, f, s, san), reasons = sys.argv[1:13], sys.argv[13:]
json.dump({
    "schema": 1,
    "commit": commit,
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "dry_run": dry == "1",
    "gpu": {"present": gpu == "1", "name": name, "driver": driver},
    "steps": [json.loads(l) for l in open(steps)],
    "tests": {"passed": int(p), "failed": int(f), "skipped": int(s)},
    "sanitizers": json.loads(san),
    "result": result,
    "reasons": reasons,
}, open(path, "w"), indent=1)
PY
tar -czf "$out/logs.tar.gz" -C "$logs" . 2>/dev/null
echo "gpu-check: $result ($passed passed, $failed failed, $skipped skipped)"
for r in "${reasons[@]+"${reasons[@]}"}"; do echo "  - $r"; done
[ $result = pass ]
