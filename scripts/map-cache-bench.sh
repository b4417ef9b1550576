#!/usr/bin/env bash
# A working set larger than the map cache, side by side with the raw disk, in one run:
#   zdisk: a 16 TiB logical store; WS_GIB (default 32) GiB of it filled sequentially with 2:1
#          data, served with a map cache a quarter the size of that working set's map
#          (8 B per 4 KiB block: WS_GIB/2 MiB);
#   raw:   qemu-nbd -f raw --cache=none --aio=native on a RAW_GIB (default 16) GiB file on the
#          same disk, filled the same way (smaller only so both fit; random 4K IOPS of a file
#          on this virtual disk does not depend on its size).
# Then 4K random writes and 4K random reads at QD32 over each working set (fio, nbd engine),
# with zdisk's map-cache hit rate and the map pages' share of backing bytes per phase; then,
# with the server stopped, `zdisk check` of the store against fio's sequential read of the
# same file.
#   usage: bash scripts/map-cache-bench.sh [WORKDIR] [SECONDS_PER_PHASE]
# Needs a release build (cargo build --release -p zdisk -p zdisk-nbdkit), fio, qemu-nbd.
# Disk: about WS_GIB * 0.6 + RAW_GIB GiB free in WORKDIR.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
zdisk=${ZDISK_BIN:-$here/target/release/zdisk}
dir=${1:-$(mktemp -d /var/tmp/zdisk-mapcache.XXXXXX)}
runtime=${2:-60}
ws_gib=${WS_GIB:-32}
raw_gib=${RAW_GIB:-16}
map_cache_mib=$((ws_gib * 2 / 4))
mkdir -p "$dir"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -f "$dir"/*.sock "$dir"/o.json; }
trap cleanup EXIT
rm -f "$dir"/s.zdisk "$dir"/raw.img "$dir"/*.sock
truncate -s "${raw_gib}G" "$dir/raw.img"
"$zdisk" format "$dir/s.zdisk" --physical-size "$((ws_gib * 3 / 4 + 2))G" --logical-size 16T >/dev/null
"$zdisk" serve "$dir/s.zdisk" --unix "$dir/z.sock" --map-cache "${map_cache_mib}M" >"$dir/serve.log" 2>&1 &
pids+=($!)
qemu-nbd -f raw --cache=none --aio=native --persistent --shared=8 --socket="$dir/r.sock" "$dir/raw.img" >"$dir/qemu.log" 2>&1 &
pids+=($!)
for s in z r; do for _ in $(seq 100); do [[ -S $dir/$s.sock ]] && break; sleep 0.1; done; done
sleep 1
uri() { echo "nbd+unix:///?socket=$dir/$1.sock"; }
data=(--buffer_compress_percentage=50 --buffer_compress_chunk=4096 --refill_buffers=1)
size_of() { if [[ $1 == z ]]; then echo "${ws_gib}g"; else echo "${raw_gib}g"; fi; }
fio_iops() { # target rw bs qd time_based
  fio --name=j --ioengine=nbd --uri="$(uri "$1")" --rw="$2" --bs="$3" --iodepth="$4" --size="$(size_of "$1")" \
    ${5:+--time_based=1 --runtime=$runtime} "${data[@]}" --output-format=json --output="$dir/o.json" >/dev/null 2>&1
  python3 - "$dir/o.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
print(f'{j["read"]["iops"] + j["write"]["iops"]:.0f}')
PY
}
stats() { "$zdisk" stat --json "$dir/s.zdisk" >"$dir/$1.json"; }
for s in z r; do
  started=$(date +%s)
  fio_iops "$s" write 128k 32 "" >/dev/null
  echo "filled $s ($(size_of $s)) in $(($(date +%s) - started)) s" >&2
done
sleep 2
echo "zdisk: ${ws_gib} GiB working set of a 16 TiB store, map cache ${map_cache_mib} MiB (a quarter of the working set's map); raw: ${raw_gib} GiB file; fio 4K QD32, ${runtime} s per point"
echo
echo "| workload | zdisk IOPS | raw IOPS | zdisk/raw | map cache hit rate | map pages / backing bytes written |"
echo "|---|---|---|---|---|---|"
for rw in randwrite randread; do
  stats before
  zi=$(fio_iops z "$rw" 4k 32 yes)
  sleep 2
  stats after
  ri=$(fio_iops r "$rw" 4k 32 yes)
  python3 - "$dir/before.json" "$dir/after.json" "$rw" "$zi" "$ri" <<'PY'
import json, sys
b, a = (json.load(open(p)) for p in sys.argv[1:3])
def get(d, k):
    return d.get(k, d.get("stats", {}).get(k, 0))
d = {k: get(a, k) - get(b, k) for k in ("map_cache_hits", "map_cache_misses", "map_write_bytes", "backing_write_bytes")}
lookups = d["map_cache_hits"] + d["map_cache_misses"]
hit = f'{d["map_cache_hits"] / lookups:.3f}' if lookups else "-"
share = f'{d["map_write_bytes"] / d["backing_write_bytes"]:.3f}' if d["backing_write_bytes"] else "-"
rw, zi, ri = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
print(f"| 4K {rw} QD32 | {zi} | {ri} | {zi / ri:.2f}x | {hit} ({lookups} lookups) | {share} |")
PY
done
"$zdisk" stat "$dir/s.zdisk" | sed -n '/map_/p'
kill "${pids[0]}"
wait "${pids[0]}" 2>/dev/null || true
allocated=$(($(stat -c %b "$dir/s.zdisk") * $(stat -c %B "$dir/s.zdisk")))
started=$(date +%s.%N)
"$zdisk" check "$dir/s.zdisk" >/dev/null 2>"$dir/check.log"
check_secs=$(python3 -c "import time; print(f'{time.time() - $started:.1f}')")
fio --name=seq --filename="$dir/s.zdisk" --rw=read --bs=1m --iodepth=16 --ioengine=libaio --direct=1 \
  --time_based=1 --runtime=30 --output-format=json --output="$dir/o.json" >/dev/null 2>&1
python3 - "$dir/o.json" "$allocated" "$check_secs" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
fio_mbs = j["read"]["bw_bytes"] / 1e6
allocated, secs = int(sys.argv[2]), float(sys.argv[3])
check_mbs = allocated / secs / 1e6
print()
print(f"zdisk check: {allocated / 2**30:.1f} GiB allocated in {secs:.1f} s = {check_mbs:.0f} MB/s; "
      f"fio sequential read of the same file (1M, QD16, O_DIRECT): {fio_mbs:.0f} MB/s; check/fio = {check_mbs / fio_mbs:.2f}")
PY
