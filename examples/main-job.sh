#!/usr/bin/env bash
# The main job on the bundled example: a pipeline whose state an old rivet release left
# beside its config (legacy shape, 5,000 runs of history, no identity). statetool tells
# the truth about it, upgrades it with a verified backup, and shows it at head.
set -euo pipefail
cd "$(dirname "$0")"
export COLUMNS="${COLUMNS:-120}"
rm -rf .rivet_state.db .rivet_state.db-* .rivet_state.db.backup-* checkpoints

step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }

step python -m statetool.example --config rivet.yaml --runs 5000
python -m statetool.example --config rivet.yaml --runs 5000

step statetool -c rivet.yaml info
statetool -c rivet.yaml info

step statetool -c rivet.yaml check
statetool -c rivet.yaml check && code=0 || code=$?
echo "check exit code: $code (3 = schema drift: migrate first)"

step statetool -c rivet.yaml migrate --dry-run
statetool -c rivet.yaml migrate --dry-run

step statetool -c rivet.yaml migrate
statetool -c rivet.yaml migrate

step statetool -c rivet.yaml info
statetool -c rivet.yaml info

step statetool -c rivet.yaml check
statetool -c rivet.yaml check
