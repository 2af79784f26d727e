#!/usr/bin/env bash
# The two set-up-and-run commands of the README:
#   bash dev.sh demo        the main job: a demo on a small dataset it generates itself
#   bash dev.sh test [ARGS] the test suite (ARGS go to pytest)
# Each creates ./.venv when it is missing (or when requirements changed) with the pinned,
# CPU-only torch the tests run with, so a fresh machine needs nothing but python3 and pip.
set -euo pipefail
cd "$(dirname "$0")"

venv=${FASTLOAD_VENV:-.venv}
py=${PYTHON:-python3}
torch_version=2.13.0
stamp="$venv/.fastload-setup"
want=$(cat pyproject.toml requirements/test.txt fastload/_collate/_native.c \
    fastload/_sampling/_binpack.c | cksum)

setup() {
    echo "dev.sh: creating $venv (one time; about a minute)" >&2
    "$py" -m venv "$venv"
    local pip="$venv/bin/python -m pip --disable-pip-version-check -q"
    # torch first and on its own: the wheel on this machine's disk when there is one, else the
    # CPU build from PyTorch's own index, never PyPI's multi-GB CUDA build.
    if ! $pip install --no-deps --no-index "torch==$torch_version" 2>/dev/null; then
        $pip install --no-deps "torch==$torch_version" --index-url https://download.pytorch.org/whl/cpu
    fi
    # A distribution named "fastload" is this project under its old name, or the unrelated
    # project of that name on the package index: either would also provide `import fastload`.
    $pip uninstall -y fastload 2>/dev/null || true
    $pip install -r requirements/test.txt
    echo "$want" > "$stamp"
}

if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    setup
fi

cmd=${1:-}
shift || true
case "$cmd" in
    demo) exec "$venv/bin/fastload" demo "$@" ;;
    test)
        # Bytecode for our own sources, written here once: where PYTHONDONTWRITEBYTECODE is set
        # (as on the CI machines) every process the suite starts (CLI runs, spawned workers,
        # gloo ranks) would otherwise compile fastload from source again, 0.4 s each.
        "$venv/bin/python" -m compileall -q -j 0 fastload tests benchmarks scripts >/dev/null
        exec "$venv/bin/python" -m pytest "$@" ;;
    *) echo "usage: bash dev.sh demo|test [args]" >&2; exit 2 ;;
esac
