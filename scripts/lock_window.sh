#!/usr/bin/env bash
# Runs a command under the machine's CPU lock (MAE_CPU_LOCK, default /tmp/mae-cpu.lock), one hold of the lock
# shared by the commands that follow each other within LOCK_WINDOW_S seconds (default 30; 0: each command waits
# for the lock itself). Mutation testing runs hundreds of test commands of seconds each; waiting in line for the
# lock before every one of them, behind other jobs of minutes, would take hours. A holder process waits for the
# lock and holds it for the window (or until no command has run for 5 s), then gives it back once the command
# running at the time has ended.
#   scripts/lock_window.sh python -m pytest -x -q tests/train/test_schedule.py
set -euo pipefail
lock=${MAE_CPU_LOCK:-/tmp/mae-cpu.lock}
window=${LOCK_WINDOW_S:-30}
if [ "$window" = 0 ]; then exec flock "$lock" "$@"; fi
dir=/tmp/mae-lock-window-$UID
mkdir -p "$dir"
gate=$dir/gate held=$dir/held
# A command holds the gate shared while it runs; the holder removes `held` (taking the gate exclusively, so after
# the running command) before it lets go of the lock, so a command that sees `held` under the gate has the lock.
exec 8>"$gate"
{ flock -n 9 && rm -f "$held"; } 9>"$dir/holder"  # no holder alive: a `held` left by a killed one is stale
until flock -s 8 && [ -e "$held" ]; do
  flock -u 8
  ( flock -n 9 || exit 0  # one holder at a time
    flock "$lock" bash -c "touch '$held'; idle=0; end=\$((SECONDS + $window))
      while [ \$SECONDS -lt \$end ] && [ \$idle -lt 5 ]; do  # or no command for 5 s: the commands have ended
        sleep 1; if flock -n '$gate' true; then idle=\$((idle + 1)); else idle=0; fi
      done; flock '$gate' rm -f '$held'"
  ) 9>"$dir/holder" 8>&- </dev/null >/dev/null 2>&1 &
  sleep 1
done
"$@"
