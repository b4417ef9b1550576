#!/usr/bin/env bash
# The README's second command, and exactly what CI runs (after installing packages):
# formatting, lints, and every test of the workspace in release mode — engine model and
# crash tests, CLI tests, and the interop tests that drive a real nbdkit with the zdisk
# plugin through nbdinfo, nbdcopy, qemu-img, fio, ext4 on nbdfuse+loop and a raw NBD client.
#
# Interop tests skip when a tool is missing, except under CI=true, where they fail. The
# filesystem test needs root (mkfs, mount, losetup). `cargo test` builds the plugin .so
# itself (it is a dev-dependency of the CLI crate).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $(id -u) -eq 0 ]]; then
  bash scripts/setup.sh --all
fi
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace --profile ci
