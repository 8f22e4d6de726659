#!/usr/bin/env bash
# Print a directory holding `valkey-server`, for the Valkey variants of the pod index tests
# (tests/pod: the index_exe fixture); exit 1 (saying why on stderr) when there is none.
#
# Installed already (Debian 13 has valkey-server in main): its directory. On Debian 12
# the package is in bookworm-backports: valkey-tools (the server binary; valkey-server is a
# link to it, as the valkey-server package makes) is fetched through a private apt
# configuration (source list and lists under $CTXMEM_CACHE/valkey/apt, no root needed)
# and extracted under $CTXMEM_CACHE/valkey; the host's apt sources stay as they are, and
# no daemon is installed or started. Its libraries (jemalloc, lzf, OpenSSL) are those
# redis-server already pulled in.
set -euo pipefail
if exe=$(command -v valkey-server); then
  dirname "$exe"
  exit 0
fi
dir=${CTXMEM_CACHE:-$HOME/.cache/ctxmem}/valkey
if [ ! -x "$dir/usr/bin/valkey-server" ]; then
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  if [ "$codename" != bookworm ]; then
    echo "valkey.sh: valkey-server is not installed and this is not Debian 12 ($codename):" \
         "install it with apt where the release has it" >&2
    exit 1
  fi
  bpo=$dir/apt
  mkdir -p "$bpo/lists/partial" "$bpo/cache/archives/partial"
  printf '%s\n' "Types: deb" "URIs: http://deb.debian.org/debian" "Suites: bookworm-backports" \
    "Components: main" "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" \
    > "$bpo/backports.sources"
  opts=(-o "Dir::Etc::SourceList=$bpo/backports.sources" -o Dir::Etc::SourceParts=/nonexistent
        -o "Dir::State::Lists=$bpo/lists" -o "Dir::Cache=$bpo/cache")
  apt-get "${opts[@]}" update -q >&2
  (cd "$bpo" && rm -f valkey-tools_*.deb && apt-get "${opts[@]}" download valkey-tools >&2)
  dpkg-deb -x "$bpo"/valkey-tools_*.deb "$dir"
  ln -sf valkey-check-rdb "$dir/usr/bin/valkey-server"
fi
"$dir/usr/bin/valkey-server" --version >&2
echo "$dir/usr/bin"
