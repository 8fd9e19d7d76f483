#!/usr/bin/env bash
# Mutation testing of the core with mutmut (not in CI: minutes to hours). Each mutant of a module must make
# one of its tests fail; survivors are either equivalent mutants or missing tests.
#   scripts/mutation_test.sh mae/models/patches.py "tests/models/test_patches.py tests/models/test_mae.py"
# Modules worth it: mae/models/{masking,patches,pos_embed}.py, mae/data/samplers.py, mae/train/checkpoint.py, and the
# loss in mae/models/mae.py (its functions only: further arguments are mutmut's mutant-name patterns), e.g.
#   scripts/mutation_test.sh mae/models/mae.py "tests/models/test_mae.py" 'mae.models.mae.*forward_target*'
set -euo pipefail
module=${1:?usage: $0 MODULE.py "TEST FILES"}
tests=${2:?usage: $0 MODULE.py "TEST FILES"}
pip show mutmut >/dev/null 2>&1 || pip install "mutmut>=3"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
# mutmut 3 reads lists one item a line: the module to mutate, and the tests that run against each mutant
{
  printf '[mutmut]\nsource_paths=\n    %s\nalso_copy=\n    mae/\npytest_add_cli_args_test_selection=\n' "$module"
  for t in $tests; do printf '    %s\n' "$t"; done
} > setup.cfg.mutmut
trap 'rm -f setup.cfg.mutmut; [ -f setup.cfg.bak ] && mv setup.cfg.bak setup.cfg || rm -f setup.cfg' EXIT
[ -f setup.cfg ] && cp setup.cfg setup.cfg.bak
cp setup.cfg.mutmut setup.cfg
mutmut run "${@:3}" || true
mutmut results
