#!/usr/bin/env bash
# The headline H200 measurements in one device call (about 8 minutes; nothing else on the machine):
#   1. all five modes side by side at batch 1 on the GPU default (wide) tree, modes alternated in every repeat,
#      against the branch-free greedy `ar` (commit c562d9e6; the branch it replaced cost nothing measurable here);
#   2. where a round's time goes (round-profile: wall vs GPU busy, operations per round, largest kernels).
# Results land in OUT (default: $OUT on the device machine, else ./out). Usage, from the repository root:
#   bench/recipes/h200_headline.sh            # PROMPTS=8 REPEATS=3 MAX_TOKENS=96 by default
set -uo pipefail
. "$(dirname "$0")/lib.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
"${H[@]}" bench e2e --json "$OUT/e2e_h200_headline.json" --drafter checkpoints/default/drafter --batch 1 \
  --prompts-per-domain "$PROMPTS" --repeats "$REPEATS" --max-tokens "$MAX_TOKENS" \
  "${WIDE_TREE[@]}" --kernels auto 2>&1 | tail -n 25
"${H[@]}" bench round-profile --json "$OUT/round_profile_h200_headline.json" --max-tokens "$MAX_TOKENS" \
  "${WIDE_TREE[@]}" 2>&1 | tail -n 20
