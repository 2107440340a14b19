#!/usr/bin/env bash
# Length extrapolation at quickstart scale: trains configs/quickstart.py (a 4-layer byte-level
# decoder on pystdlib, training length 128) once per positional encoding, evaluates each from the
# training length to 16x it, and draws the curves in one plot (results/quickstart_extrapolation.*).
#
# Every encoding gets BERT-sized token embeddings (model.embed_scale=none), the setting this smoke
# test was first run with; experiments/extrapolation.py is the fair comparison (docs/fidelity.md).
#
# Usage: bash experiments/quickstart_extrapolation.sh [RUNS_DIR]   (about 5 minutes per encoding on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-/tmp/roformer_quickstart_extrapolation}"
kinds="${KINDS:-rope alibi nope sinusoidal}"
dirs=()
name=ppl_vs_length_nonoverlapping  # what eval.py names a --protocol=nonoverlapping result
for kind in $kinds; do
  dir="$runs/$kind"
  python train.py --config=configs/quickstart.py --workdir="$dir" --config.posenc.kind="$kind" \
    --config.model.embed_scale=none
  python eval.py --workdir="$dir" --protocol=nonoverlapping --max_tokens=32768 --overwrite
  dirs+=("$dir")
done
mkdir -p results
python eval.py --compare="$(IFS=,; echo "${dirs[*]}")" --out="$name" \
  --plot=results/quickstart_extrapolation.png
for dir in "${dirs[@]}"; do
  cp "$dir/eval/$name.json" "results/quickstart_extrapolation_$(basename "$dir").json"
done
