#!/usr/bin/env bash
# Installs what moefold's PyTorch module and its tests need: torch and numpy, pinned, into a venv at
# a fixed path outside the clone ($MOEFOLD_TORCH_VENV, default ~/.cache/moefold/torch-2.15.0), reused
# when it already imports the pinned versions (pip's cache does not outlive a CI machine; the venv
# does, between runs on one machine). torch 2.15.0's only Linux x86_64 wheel is its CUDA 13.2 build,
# which runs on the CPU: about 3 GB of wheels and 5.4 GB installed, so 10 GB of free disk are
# checked first. Prints the venv's python on its last line.
set -euo pipefail
torch_version=2.15.0
numpy_version=2.4.6
venv=${MOEFOLD_TORCH_VENV:-$HOME/.cache/moefold/torch-$torch_version}
py="$venv/bin/python"
pinned() {
  "$py" -c "import sys, torch, numpy
sys.exit(not (torch.__version__.split('+')[0] == '$torch_version' and numpy.__version__ == '$numpy_version'))" \
    2>/dev/null
}
if [ -x "$py" ] && pinned; then
  echo "setup-torch: reusing $venv (torch $torch_version, numpy $numpy_version)"
  echo "$py"
  exit 0
fi
mkdir -p "$(dirname "$venv")"
free_kb=$(df -Pk "$(dirname "$venv")" | awk 'NR == 2 { print $4 }')
if [ "${free_kb:-0}" -lt $((10 * 1024 * 1024)) ]; then
  echo "setup-torch: $((free_kb / 1024 / 1024)) GB free under $(dirname "$venv"); torch $torch_version" \
    "needs 10 GB (3 GB of wheels, 5.4 GB installed): free some, or set MOEFOLD_TORCH_VENV to a" \
    "disk with room" >&2
  exit 1
fi
# The venv module (Debian ships it apart from python3).
if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  ver=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "python$ver-venv" >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y \
    -qq --no-install-recommends python3-venv >/dev/null
fi
rm -rf "$venv"
python3 -m venv "$venv"
"$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir \
  "torch==$torch_version" "numpy==$numpy_version" setuptools wheel >&2 ||
  { echo "setup-torch: pip install torch==$torch_version numpy==$numpy_version failed" >&2; exit 1; }
pinned || { echo "setup-torch: the venv at $venv does not import the pinned versions" >&2; exit 1; }
echo "setup-torch: installed torch $torch_version, numpy $numpy_version into $venv"
echo "$py"
