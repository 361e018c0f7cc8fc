#!/usr/bin/env bash
# On the H200: the GPU tests of the kernels, the top-k kernel, the deferred commit and the engine with kernels; then
# end-to-end tokens/s of ar and tree-ready with the wide tree at batch 1 and 8 (bench e2e: every output == ar), for
# this checkout and — if BASE names another checkout's root (its checkpoints/ linked to these) — for that one too,
# in the same call, so that the two are measured on one machine.
#   BASE=_base bash bench/recipes/h200_loop_check.sh
set -uo pipefail
source bench/recipes/lib.sh
python3 -m pytest -q -p no:cacheprovider tests/test_engine_kernels.py tests/test_topk_kernel.py \
  "tests/test_kernels.py" "tests/test_deferred_commit.py" -k "gpu or engine" 2>&1 | tee "$OUT/gpu_tests.log"
E2E=(bench e2e --modes ar tree-ready --batch 1 8 --prompts-per-domain 2 --repeats 2 --max-tokens 64 "${WIDE_TREE[@]}"
     --no-plots)
"${H[@]}" "${E2E[@]}" --json "$OUT/e2e_loop.json" 2>&1 | tail -30
if [ -n "${BASE:-}" ]; then
  (cd "$BASE" && unset PYTHONPATH && source bench/recipes/lib.sh && "${H[@]}" "${E2E[@]}" --json "$OUT/e2e_base.json" 2>&1 | tail -30)
fi
