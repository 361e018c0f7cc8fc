# Sourced by bin/hyspec and bin/test: create .venv with Python 3.12 and install the project once.
# Re-installs only when pyproject.toml changes. Usage: source bin/_bootstrap.sh [extras]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
EXTRAS="${1:-}"
# A machine with an NVIDIA GPU gets the CUDA build of the pinned jax (the `cuda` extra) besides what was asked.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  EXTRAS="${EXTRAS:+$EXTRAS,}cuda"
fi

find_python() {
  for cand in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python3.12"; do
    if PYENV_VERSION=3.12.1 command -v "$cand" >/dev/null 2>&1 && \
       PYENV_VERSION=3.12.1 "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  for v in $(ls -d "$HOME"/.pyenv/versions/3.12* 2>/dev/null); do echo "$v/bin/python3.12"; return 0; done
  echo "hyspec: error: Python 3.12 not found (install it, e.g. with pyenv)" >&2; return 1
}

stamp_want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)-${EXTRAS:-base}"
stamp_file="$VENV/.hyspec-installed"
if [ ! -x "$VENV/bin/python" ]; then
  PY="$(find_python)"
  echo "[bootstrap] creating $VENV with $PY" >&2
  PYENV_VERSION=3.12.1 "$PY" -m venv "$VENV"
fi
have="$(cat "$stamp_file" 2>/dev/null || true)"
# A test install satisfies a plain run too (and a test,cuda install a cuda one).
if [ "$have" != "$stamp_want" ] && [ "$have" != "${stamp_want%-*}-test" ] && \
   [ "$have" != "${stamp_want%-*}-test,cuda" ]; then
  echo "[bootstrap] installing hyspec-jax${EXTRAS:+[$EXTRAS]} into .venv (first time: a few minutes)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q -e "$ROOT${EXTRAS:+[$EXTRAS]}" >&2
  echo "$stamp_want" > "$stamp_file"
fi
