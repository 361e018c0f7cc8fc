# The split tree solve with its Mosaic GPU value pass (pallas_kernels/gdn_tree_apply_mgpu.py) on the H200:
# GPU correctness tests, then the kernel table at 64 nodes against the Triton split form, then ncu resources.
# Usage (repository root, device machine): bash bench/recipes/h200_split_mgpu.sh
source bench/recipes/lib.sh
timeout 150 python3 -m pytest tests/test_kernels.py -q -x -p no:cacheprovider -k "tree_solve_gpu_bf16 and 64" 2>&1 | tail -4
timeout 300 "${H[@]}" bench kernels --json "$OUT/kernels_split_mgpu_h200.json" --configs 8:64,1:64,16:64,32:64,8:64:64 \
  --no-commit --reps 10 --max-seconds 250 \
  --variants 'pallas_split_bv64|pallas_split_mgpu_bv64(_noshare)?|serial_pallas_bv64|xla_solve|null_overhead' 2>&1 | tail -25
timeout 120 "${H[@]}" bench kernel-resources --jobs split,split_mgpu,split_mgpu_noshare --detail \
  --json "$OUT/kernel_resources_mgpu_h200.json" 2>&1 | tail -20
pkill -x ncu || true
