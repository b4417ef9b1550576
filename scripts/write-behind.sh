#!/usr/bin/env bash
# A committer beside a streaming writer, for each --write-behind bound (docs/nbd.md,
# "Write-behind"): fio over NBD, two jobs at once — 4 KiB random writes at QD1 each followed
# by a flush (a commit) and 128 KiB sequential writes of incompressible data at QD8 — then
# the stream alone (incompressible and 2:1) and 4 KiB random writes at QD32 (2:1), against
# one store served by `zdisk serve --write-behind N` in turn, and the mixed jobs against the
# same disk served raw by qemu-nbd --cache=none.
#   usage: bash scripts/write-behind.sh [ROUNDS] [SECS] [DIR] [BOUNDS...]
#   e.g.   bash scripts/write-behind.sh 2 8 /var/tmp/wb 0 8M 4M 2M 1M
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
zdisk=${ZDISK_BIN:-$here/target/release/zdisk}
rounds=${1:-2} secs=${2:-8} dir=${3:-$(mktemp -d /var/tmp/zdisk-write-behind.XXXXXX)}
shift $(( $# < 3 ? $# : 3 ))
bounds=("$@"); [[ ${#bounds[@]} -gt 0 ]] || bounds=(0 8M 4M 2M 1M)
mkdir -p "$dir"
export ZDISK_IDLE_AFTER_MS=0
server=
stop() { [[ -n $server ]] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null; server=; true; }
trap stop EXIT
rm -f "$dir/s.zdisk" "$dir/raw.img"
"$zdisk" format "$dir/s.zdisk" --physical-size 2G --logical-size 2G --preallocate --force >/dev/null 2>&1
fallocate -l 2G "$dir/raw.img"
job() { # NAME PCT RW BS QD FSYNC [OFFSET]: one fio job section
  printf '[%s]\nrw=%s\nbs=%s\niodepth=%s\nfsync=%s\nbuffer_compress_percentage=%s\noffset=%s\n' \
    "$1" "$3" "$4" "$5" "$6" "$2" "${7:-0}"
}
global="[global]
ioengine=nbd
uri=\${URI}
time_based=1
runtime=$secs
buffer_compress_chunk=4096
refill_buffers=1
size=1g"
{ echo "$global"; job commit 50 randwrite 4k 1 1; job stream 0 write 128k 8 0 1g; } >"$dir/mixed.fio"
{ echo "$global"; job stream 0 write 128k 8 0 1g; } >"$dir/stream0.fio"
{ echo "$global"; job stream 50 write 128k 8 0 1g; } >"$dir/stream50.fio"
{ echo "$global"; job rand 50 randwrite 4k 32 0; } >"$dir/rand.fio"
run() { URI="nbd+unix:///?socket=$dir/t.sock" fio "$dir/$1.fio" --output-format=json --output="$dir/o.json" >/dev/null 2>&1; }
summary() { python3 - "$dir/o.json" "$1" <<'PY'
import json, sys
jobs = json.load(open(sys.argv[1]))["jobs"]
w = {j["jobname"]: j["write"] for j in jobs}
if sys.argv[2] == "mixed":
    sync = jobs[0]["sync"]["lat_ns"]
    print(f"commit {w['commit']['iops']:.0f}/s, flush mean {sync['mean'] / 1e3:.0f} us "
          f"p99 {sync['percentile']['99.000000'] / 1e3:.0f} us, stream beside {w['stream']['bw_bytes'] / 1e6:.0f} MB/s", end="")
elif sys.argv[2] == "rand":
    print(f"; 4k random QD32 {w['rand']['iops']:.0f} IOPS", end="")
else:
    print(f"; stream alone {sys.argv[2]} {w['stream']['bw_bytes'] / 1e6:.0f} MB/s", end="")
PY
}
serve() { rm -f "$dir/t.sock"; "$@" & server=$!; for _ in $(seq 100); do [[ -S $dir/t.sock ]] && break; sleep 0.1; done; }
for round in $(seq "$rounds"); do
  for bound in "${bounds[@]}"; do
    serve "$zdisk" serve "$dir/s.zdisk" --unix "$dir/t.sock" --write-behind "$bound" >/dev/null 2>&1
    printf 'round %s, --write-behind %s: ' "$round" "$bound"
    run mixed; summary mixed; run stream0; summary 0%; run stream50; summary 2:1; run rand; summary rand; echo
    stop
  done
  serve qemu-nbd -f raw --cache=none --aio=native -t -e 8 -k "$dir/t.sock" "$dir/raw.img"
  printf 'round %s, raw (qemu-nbd): ' "$round"; run mixed; summary mixed; echo
  stop
done
