#!/usr/bin/env bash
# CPU and latency per 16 KiB random read: zdisk serve against qemu-nbd (raw, --cache=none),
# the same fio job over NBD (unix sockets, no FUSE or loop), QD1 and QD8, in one run.
#   usage: bash scripts/read-cost.sh [WORKDIR] [SECONDS_PER_POINT]
# Needs a release build. SERVE_ARGS adds arguments to `zdisk serve` (e.g. "-t 4"). Server CPU
# per read comes from /proc/PID/stat (user + system) of nbdkit and of qemu-nbd. docs/apps.md.
set -euo pipefail
export ZDISK_IDLE_AFTER_MS=0
here=$(cd "$(dirname "$0")/.." && pwd)
zdisk=${ZDISK_BIN:-$here/target/release/zdisk}
d=${1:-$(mktemp -d /var/tmp/zdisk-read-cost.XXXXXX)}
secs=${2:-10}
mkdir -p "$d"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -f "$d"/*.sock "$d"/o.json; }
trap cleanup EXIT
rm -f "$d/s.zdisk" "$d/raw.img"
truncate -s 2G "$d/raw.img"
"$zdisk" format "$d/s.zdisk" --physical-size 2G --logical-size 2G >/dev/null
# shellcheck disable=SC2086
"$zdisk" serve "$d/s.zdisk" --unix "$d/z.sock" ${SERVE_ARGS:-} >"$d/serve.log" 2>&1 & pids+=($!)
qemu-nbd -f raw --cache=none --aio=native --persistent --shared=8 --socket="$d/r.sock" "$d/raw.img" >"$d/qemu.log" 2>&1 & pids+=($!)
for s in z r; do for _ in $(seq 100); do [[ -S $d/$s.sock ]] && break; sleep 0.1; done; done
uri() { echo "nbd+unix:///?socket=$d/$1.sock"; }
for s in z r; do
  fio --name=fill --ioengine=nbd --uri="$(uri $s)" --rw=write --bs=128k --iodepth=16 --size=1g \
      --buffer_compress_percentage=50 --buffer_compress_chunk=4096 --refill_buffers=1 >/dev/null
done
zpid=$(pgrep -f "nbdkit.*$d/s.zdisk" | head -1)
rpid=$(pgrep -f "qemu-nbd.*$d/raw.img" | head -1)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
printf '%-8s %3s %8s %10s %14s\n' server QD IOPS "mean us" "CPU us/read"
for qd in 1 8; do
  for s in z r; do
    pid=$([[ $s == z ]] && echo "$zpid" || echo "$rpid")
    before=$(cpu_ticks "$pid")
    fio --name=r --ioengine=nbd --uri="$(uri $s)" --rw=randread --bs=16k --iodepth=$qd --size=1g \
        --time_based=1 --runtime="$secs" --output-format=json --output="$d/o.json" >/dev/null
    after=$(cpu_ticks "$pid")
    python3 - "$d/o.json" "$([[ $s == z ]] && echo zdisk || echo qemu-nbd)" "$qd" "$before" "$after" <<'PY'
import json, os, sys
read = json.load(open(sys.argv[1]))["jobs"][0]["read"]
cpu_s = (int(sys.argv[5]) - int(sys.argv[4])) / os.sysconf("SC_CLK_TCK")
print(f"{sys.argv[2]:<8} {sys.argv[3]:>3} {read['iops']:8.0f} {read['lat_ns']['mean'] / 1000:10.0f} "
      f"{1e6 * cpu_s / max(read['total_ios'], 1):14.1f}")
PY
  done
done
