#!/usr/bin/env bash
# Native capacity with a block map larger than its cache (issue 48), side by side with the
# whole map cached, in one run: a store formatted at 1x (native capacity) of PHYSICAL bytes,
# filled completely with incompressible data (128K sequential writes, QD32), then
# overwritten twice at QD32 — once the device's size in random 4K writes, once in random
# 64K writes — with offsets uniform or skewed (fio's zoned:80/20:20/80: 80% of the writes
# into a fifth of the device). Each pattern runs with the map cache a sixteenth of the map
# (8 bytes per 4 KiB block) and with the default cache (the whole map). Prints, per run and
# pass: write errors (ENOSPC: must be 0), throughput, write amplification over the pass, and
# the map cache's hit rate.
#   usage: bash scripts/native-map-cache.sh [PHYSICAL=8G] [WORKDIR]
# PATTERNS (default "uniform skewed") and CACHES (default "small whole") choose the runs.
# The issue's size: bash scripts/native-map-cache.sh 64G (about 2 h on this machine).
# Needs a release build (cargo build --release -p zdisk -p zdisk-nbdkit), fio, nbdkit.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
zdisk=${ZDISK_BIN:-$here/target/release/zdisk}
physical=${1:-8G}
dir=${2:-$(mktemp -d /var/tmp/zdisk-native-map.XXXXXX)}
mkdir -p "$dir"
pid=
cleanup() { [[ -n $pid ]] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -f "$dir/s.sock"; }
trap cleanup EXIT
uri="nbd+unix:///?socket=$dir/s.sock"
common=(--ioengine=nbd "--uri=$uri" --buffer_compress_percentage=0 --refill_buffers --randrepeat=0
  --continue_on_error=all --output-format=json)
stat() { "$zdisk" stat "$dir/s.zdisk" --json >"$dir/$1.json"; }

run() { # pattern cache
  local pattern=$1 cache=$2 distribution=() cache_args=()
  [[ $pattern == skewed ]] && distribution=(--random_distribution=zoned:80/20:20/80)
  rm -f "$dir/s.zdisk"
  "$zdisk" format "$dir/s.zdisk" --physical-size "$physical" --logical-size 1x >"$dir/format.log"
  local logical_bytes map_kib
  logical_bytes=$("$zdisk" stat "$dir/s.zdisk" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["provisioned_cap"])')
  map_kib=$((logical_bytes / 4096 * 8 / 1024))
  [[ $cache == small ]] && cache_args=(--map-cache "$((map_kib / 16))K")
  "$zdisk" serve "$dir/s.zdisk" --unix "$dir/s.sock" "${cache_args[@]}" >"$dir/serve-$pattern-$cache.log" 2>&1 & pid=$!
  for _ in $(seq 100); do [[ -S $dir/s.sock ]] && break; sleep 0.1; done
  local started
  started=$(date +%s)
  fio --name=fill "${common[@]}" --rw=write --bs=128k --iodepth=32 >"$dir/fill.json"
  echo "$pattern, map cache ${cache_args[1]:-default} (map $((map_kib / 1024)) MiB, logical $((logical_bytes >> 20)) MiB): filled in $(($(date +%s) - started)) s" >&2
  for bs in 4k 64k; do
    stat before
    fio --name=over "${common[@]}" --rw=randwrite --bs="$bs" --iodepth=32 --io_size="$logical_bytes" \
      --norandommap --random_generator=tausworthe64 "${distribution[@]}" >"$dir/over.json"
    stat after
    python3 - "$dir" "$pattern" "$cache" "$bs" <<'EOF'
import json, sys
d, pattern, cache, bs = sys.argv[1:5]
def fio_json(path):  # fio's nbd engine may print a line before the JSON
    text = open(path).read()
    return json.loads(text[text.index("{"):])
job = fio_json(f"{d}/over.json")["jobs"][0]
b, a = (json.load(open(f"{d}/{n}.json")) for n in ("before", "after"))
delta = lambda k: a[k] - b[k]
wa = delta("backing_write_bytes") / max(delta("host_write_bytes"), 1)
lookups = delta("map_cache_hits") + delta("map_cache_misses")
hit = delta("map_cache_hits") / lookups if lookups else 1.0
errors = job.get("total_err", job.get("error", 0))
print(f"| {pattern} | {cache} | {bs} | {errors} | {job['write']['bw_bytes'] / 1e6:.0f} | {job['write']['iops']:.0f} | {wa:.3f} | {hit:.3f} | {a['segments_free']} |")
EOF
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
}

echo "| pattern | map cache | overwrite bs | write errors | MB/s | IOPS | WA (pass) | map cache hit rate | free segments after |"
echo "|---|---|---|---|---|---|---|---|---|"
for pattern in ${PATTERNS:-uniform skewed}; do
  for cache in ${CACHES:-small whole}; do
    run "$pattern" "$cache"
  done
done
"$zdisk" --version 2>/dev/null || true
