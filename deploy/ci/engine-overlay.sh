#!/usr/bin/env bash
# Install (once) packages beside a side environment, without their dependencies, and
# print the directory they are in (to put on PYTHONPATH).
#
#   deploy/ci/engine-overlay.sh NAME     # NAME: a deploy/ci/NAME-overlay.txt exists
#
# The file names its base side environment on a "# base: BASE" line (built by
# deploy/ci/engine-venv.sh BASE) and lists exact pins; they go in with the base's pip,
# `--no-deps --target`, into ${CTXMEM_CACHE:-$HOME/.cache/ctxmem}/overlays/NAME-<hash>,
# the hash being that of the file and the base's interpreter path, so a second run does
# nothing and a changed pin or base builds afresh. A stamp written last marks it
# complete. The base venv itself is left as it is: the other tests of that environment
# never see these packages (nor their entry points).
set -euo pipefail

name=${1:?usage: engine-overlay.sh NAME}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
req=$here/$name-overlay.txt
[ -f "$req" ] || { echo "engine-overlay: no $req" >&2; exit 2; }
base=$(sed -n 's/^# base: *//p' "$req")
[ -n "$base" ] || { echo "engine-overlay: $req names no '# base:'" >&2; exit 2; }
python=$(bash "$here/engine-venv.sh" "$base")

cache=${CTXMEM_CACHE:-$HOME/.cache/ctxmem}
hash=$( (cat "$req"; echo "$python") | sha256sum | cut -c1-12)
dir=$cache/overlays/$name-$hash
stamp=$dir/.ctxmem-complete
mkdir -p "$cache/overlays"

if [ ! -f "$stamp" ]; then
    exec 9>"$dir.lock"
    flock 9
    if [ ! -f "$stamp" ]; then
        echo "engine-overlay: installing $req into $dir" >&2
        rm -rf "$dir"
        "$python" -m pip install -q --no-deps --target "$dir" -r "$req" >&2
        date -u +%FT%TZ > "$stamp"
    fi
fi
echo "$dir"
