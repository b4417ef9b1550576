#!/usr/bin/env bash
# Installs zdisk: the binary, the nbdkit plugin, the man pages and shell completions
# (generated from the command line's own definition), the systemd units and an example
# store configuration.
#   usage: bash scripts/install.sh [--prefix DIR (/usr/local)] [--destdir DIR] [--no-build]
#                                  [--from DIR]
#   --destdir  stage everything under DIR (a package's root, or a scratch root to look at)
#   --no-build install what target/release holds (cargo build --release -p zdisk -p zdisk-nbdkit)
#   --from     take the built zdisk and plugin from DIR instead (implies --no-build)
# Layout under PREFIX: bin/zdisk, lib/zdisk/libnbdkit_zdisk_plugin.so (where `zdisk serve`
# looks, beside ../lib/zdisk of its binary), share/man/man1/zdisk*.1, bash/zsh/fish
# completions under share/; the units go to /etc/systemd/system (lib/systemd/system when
# PREFIX is /usr), /etc/zdisk/example.conf is written unless it exists. Then, for a store
# named db1: copy the example to /etc/zdisk/db1.conf, set STORE, and
# `systemctl enable --now zdisk-serve@db1` (or zdisk-attach@db1).
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=/usr/local destdir="" build=1 from=""
while (($#)); do
  case $1 in
    --prefix) prefix=$2; shift 2 ;;
    --destdir) destdir=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    --from) from=$2; build=0; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
done
target=${from:-${CARGO_TARGET_DIR:-target}/release}
if ((build)); then
  cargo build --release -p zdisk -p zdisk-nbdkit
fi
for built in "$target/zdisk" "$target/libnbdkit_zdisk_plugin.so"; do
  [[ -f $built ]] || { echo "install: $built is missing (build it, or drop --no-build)" >&2; exit 1; }
done
root=$destdir$prefix
unitdir=$destdir/etc/systemd/system
[[ $prefix == /usr ]] && unitdir=$destdir/usr/lib/systemd/system
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$target/zdisk" generate-assets "$scratch" >/dev/null

install -D -m 755 "$target/zdisk" "$root/bin/zdisk"
install -D -m 755 "$target/libnbdkit_zdisk_plugin.so" "$root/lib/zdisk/libnbdkit_zdisk_plugin.so"
install -d "$root/share/man/man1"
install -m 644 "$scratch"/man1/*.1 "$root/share/man/man1/"
install -D -m 644 "$scratch/completions/zdisk.bash" "$root/share/bash-completion/completions/zdisk"
install -D -m 644 "$scratch/completions/_zdisk" "$root/share/zsh/site-functions/_zdisk"
install -D -m 644 "$scratch/completions/zdisk.fish" "$root/share/fish/vendor_completions.d/zdisk.fish"
install -d "$unitdir"
for unit in packaging/systemd/*.service; do
  sed "s|@BINDIR@|$prefix/bin|g" "$unit" >"$unitdir/$(basename "$unit")"
  chmod 644 "$unitdir/$(basename "$unit")"
done
install -d "$destdir/etc/zdisk"
[[ -e $destdir/etc/zdisk/example.conf ]] || install -m 644 packaging/example.conf "$destdir/etc/zdisk/example.conf"
echo "installed zdisk $("$root/bin/zdisk" --version | cut -d' ' -f2) under ${destdir:-/}${destdir:+ }(prefix $prefix): bin, plugin, $(ls "$scratch"/man1 | wc -l) man pages, completions, units in ${unitdir#"$destdir"}"
if [[ -z $destdir ]] && command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
  systemctl daemon-reload
fi
