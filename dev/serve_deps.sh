#!/usr/bin/env bash
# dev/serve_deps.sh [DIR] — Debian's libmicrohttpd-dev, libcjson-dev and libcjson1 unpacked into DIR
# (default dev/serve_deps, ignored by git) for building serve_gpt on a machine that cannot install
# packages (the GPU machine): run it here, carry DIR with the tree, and `make serve_gpt` there finds
# the headers and libraries in it (the Makefile's SERVE_DEPS; the binary's rpath points at its
# lib directory for libcjson.so.1). libmicrohttpd is linked from its static archive, which needs the
# target's own libgnutls.so.30 (present on Debian and Ubuntu).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-dev/serve_deps}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download libmicrohttpd-dev libcjson-dev libcjson1 >/dev/null)
rm -rf "$dir"
mkdir -p "$dir"
for deb in "$work"/*.deb; do dpkg -x "$deb" "$dir"; done
echo "serve_deps: $(ls "$work" | tr '\n' ' ')-> $dir ($(du -sh "$dir" | cut -f1))"
