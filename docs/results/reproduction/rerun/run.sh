#!/usr/bin/env bash
# The rerun of issue 18, in the order that makes a partial database most useful; every line resumes
# (finished cells are skipped). Run from the repository root, with the data folder at ./data (a link
# is fine) and CIFAR-10-C at ./cache/cifar10c (`aqr corrupt`; generated there when missing), so the
# database records relative paths only. THREADS (default 1) sets torch's threads per cell.
set -euo pipefail
DIR=docs/results/reproduction/rerun
COMMON=(--data-dir data --cifar-c cache/cifar10c --db "$DIR/results.db" --cache cache --threads "${THREADS:-1}" --no-progress)
aqr bench "${COMMON[@]}" --config "$DIR/rerun.json" --batch-sizes 128 --seeds 0      # sev 5, bs 128, seed 0: every model
aqr bench "${COMMON[@]}" --config "$DIR/tails.json"                                   # clip vs clip-source (ablation)
aqr bench "${COMMON[@]}" --config "$DIR/bridge.json"                                  # statistics from clean test images
aqr bench "${COMMON[@]}" --config "$DIR/rerun.json" --batch-sizes 128 --seeds 1,2    # sev 5, bs 128: seeds 1, 2
aqr bench "${COMMON[@]}" --config "$DIR/rerun.json" --batch-sizes 512                # sev 5, bs 512: seeds 0-2
aqr bench "${COMMON[@]}" --config "$DIR/rerun.json" --severities 3 --batch-sizes 128 # sev 3, bs 128: seeds 0-2
# the tables and figures, from the database
for e in rerun rerun-bridge rerun-tails; do
    aqr report --db "$DIR/results.db" --experiment "$e" --out "$DIR/$e"
done
