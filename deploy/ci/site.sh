#!/usr/bin/env bash
# Install (once) a side package directory a client test puts on PYTHONPATH, and print it.
#
#   deploy/ci/site.sh NAME      # NAME: a deploy/ci/NAME-site.txt exists
#
# For clients whose packages must not go into the project venv (a dependency pin that
# conflicts with it, or a large wheel only a few tests need) and need no venv of their
# own: `pip install --target` of the file's exact pins, with the python that runs
# this script (the project venv's when CI calls it), into
# ${CTXMEM_CACHE:-$HOME/.cache/ctxmem}/sites/NAME-<hash of the file>. As in
# engine-venv.sh a stamp written last marks it complete, one build at a time, and a
# changed pin builds a fresh directory beside the old one. Lines of the file under
# "# no-deps:" are installed without their dependencies (the python that uses the
# directory provides them).
set -euo pipefail

name=${1:?usage: site.sh NAME}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
req=$here/$name-site.txt
[ -f "$req" ] || { echo "site: no $req" >&2; exit 2; }
python=${CTXMEM_SITE_PYTHON:-python3}

cache=${CTXMEM_CACHE:-$HOME/.cache/ctxmem}
hash=$(sha256sum "$req" | cut -c1-12)
site=$cache/sites/$name-$hash
stamp=$site/.ctxmem-complete
mkdir -p "$cache/sites"

if [ ! -f "$stamp" ]; then
    exec 9>"$site.lock"
    flock 9
    if [ ! -f "$stamp" ]; then
        echo "site: creating $site" >&2
        rm -rf "$site"
        deps=$(sed -e 's/#.*//' "$req" | xargs)
        if [ -n "$deps" ]; then
            # shellcheck disable=SC2086
            "$python" -m pip install -q --disable-pip-version-check --no-warn-conflicts --target "$site" $deps >&2
        fi
        nodeps=$(sed -n 's/^# no-deps: *//p' "$req")
        if [ -n "$nodeps" ]; then
            # shellcheck disable=SC2086
            "$python" -m pip install -q --disable-pip-version-check --no-warn-conflicts --no-deps \
                --target "$site" $nodeps >&2
        fi
        date -u +%FT%TZ > "$stamp"
    fi
fi
echo "$site"
