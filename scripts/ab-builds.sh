#!/usr/bin/env bash
# Two builds of zdisk side by side on the same stores: each round serves every store with
# the first build, then with the second, one fio slice of SECS seconds each (measured by
# `scripts/interleave.sh`), so that this VM's drifting disk speed and the stores' own state
# (free space, GC) fall on both alike. Prints each slice's IOPS and the server's CPU time
# per request, named BUILD-STORE.
#   usage: bash scripts/ab-builds.sh OLD_ZDISK NEW_ZDISK ROUNDS SECS RW BS STORE[:KEYFILE]...
#   e.g.   bash scripts/ab-builds.sh /tmp/base/release/zdisk target/release/zdisk 4 8 randwrite 4k \
#            /work/prof/enc/s.zdisk /work/prof/enc/e.zdisk:/work/prof/enc/key
# Fill the stores first (2:1 data over 4 GiB of offsets, as `scripts/compare.sh` does).
# Idle work is off while serving (ZDISK_IDLE_AFTER_MS=0), as `scripts/interleave.sh` asks.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
old=$1 new=$2 rounds=$3 secs=$4 rw=$5 bs=$6
shift 6
dir=$(mktemp -d /tmp/zdisk-ab.XXXXXX)
server=
stop() { [[ -n $server ]] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null; server=; true; }
trap 'stop; rm -rf "$dir"' EXIT
for round in $(seq "$rounds"); do
  echo "round $round"
  for build in old new; do
    bin=$old; [[ $build == new ]] && bin=$new
    for spec in "$@"; do
      store=${spec%%:*} key=; [[ $spec == *:* ]] && key=${spec#*:}
      name=$build-$(basename "$store" .zdisk)
      ZDISK_IDLE_AFTER_MS=0 "$bin" serve "$store" ${key:+--key-file "$key"} --unix "$dir/$name.sock" >/dev/null 2>&1 &
      server=$!
      for _ in $(seq 100); do [[ -S $dir/$name.sock ]] && break; sleep 0.1; done
      bash "$here/interleave.sh" "$dir" "$rw" "$bs" 1 "$secs" "$name" | sed 's/^round 1 /  /'
      stop
      while pgrep -f "nbdkit.*-U $dir/$name.sock " >/dev/null; do sleep 0.1; done
    done
  done
done
