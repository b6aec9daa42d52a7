#!/usr/bin/env bash
# Installs the built library into a temporary prefix, then configures, builds and runs a separate project that
# finds it with find_package(moerail).
set -euo pipefail
build_dir=$1; source_dir=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build_dir" --prefix "$tmp/prefix" >/dev/null
cmake -S "$source_dir/tests/install/consumer" -B "$tmp/build" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/build" >/dev/null
"$tmp/build/consumer"
