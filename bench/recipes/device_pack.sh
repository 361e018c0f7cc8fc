#!/usr/bin/env bash
# A GPU machine call takes at most 64 MiB of working tree, and the embedded checkpoint alone holds about 68 MiB of
# weights. This packs them for such a call (xz, about 44 MiB; the MTP shard, unused by the recipes, left out):
#   here:    bash bench/recipes/device_pack.sh pack       weights -> .devpack/weights.tar.xz; the weight files and
#                                                         bench/results move into .devhold/ (ignored, so it does
#                                                         not travel) until `restore`: carry .devpack (and .whl
#                                                         for a server). Commit nothing in between.
#            bash bench/recipes/device_pack.sh restore    moves them back
#   there:   bash bench/recipes/device_pack.sh unpack     the weights back in place, the MTP shard out of the index
set -euo pipefail
cd "$(dirname "$0")/../.."           # the repository root
HOLD=.devhold
CK=checkpoints/default
case "${1:-}" in
  pack)
    [ -e "$HOLD" ] && { echo "$HOLD exists: restore first" >&2; exit 1; }
    mkdir -p .devpack "$HOLD/$CK/drafter" "$HOLD/bench"
    tar cf - $CK/model-0*.safetensors $CK/drafter/model.safetensors | xz -T0 -6 > .devpack/weights.tar.xz
    mv $CK/model-0*.safetensors $CK/mtp.safetensors "$HOLD/$CK/"
    mv $CK/drafter/model.safetensors "$HOLD/$CK/drafter/"
    mv bench/results "$HOLD/bench/"
    du -sh .devpack ;;
  restore)
    mv "$HOLD/$CK"/*.safetensors $CK/
    mv "$HOLD/$CK/drafter/model.safetensors" $CK/drafter/
    mv "$HOLD/bench/results" bench/
    rm -rf "$HOLD"; git status --short ;;
  unpack)
    tar xJf .devpack/weights.tar.xz
    python3 - <<'PY'
import json
p = "checkpoints/default/model.safetensors.index.json"
d = json.load(open(p))
d["weight_map"] = {k: v for k, v in d["weight_map"].items() if v != "mtp.safetensors"}
json.dump(d, open(p, "w"), indent=2)
PY
    ;;
  *) echo "usage: device_pack.sh pack|restore|unpack" >&2; exit 2 ;;
esac
