# Helpers shared by the drafter recipes (sourced; needs RUN and NGPU set, and H, TARGET, PROMPTS, GEN_LEN,
# GEN_BATCH, VARIANTS for build_distill_data).

# on SLOT CMD...: run CMD on GPU SLOT % NGPU with that GPU's share of the cores (NGPU 1: as is)
on() {
  local slot=$1; shift
  if [ "$NGPU" -gt 1 ]; then
    local g=$((slot % NGPU)) per=$(( $(nproc) / NGPU ))
    CUDA_VISIBLE_DEVICES=$g taskset -c $((g * per))-$((g * per + per - 1)) "$@"
  else
    "$@"
  fi
}
# mean teacher-forced tau over the validation domains of RUN/NAME/summary.json, for NAME in the arguments
mean_tau() {
  python3 - "$RUN" "$@" <<'PY'
import json, sys, pathlib
run = pathlib.Path(sys.argv[1])
rows = {}
for name in sys.argv[2:]:
    f = run / name / "summary.json"
    if f.is_file():
        val = json.loads(f.read_text())["val"]
        rows[name] = round(sum(v["tau"] for v in val.values()) / len(val), 4)
print(json.dumps(rows))
PY
}
best_of() { python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(max(r, key=r.get))' "$1"; }
# RUN/distill: every prompt of PROMPTS continued VARIANTS times by the target, the variants split over the GPUs
build_distill_data() {
  local per=$(( (VARIANTS + NGPU - 1) / NGPU )) parts=() pids=() g first n p
  for ((g = 0; g < NGPU; g++)); do
    first=$((g * per)); n=$(( VARIANTS - first < per ? VARIANTS - first : per ))
    [ "$n" -gt 0 ] || continue
    on "$g" "${H[@]}" build-distill --target "$TARGET" --prompts "$PROMPTS" --out "$RUN/distill_$g" \
        --gen-len "$GEN_LEN" --batch-size "$GEN_BATCH" --variants "$n" --first-variant "$first" \
        > "$RUN/distill_$g.log" 2>&1 &
    pids+=($!); parts+=("$RUN/distill_$g")
  done
  for p in "${pids[@]}"; do wait "$p"; done
  "${H[@]}" merge-distill "${parts[@]}" --out "$RUN/distill"
  rm -f "$RUN"/distill_*/sequences.npy
}
