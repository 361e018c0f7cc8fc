# Helpers shared by the drafter recipes (sourced; needs RUN and NGPU set).

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
