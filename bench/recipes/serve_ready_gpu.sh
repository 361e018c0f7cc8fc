#!/usr/bin/env bash
# [startup] target 5 as a user meets it: the default `hyspec serve` (embedded model, no options) from launch to
# /health answering 200, cold (empty caches) and then again from the persistent caches, on this machine; then one
# completion through the server. Writes $OUT/serve_ready.json. COLD_LIMIT / WARM_LIMIT: seconds to wait (330 / 150);
# SERVE_ARGS: options for both starts (default none, e.g. "--spec-mode tree-ready" for a CPU's tree-ready server).
# Runs on a CPU as well.
# Usage (repository root, device machine): bash bench/recipes/serve_ready_gpu.sh
# A device call carries at most 64 MiB of working tree, less than the checkout with the embedded checkpoint: pack the
# weights first (`bash bench/recipes/device_pack.sh pack` here, carry .devpack; `restore` after the call) and run
#   bash bench/recipes/device_pack.sh unpack && bash bench/recipes/serve_ready_gpu.sh
source bench/recipes/lib.sh
export HYSPEC_CACHE=$(mktemp -d)          # empty: the first start is cold; the second reads what the first kept
PORT=${PORT:-8471}
http() {  # $1: path, $2: JSON body (POST) or empty (GET); the body on stdout, non-zero unless 200
  python3 - "http://127.0.0.1:$PORT$1" "${2:-}" <<'PY'
import sys, urllib.request
url, body = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, data=body.encode() if body else None, headers={"Content-Type": "application/json"})
try:
    print(urllib.request.urlopen(req, timeout=60).read().decode())
except Exception:
    sys.exit(1)
PY
}
start() {  # $1: label, $2: limit (s) -> "label seconds" (or "label >limit") on stdout, the log under $OUT
  local t0=$(date +%s.%N) ok=
  "${H[@]}" serve --port $PORT ${SERVE_ARGS:-} > "$OUT/serve_$1.log" 2>&1 & local pid=$!
  local deadline=$(( $(date +%s) + $2 ))
  while [ "$(date +%s)" -lt $deadline ]; do   # wall clock, not a count of polls (each poll starts a python)
    if http /health > /dev/null 2>&1; then ok=1; break; fi
    kill -0 $pid 2>/dev/null || break; sleep 0.25
  done
  local t1=$(date +%s.%N)
  if [ -n "$ok" ]; then
    echo "$1 $(python3 -c "print(round($t1 - $t0, 1))")"
    http /v1/completions '{"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0}' > "$OUT/serve_$1_completion.json"
    http /metrics | grep -i "compil" > "$OUT/serve_$1_metrics.txt"
  elif kill -0 $pid 2>/dev/null; then echo "$1 >$2"
  else echo "failed: the server exited; its log: $OUT/serve_$1.log" >&2; tail -3 "$OUT/serve_$1.log" >&2; exit 1; fi
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
}
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
cold=$(start cold ${COLD_LIMIT:-330}) || exit 1; echo "$cold"
warm=$(start warm ${WARM_LIMIT:-150}) || exit 1; echo "$warm"
python3 - "$cold" "$warm" > "$OUT/serve_ready.json" <<'PY'
import json, sys
import jax
gpu = jax.devices()[0].device_kind
rows = {}
for arg in sys.argv[1:]:
    label, value = arg.split()
    rows[label] = {"ready_s": float(value)} if not value.startswith(">") else {"not_ready_within_s": float(value[1:])}
import os
command = ("hyspec serve " + os.environ.get("SERVE_ARGS", "")).strip() or "hyspec serve"
print(json.dumps({"command": command, "device": gpu, "jax": jax.__version__, **rows}, indent=1))
PY
cat "$OUT/serve_ready.json"; head -c 400 "$OUT/serve_cold_completion.json" 2>/dev/null; echo; cat "$OUT/serve_warm_metrics.txt" 2>/dev/null | head
