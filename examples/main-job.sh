#!/usr/bin/env bash
# The main job: what statetool is for, told on the bundled example pipeline (rivet.yaml
# here). An old rivet release left its state beside the config; statetool upgrades it with
# a verified backup, sees a first run coming before it happens, shows who holds a run,
# and confirms the fix. Every step prints a comment (# …) saying what you are looking at,
# then the command ($ …) and what it printed. It exits 0 and leaves nothing running.
set -euo pipefail
cd "$(dirname "$0")"
export COLUMNS="${COLUMNS:-120}"
rm -rf .rivet_state.db .rivet_state.db-* .rivet_state.db.backup-* .rivet_state.leases checkpoints backup

if [ -t 1 ] && [ -z "${NO_COLOR:-}" ]; then bold=$'\033[1m' plain=$'\033[0m'; else bold='' plain=''; fi
step() { printf '\n%s# %s%s\n' "$bold" "$*" "$plain"; }
show() { printf '$ %s\n' "$*"; }
run() { show "$*"; "$@"; }
# run a command whose non-zero exit is the answer, and print that exit code
answer() { show "$*"; local code=0; "$@" || code=$?; echo "(exit $code)"; }

holder=""
stop_holder() { if [ -n "$holder" ]; then kill -TERM "$holder" 2>/dev/null || true; wait "$holder" || true; fi; }
trap stop_holder EXIT

step "1. An old rivet release left this state beside the config: legacy tables, 5,000 runs, no identity."
run python -m statetool.example --config rivet.yaml --runs 5000

step "2. The CI pre-flight before the new release: the state needs an upgrade (exit 3: schema drift)."
answer statetool check

step "3. The upgrade: a verified backup, every revision in one transaction, the source recorded as its identity."
run statetool migrate

step "4. A worker was rebuilt and the CDC export's position file was lost (a copy is in backup/)."
mkdir -p backup
run mv checkpoints/order_events.json backup/

step "5. doctor sees the first run before it happens: order_events would re-anchor its stream (exit 5)."
answer statetool doctor

step "6. A run of orders is going on (in the background): its lease, and who holds it."
show "statetool leases run --export orders -- sleep 30 &"
statetool leases run --export orders -- sleep 30 &
holder=$!
show statetool leases
for _ in $(seq 150); do  # until the run has taken its lease and written who holds it (a second or so)
  leases=$(statetool leases)
  if grep -E '\blive +[0-9]+ ' <<<"$leases" >/dev/null; then break; fi
  sleep 0.2
done
echo "$leases"

step "7. A second run of orders is refused while the first holds the lease (exit 2: retry later)."
answer statetool --lock-wait 0 leases run --export orders -- true

step "8. The first run ends (stopped with SIGTERM, as a scheduler stops a task): its lease is free again."
show "kill -TERM $holder; wait $holder"
kill -TERM "$holder"
code=0
wait "$holder" || code=$?
holder=""
echo "(the run ended with exit $code)"
run statetool leases

step "9. The fix: the checkpoint restored from its copy; doctor says every export resumes (exit 0)."
run cp backup/order_events.json checkpoints/order_events.json
run statetool doctor
