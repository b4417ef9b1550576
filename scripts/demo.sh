#!/usr/bin/env bash
# The README's first command: on a fresh Debian machine, as root, install what zdisk needs,
# build it (release), and run `zdisk demo`: format a store in a scratch directory, serve it
# over NBD, write a real file tree and a 2:1 compressible fio job through NBD, show
# `zdisk stat`, stop cleanly. Extra arguments go to `zdisk demo` (see `zdisk demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release -p zdisk -p zdisk-nbdkit
target_dir=${CARGO_TARGET_DIR:-target}
exec "$target_dir/release/zdisk" demo "$@"
