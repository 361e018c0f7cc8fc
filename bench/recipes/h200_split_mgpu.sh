# The split tree solve with its Mosaic GPU value pass (pallas_kernels/gdn_tree_split_mgpu.py) on the H200: GPU
# correctness tests, then the kernel table at 64 nodes against the Triton split form.
# Usage (repository root, device machine): bash bench/recipes/h200_split_mgpu.sh
source bench/recipes/lib.sh
CONFIGS=${CONFIGS:-8:64,1:64,32:64}
VARIANTS=${VARIANTS:-'pallas_split_bv64|pallas_split_mgpu_bv64(_chpair)?|serial_pallas_bv64|xla_solve|null_overhead'}
timeout 150 python3 -m pytest tests/test_kernels.py -q -x -p no:cacheprovider -k "mgpu_gpu or (tree_solve_gpu_bf16 and 64)" 2>&1 | tail -4
timeout 280 "${H[@]}" bench kernels --json "$OUT/kernels_split_mgpu_h200.json" --configs "$CONFIGS" \
  --no-commit --reps 10 --max-seconds 240 --variants "$VARIANTS" 2>&1 | tail -30
