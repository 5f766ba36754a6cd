#!/usr/bin/env bash
# The lower-bound job (docs/install.md "Install and compatibility"): build the wheel, install it into a fresh
# venv with torch==2.13.0 and the declared lower bound of every other dependency
# (constraints/lower.txt), and run the unit tier against the installed wheel, not the checkout.
#   bash scripts/lower_bounds.sh            # scratch directory removed afterwards
#   FFDEBUG_LOWER_DIR=/tmp/lb bash scripts/lower_bounds.sh   # kept (reused venv is rebuilt)
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
work=${FFDEBUG_LOWER_DIR:-}
if [ -z "$work" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
start=$(date +%s)
rm -rf "$work/venv" "$work/dist"
"$PY" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip -q --disable-pip-version-check)
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }
"${pip[@]}" wheel --no-deps -w "$work/dist" . 2>&1 | quiet
wheel=$(ls "$work"/dist/ffdebug-*.whl)
# --no-compile: the tests import a small part of torch / transformers; byte-compiling all of it at
# install time is most of the install's minutes
"${pip[@]}" install --no-compile "ffdebug[test,trainer] @ file://$wheel" "torch==2.13.0" -c constraints/lower.txt 2>&1 | quiet
echo "lower bounds installed in $(($(date +%s) - start)) s:"
"$work/venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null \
  | grep -iE '^(torch|numpy|safetensors|rich|typer|pyyaml|diffusers|transformers|accelerate|pillow|pytest) '
# the installed wheel, never the checkout: pytest's console script and PYTHONSAFEPATH keep the
# working directory off sys.path (the tests still read the repo's fixtures and examples from here)
export PYTHONSAFEPATH=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error OMP_NUM_THREADS=1
where=$("$work/venv/bin/python" -c "import ffdebug; print(ffdebug.__file__)")
case "$where" in
  "$work"/*) echo "testing $where" ;;
  *) echo "lower-bound job: ffdebug resolves to $where, not the wheel in $work" >&2; exit 1 ;;
esac
set +e
# two workers (pytest-xdist, in [test]) where the machine has the cores: the tier's tests are independent
workers=$(( $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) > 1 ? 2 : 1 ))  # nproc alone counts OMP_NUM_THREADS
"$work/venv/bin/pytest" -q -p no:cacheprovider -n "$workers" -m "not integration" "$@"
rc=$?
set -e
echo "lower-bound job: exit $rc in $(($(date +%s) - start)) s"
exit "$rc"
