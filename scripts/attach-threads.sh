#!/usr/bin/env bash
# Server threads per connection through the attach transport: fio on loop devices over
# nbdfuse (the stack `zdisk attach --fuse` builds), a zdisk store against a raw file behind
# `qemu-nbd --cache=none --aio=native`, the same nbdfuse options for both. Each CONFIG is
# "THREADS:CONNECTIONS" (zdisk serve --threads, nbdfuse -C); the configs take turns for
# ROUNDS rounds, so this VM's drifting disk falls on all alike. docs/nbd.md, "Threads".
#   usage: bash scripts/attach-threads.sh [DIR] [SECS] [ROUNDS] [CONFIG...]
#   e.g.   bash scripts/attach-threads.sh /var/tmp/at 6 2 8:4 1:8
# 2 GiB targets, 1 GiB of 2:1 data written first (the store --preallocate). Jobs (JOBS to
# change them): 16 KiB random reads at QD1 and QD16, 16 KiB random writes each followed by
# fdatasync (a commit), 16 KiB random reads and writes at QD16. Per job: IOPS, mean
# latency, and the CPU per I/O of the storage server (nbdkit or qemu-nbd) and of nbdfuse.
set -euo pipefail
export ZDISK_IDLE_AFTER_MS=0
here=$(cd "$(dirname "$0")/.." && pwd)
zdisk=${ZDISK_BIN:-$here/target/release/zdisk}
d=${1:-$(mktemp -d /var/tmp/zdisk-attach-threads.XXXXXX)}
secs=${2:-6}
rounds=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
configs=("$@")
[[ ${#configs[@]} -gt 0 ]] || configs=(8:4 1:8)
jobs=${JOBS:-"rr1:--rw=randread:--iodepth=1 rr16:--rw=randread:--iodepth=16 commit:--rw=randwrite:--iodepth=1:--fdatasync=1 rw16:--rw=randrw:--iodepth=16:--fdatasync=8"}
for tool in nbdfuse losetup fio qemu-nbd fusermount3; do
  command -v "$tool" >/dev/null || { echo "attach-threads.sh: $tool is missing" >&2; exit 1; }
done
mkdir -p "$d"

stack_pids=()
loops=()
teardown() {
  for l in "${loops[@]}"; do losetup -d "$l" 2>/dev/null || true; done
  for m in "$d/fz" "$d/fr"; do mountpoint -q "$m" && fusermount3 -u "$m"; done
  sleep 1
  kill "${stack_pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  stack_pids=(); loops=()
}
trap teardown EXIT

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# One config: both targets built fresh, filled, then every job on each in turn.
run_config() {
  local threads=$1 connections=$2
  rm -rf "${d:?}"/{fz,fr,s.zdisk,raw.img,*.sock,*.pid}
  truncate -s 2G "$d/raw.img"
  "$zdisk" format "$d/s.zdisk" --physical-size 2G --logical-size 2G --preallocate >/dev/null 2>&1
  "$zdisk" serve "$d/s.zdisk" --unix "$d/z.sock" --threads "$threads" >"$d/serve.log" 2>&1 &
  stack_pids+=($!)
  qemu-nbd -f raw --cache=none --aio=native -t -e 64 -k "$d/r.sock" "$d/raw.img" >"$d/qemu.log" 2>&1 &
  stack_pids+=($!)
  local qemu=$!
  for s in z r; do for _ in $(seq 100); do [[ -S $d/$s.sock ]] && break; sleep 0.1; done; done
  mkdir -p "$d/fz" "$d/fr"
  for s in z r; do
    nbdfuse -C "$connections" -P "$d/f$s.pid" "$d/f$s/nbd" "nbd+unix:///?socket=$d/$s.sock" &
    for _ in $(seq 100); do [[ -s $d/f$s.pid ]] && break; sleep 0.1; done
  done
  local lz lr
  lz=$(losetup --direct-io=on -f --show "$d/fz/nbd"); loops+=("$lz")
  lr=$(losetup --direct-io=on -f --show "$d/fr/nbd"); loops+=("$lr")
  for l in "$lz" "$lr"; do
    fio --name=fill --filename="$l" --direct=1 --ioengine=libaio --rw=write --bs=128k --iodepth=16 --size=1g \
        --buffer_compress_percentage=50 --buffer_compress_chunk=4096 --refill_buffers=1 >/dev/null
  done
  local server_z
  server_z=$(pgrep -f "nbdkit.*$d/s.zdisk" | head -1)
  for job in $jobs; do
    local name=${job%%:*} args=${job#*:}
    args=${args//:/ }
    for s in z r; do
      local dev=$lr server=$qemu fuse
      [[ $s == z ]] && { dev=$lz; server=$server_z; }
      fuse=$(cat "$d/f$s.pid")
      local b fb a fa
      b=$(cpu_ticks "$server"); fb=$(cpu_ticks "$fuse")
      # shellcheck disable=SC2086
      fio --name=j --filename="$dev" --direct=1 --ioengine=libaio --bs=16k $args --size=1g \
          --buffer_compress_percentage=50 --buffer_compress_chunk=4096 --refill_buffers=1 \
          --time_based=1 --runtime="$secs" --output-format=json --output="$d/o.json" >/dev/null
      a=$(cpu_ticks "$server"); fa=$(cpu_ticks "$fuse")
      python3 - "$d/o.json" "$([[ $s == z ]] && echo zdisk || echo raw)" "$threads:$connections" "$name" \
          "$b" "$a" "$fb" "$fa" <<'PY'
import json, os, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
ios = max(j["read"]["total_ios"] + j["write"]["total_ios"], 1)
iops = j["read"]["iops"] + j["write"]["iops"]
lat = max(j["read"]["lat_ns"]["mean"], j["write"]["lat_ns"]["mean"]) / 1000
tick = os.sysconf("SC_CLK_TCK")
server = 1e6 * (int(sys.argv[6]) - int(sys.argv[5])) / tick / ios
fuse = 1e6 * (int(sys.argv[8]) - int(sys.argv[7])) / tick / ios
print(f"{sys.argv[2]:<6} {sys.argv[3]:>6} {sys.argv[4]:<7} {iops:8.0f} {lat:9.0f} {server:11.1f} {fuse:11.1f}")
PY
    done
  done
  teardown
}

printf '%-6s %6s %-7s %8s %9s %11s %11s\n' target t:C job IOPS "mean us" "server us" "nbdfuse us"
for round in $(seq "$rounds"); do
  echo "# round $round"
  for config in "${configs[@]}"; do
    run_config "${config%%:*}" "${config##*:}"
  done
done
