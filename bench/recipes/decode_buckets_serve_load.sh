#!/usr/bin/env bash
# The decoding buckets (`hyspec serve --decode-buckets`, `Backend.step_rows`) end to end through the server: for each
# mode, one server per bucket setting (BUCKETS="none auto": every step over all slots / over the smallest of 1 and the
# powers of 4 below the slots that holds the decoding requests), up side by side and driven by this checkout's
# serve_load (httpx), alternated REPS times, at concurrency CONC (the embedded model and drafter, greedy).
#   on a GPU machine:  bash bench/recipes/decode_buckets_serve_load.sh          (the server's wheels carried as .whl)
#   on a CPU:          SLOTS=16 CONC=1,4,16 REQUESTS=16 MAX_TOKENS=32 bash bench/recipes/decode_buckets_serve_load.sh
# Knobs: MODES ("ar tree-ready"), BUCKETS ("none auto"), REPS (2), SLOTS (32), CONC (1,8,32), REQUESTS (64 a level),
# MAX_TOKENS (64), DATASET (random). Files: $OUT/server_<mode>_<buckets>.log, $OUT/serve_load_<mode>_<buckets>_<rep>.json.
set -uo pipefail
source bench/recipes/serve_common.sh || exit 1
SERVE=(--port 0 --max-batch "${SLOTS:-32}" --max-queue 256 --max-model-len 1024 --prefill-chunk 128)
LOAD=(--concurrency "${CONC:-1,8,32}" --num-requests "${REQUESTS:-64}" --max-tokens "${MAX_TOKENS:-64}"
      --dataset "${DATASET:-random}")

for mode in ${MODES:-ar tree-ready}; do
  declare -A PORT=()
  for b in ${BUCKETS:-none auto}; do
    PORT[$b]=$(start_server "$PWD" "$OUT/server_${mode}_$b.log" "${SERVE[@]}" --spec-mode "$mode" --decode-buckets "$b") || exit 1
  done
  for rep in $(seq "${REPS:-2}"); do
    for b in ${BUCKETS:-none auto}; do
      echo "== $mode buckets $b, pass $rep"
      python3 -m hyspec_jax.bench.serve_load --url "http://127.0.0.1:${PORT[$b]}" "${LOAD[@]}" \
        --json "$OUT/serve_load_${mode}_${b}_$rep.json" 2>&1 | tail -6
    done
  done
  for b in ${BUCKETS:-none auto}; do kill -TERM "$(cat "$OUT/server_${mode}_$b.log.pid")"; done
  wait
  unset PORT
done
