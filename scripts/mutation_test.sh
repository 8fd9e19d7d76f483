#!/usr/bin/env bash
# Mutation testing of one module with mutmut 2.5.1 (not in CI: minutes to an hour a module). mutmut writes each
# mutant into the source file on disk and runs the tests, so decorated code and `python -m mae` child processes
# (PYTHONPATH points here) run the mutant too. Every mutant must make a test fail; a survivor is either an
# equivalent mutant (argued in the module's docs/results/mutation/*.json) or a missing test.
#   scripts/mutation_test.sh mae/train/optim.py "tests/train/test_optim.py tests/train/test_schedule.py"
# The second argument is what pytest selects (files, `-k` expressions); further arguments go to `mutmut run`
# (a mutant id reruns that mutant). Then `scripts/mutation_summary.py MODULE` writes the module's JSON.
# The tests run under the machine's CPU lock through scripts/lock_window.sh: consecutive mutants share one hold of
# it for up to LOCK_WINDOW_S seconds (default 30; 0 = each mutant waits for the lock alone), then other jobs go.
set -euo pipefail
# mutmut's runner (run without a shell): one mutant's tests. mutmut 2 counts only exit status 1 as failing tests, so
# a mutant that breaks an import (pytest's 2) or runs past the limit (124) would pass as a survivor: every failure
# exits 1.
if [ "${1:-}" = --run ]; then
  shift
  "$(dirname "$0")/lock_window.sh" timeout $((${MUTANT_TIMEOUT_S:-300} + 30)) "$@" || exit 1
  exit 0
fi
module=${1:?usage: $0 MODULE.py "PYTEST SELECTION" [MUTMUT RUN ARGS]}
tests=${2:?usage: $0 MODULE.py "PYTEST SELECTION" [MUTMUT RUN ARGS]}
python -c 'import importlib.metadata as m; assert m.version("mutmut") == "2.5.1"' 2>/dev/null \
  || pip install "mutmut==2.5.1"  # the `mutation` extra
export PYTHONPATH=$PWD OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export MUTANT_TIMEOUT_S=${MUTANT_TIMEOUT_S:-300}  # tests running longer (an endless loop) kill the mutant
# The tests run in children of scripts/mutation_server.py, which has imported torch & co. once (it never imports
# mae, so each child reads the mutant from disk); MUTATION_SERVER=0 runs each mutant's pytest in a new process.
sock=/tmp/mae-mutation-$$.sock
if [ "${MUTATION_SERVER:-1}" != 0 ]; then
  python scripts/mutation_server.py --serve "$sock" > "/tmp/mae-mutation-$$.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null; rm -f "$sock"' EXIT
  until [ -S "$sock" ]; do kill -0 $server || { cat "/tmp/mae-mutation-$$.log"; exit 1; }; sleep 1; done
  pytest="python scripts/mutation_server.py --client $sock"
else
  pytest="python -m pytest"
fi
runner="scripts/mutation_test.sh --run $pytest -x -q -p no:randomly -p no:cacheprovider $tests"
find "$(dirname "$module")" -name '__pycache__' -prune -exec rm -rf {} +  # no bytecode of an earlier mutant
# The baseline: the unmutated tests must pass.
out=$(eval "$runner") || { echo "$module: the tests fail without mutations: $runner" >&2; echo "$out"; exit 1; }
echo "baseline: ${out##*$'\n'}"
# mutmut's own timeout is 10x its baseline, which would count other jobs' time on the lock; a cached baseline
# of an hour lifts it out of the way, and MUTANT_TIMEOUT_S bounds each mutant's tests instead.
python -c "from mutmut.cache import hash_of_tests, set_cached_test_time as s; s(3600, hash_of_tests(['tests']))"
mutmut run --paths-to-mutate "$module" --tests-dir tests --runner "$runner" --no-progress --simple-output \
  "${@:3}" || true
mutmut results
