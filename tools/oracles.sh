#!/usr/bin/env bash
# The test suite's oracles (PEFT, DeepSpeed, mergekit, megatron-core), built from the pins of .ci/oracles.txt and run.
#
#   tools/oracles.sh build DIR [MAIN_VENV]   build the environments: `main`'s line into MAIN_VENV (default: the
#                                            python3 on PATH's environment, after torch==2.13.0), every other line
#                                            into DIR/NAME (a fresh venv, torch==2.13.0 first; these build in
#                                            parallel). Writes DIR/env.sh, the variables that point the tests at
#                                            them. Exit 1 when any install failed, with the last lines of its pip log.
#   tools/oracles.sh test DIR [PYTEST ARGS]  the oracle test files with DIR/env.sh's variables; then every skip
#                                            with its reason, and exit 1 if one is not allowed by
#                                            .ci/allowed-skips.txt (tools/check_skips.py, as in .ci/run)
#   tools/oracles.sh [DIR]                   both (DIR defaults to .oracles, ignored by git): the one command to run
#                                            the oracles locally, in the current environment (activate a venv first)
#
# .ci/run calls `build` before the README's test command and sources DIR/env.sh, so the whole suite runs with every
# oracle present. Environment: CKPTOOL_ORACLES_PYTHON (default python3) makes the venvs; PIP_FIND_LINKS and pip's
# other settings pass through (a local torch CPU wheel is found that way on CI machines); CKPTOOL_ORACLES_PINS
# reads another pins file.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
pins=${CKPTOOL_ORACLES_PINS:-$repo/.ci/oracles.txt}
TORCH_PIN="torch==2.13.0"
# the test files that run an oracle (each skips its oracle tests without it; tools/check_skips.py finds those skips)
ORACLE_TESTS=(tests/test_merge_lora.py tests/test_merge_methods.py tests/test_merge_memory.py tests/test_megatron.py
              tests/test_megatron_rewrite.py tests/test_deepspeed.py)

# the requirements of environment $1 in .ci/oracles.txt (comments and blank lines skipped)
requirements() {
  awk -v name="$1" '!/^[[:space:]]*(#|$)/ && $1 == name { for (i = 2; i <= NF; i++) print $i }' "$pins"
}

envs() {
  awk '!/^[[:space:]]*(#|$)/ && $1 != "main" { print $1 }' "$pins"
}

# pip install into the environment of python $1, logging to $2; on failure the log's last lines go to stderr
pip_install() {
  local py=$1 log=$2
  shift 2
  echo "+ $py -m pip install $*" >>"$log"
  # DS_BUILD_OPS=0: DeepSpeed's sdist builds none of its C++/CUDA ops (its pure-Python code is what is used)
  if ! DS_BUILD_OPS=0 "$py" -m pip install --progress-bar off "$@" >>"$log" 2>&1; then
    echo "oracles: pip install $* failed; the last lines of $log:" >&2
    tail -n 25 "$log" >&2
    return 1
  fi
}

build_venv() {
  local dir=$1 name=$2 start=$SECONDS req
  mapfile -t req < <(requirements "$name")
  rm -rf "${dir:?}/$name"
  "${CKPTOOL_ORACLES_PYTHON:-python3}" -m venv "$dir/$name" || return
  pip_install "$dir/$name/bin/python" "$dir/$name.log" "$TORCH_PIN" &&
    pip_install "$dir/$name/bin/python" "$dir/$name.log" "$TORCH_PIN" "${req[@]}" || return
  echo "oracles: $name built in $((SECONDS - start)) s (${req[*]})" >&2
}

build() {
  local dir=$1 main_py=${2:-} start=$SECONDS name code=0 req
  mkdir -p "$dir" && dir=$(cd "$dir" && pwd) || return 2
  [ -s "$pins" ] || { echo "oracles: $pins is missing" >&2; return 2; }
  local -A pids=()
  for name in $(envs); do
    build_venv "$dir" "$name" &
    pids[$name]=$!
  done
  # the main environment meanwhile: torch first (the pinned CPU wheel), then its line
  mapfile -t req < <(requirements main)
  local py=${main_py:+$main_py/bin/python}
  py=${py:-python3}
  if [ "${#req[@]}" -gt 0 ]; then
    pip_install "$py" "$dir/main.log" "$TORCH_PIN" &&
      pip_install "$py" "$dir/main.log" "$TORCH_PIN" "${req[@]}" || code=1
    [ "$code" -eq 0 ] && echo "oracles: main built in $((SECONDS - start)) s (${req[*]})" >&2
  fi
  for name in "${!pids[@]}"; do
    wait "${pids[$name]}" || { echo "oracles: the $name environment failed" >&2; code=1; }
  done
  cat >"$dir/env.sh" <<ENV
# written by tools/oracles.sh build: the oracles' environments for the tests
export CKPTOOL_MERGEKIT="$dir/mergekit/bin/mergekit-yaml"
export CKPTOOL_MEGATRON_PYTHON="$dir/megatron/bin/python"
export DS_ACCELERATOR=cpu
ENV
  echo "oracles: built in $((SECONDS - start)) s (exit $code); variables in $dir/env.sh" >&2
  return "$code"
}

run_tests() {
  local dir=$1
  shift
  # shellcheck disable=SC1091
  source "$dir/env.sh" || return 2
  local code=0
  (cd "$repo" && python -m pytest -q -p no:cacheprovider --junitxml="$dir/junit.xml" "${ORACLE_TESTS[@]}" "$@") ||
    code=$?
  python "$repo/tools/check_skips.py" "$dir/junit.xml" --allowed "$repo/.ci/allowed-skips.txt" || code=${code/#0/1}
  return "$code"
}

case "${1:-}" in
  build) [ $# -ge 2 ] || { echo "usage: $0 build DIR [MAIN_VENV]" >&2; exit 2; }; build "$2" "${3:-}" ;;
  test) [ $# -ge 2 ] || { echo "usage: $0 test DIR [PYTEST ARGS]" >&2; exit 2; }; d=$2; shift 2; run_tests "$d" "$@" ;;
  *) d=${1:-$repo/.oracles}; build "$d" && run_tests "$d" ;;
esac
