#!/usr/bin/env bash
# The rest of the [bench] end-to-end table in one device call (about 7 minutes): all five modes side by side at
# batch 8 on the GPU default (wide) tree, then batch 1 again with the verified-node sweep (N 32 / 64 / 128:
# tree-ready's tau against its rate), modes alternated in every repeat, output == ar checked in every run.
# Results land in OUT (default: $OUT on the device machine, else ./out). From the repository root:
#   bench/recipes/h200_batch8_nodes.sh        # PROMPTS=8 REPEATS=3 MAX_TOKENS=96 by default
set -uo pipefail
. "$(dirname "$0")/lib.sh"
TREE=("${WIDE_TREE[@]}" --kernels auto)
"${H[@]}" bench e2e --json "$OUT/e2e_h200_batch8.json" --drafter checkpoints/default/drafter --batch 8 \
  --prompts-per-domain "$PROMPTS" --repeats "$REPEATS" --max-tokens "$MAX_TOKENS" "${TREE[@]}" 2>&1 | tail -n 12
"${H[@]}" bench e2e --json "$OUT/e2e_h200_nodes.json" --drafter checkpoints/default/drafter --batch 1 \
  --modes ar tree tree-ready --sweep-nodes 64 128 --prompts-per-domain "$PROMPTS" --repeats 2 \
  --max-tokens "$MAX_TOKENS" "${TREE[@]}" 2>&1 | tail -n 12
