#!/usr/bin/env bash
# The split tree solve's value-pass forms and C M readout on the H200 (issue [kernels]): timings with the GPU time
# per kernel (profiler trace) at the issue's shapes, then Nsight Compute launch statistics and counters per form.
#   bash bench/recipes/h200_split_forms.sh            (OUT=dir for the results; $OUT on the device machine)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/recipes/lib.sh
FORMS='pallas_split_bv64(_(sep|grp))?(_par)?|pallas_split_bv64_grpf(_par)?(_s2)?|pallas_split_bv(32|128)(_(sep|grp|grpf))?'
"${H[@]}" bench kernels --json "$OUT/kernels_split_forms_h200.json" --configs "${CONFIGS:-8:64,32:64,8:16,1:64}" \
  --no-commit --reps 10 --max-seconds "${MAX_SECONDS:-330}" \
  --variants "$FORMS|pallas_inverse_bv64|serial_pallas_bv64|null_overhead"
"${H[@]}" bench kernel-resources --json "$OUT/kernel_resources_split_forms_h200.json" --detail \
  --jobs split,split_sep,split_grp,split_grpf,split_par
