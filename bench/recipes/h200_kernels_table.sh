# The kernel table on the H200 (tree solve at B 1/8/16/32 × N 16/64/128, depth 8 and one chain), in two
# device calls (one call's 10 minutes do not hold all of it):
#   PART=1 (default): every row up to B 8, N 128;
#   PART=2: the remaining N 128 rows, then both JSONs merged into one table (pass PART1_JSON, the first call's).
# Usage (repository root, device machine): bash bench/recipes/h200_kernels_table.sh
source bench/recipes/lib.sh
if [ "${PART:-1}" = 1 ]; then
  timeout 400 "${H[@]}" bench kernels --json "$OUT/kernels_h200_mgpu_final.json" \
    --configs 8:64,8:64:64,1:64,16:64,32:64,8:16,1:16,16:16,32:16,8:128,16:128,32:128,1:128 \
    --no-commit --reps 10 --max-seconds 360 \
    --variants 'pallas_(inverse|split)_bv64|pallas_split_bv128|pallas_split_mgpu_bv64|serial_pallas_bv64|xla_solve|null_overhead' \
    2>&1 | tail -32
else
  timeout 270 "${H[@]}" bench kernels --json "$OUT/kernels_h200_mgpu_n128.json" --configs 16:128,32:128,1:128 \
    --no-commit --reps 6 --max-seconds 230 \
    --variants 'pallas_split_bv(64|128)|serial_pallas_bv64|xla_solve|null_overhead' 2>&1 | tail -12
  [ -n "${PART1_JSON:-}" ] && "${H[@]}" bench kernels --merge "$PART1_JSON" "$OUT/kernels_h200_mgpu_n128.json" \
    --json "$OUT/kernels_h200_mgpu_table.json"
fi
