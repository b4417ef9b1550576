#!/usr/bin/env bash
# Side-by-side speed check for the serving issue: the same fio job (nbd engine, unix sockets,
# 2:1 data: buffer_compress_percentage=50, buffer_compress_chunk=4096) against
#   zdisk  (zdisk serve: its default front end, O_DIRECT),
#   raw    (qemu-nbd -f raw --cache=none --aio=native on a file on the same disk),
#   memory (nbdkit memory: the transport ceiling),
# 4 GiB targets, all three filled sequentially first, in one run.
#   usage: bash scripts/compare.sh [WORKDIR] [SECONDS_PER_POINT]
# Needs a release build (cargo build --release -p zdisk -p zdisk-nbdkit). Prints a table.
# ZDISK_BIN runs another build of zdisk (its plugin must sit next to it), to compare builds
# side by side. ZDISK_FORMAT_ARGS adds arguments to `zdisk format` (e.g. "--codec zstd:1");
# ZDISK_SERVE_ARGS adds arguments to `zdisk serve` (e.g. "-t 32"); ROWS=a,b,... runs only
# the rows whose names contain one of those words (e.g. ROWS="random read,70/30").
# ENCRYPTED=1 adds a fourth target, the same store formatted --encrypt (a key file), and the
# columns "encrypted IOPS" and "encrypted/zdisk"; the stat at the end then shows both
# stores' comp_ratio (issue 17's side-by-side check).
# BEFORE_BIN=/path/to/other/zdisk adds a target served by that build (an older commit's, its
# plugin beside it) with the same format and serve arguments, and the columns "before IOPS"
# and "zdisk/before": two builds side by side, taking turns with ROUNDS (a refactor's check).
# COMPRESS_PERCENT=0 writes incompressible data instead of fio's 2:1 (50, the default); a
# 4 GiB store cannot hold 4 GiB of it, so give zdisk's backing room: ZDISK_PHYSICAL=5G
# (default 4G; the logical size stays 4 GiB, raw's image 4 GiB).
# Idle work (docs/space.md, "Idle work") is off unless ZDISK_IDLE_AFTER_MS is set: several
# servers run at once here, and one store's idle recompression would take the cores while
# another target is measured (it did: encrypted/zdisk 1.36 on reads and 1.62 on 128K writes,
# plain zdisk 0.70x raw, with both zdisk stores recompressing in turn).
set -euo pipefail
export ZDISK_IDLE_AFTER_MS=${ZDISK_IDLE_AFTER_MS:-0}
here=$(cd "$(dirname "$0")/.." && pwd)
zdisk=${ZDISK_BIN:-$here/target/release/zdisk}
dir=${1:-$(mktemp -d /var/tmp/zdisk-compare.XXXXXX)}
runtime=${2:-15}
# ROUNDS=N splits each point into N slices of SECONDS_PER_POINT/N, the targets taking turns
# (default 1: each target's whole run after the other's). This VM's disk drifts within a
# minute; with ROUNDS=4 every target sees the same drift, and the ratios steady.
rounds=${ROUNDS:-1}
slice=$((runtime / rounds))
mkdir -p "$dir"
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -f "$dir"/*.sock "$dir"/o.json; }
pids=()
trap cleanup EXIT
rm -f "$dir"/s.zdisk "$dir"/e.zdisk "$dir"/b.zdisk "$dir"/raw.img "$dir"/*.sock
truncate -s 4G "$dir/raw.img"
# shellcheck disable=SC2086
"$zdisk" format "$dir/s.zdisk" --physical-size "${ZDISK_PHYSICAL:-4G}" --logical-size 4G ${ZDISK_FORMAT_ARGS:-} >/dev/null
# shellcheck disable=SC2086
"$zdisk" serve "$dir/s.zdisk" --unix "$dir/z.sock" ${ZDISK_SERVE_ARGS:-} >"$dir/serve.log" 2>&1 & pids+=($!)
targets=(z r m)
if [[ -n ${ENCRYPTED:-} ]]; then
  head -c 32 /dev/urandom >"$dir/key"
  # shellcheck disable=SC2086
  "$zdisk" format "$dir/e.zdisk" --physical-size 4G --logical-size 4G --encrypt --key-file "$dir/key" \
    ${ZDISK_FORMAT_ARGS:-} >/dev/null
  # shellcheck disable=SC2086
  "$zdisk" serve "$dir/e.zdisk" --unix "$dir/e.sock" --key-file "$dir/key" ${ZDISK_SERVE_ARGS:-} \
    >"$dir/serve-e.log" 2>&1 & pids+=($!)
  targets+=(e)
fi
if [[ -n ${BEFORE_BIN:-} ]]; then
  # shellcheck disable=SC2086
  "$BEFORE_BIN" format "$dir/b.zdisk" --physical-size "${ZDISK_PHYSICAL:-4G}" --logical-size 4G ${ZDISK_FORMAT_ARGS:-} >/dev/null
  # shellcheck disable=SC2086
  "$BEFORE_BIN" serve "$dir/b.zdisk" --unix "$dir/b.sock" ${ZDISK_SERVE_ARGS:-} >"$dir/serve-b.log" 2>&1 & pids+=($!)
  targets+=(b)
fi
qemu-nbd -f raw --cache=none --aio=native --persistent --shared=8 --socket="$dir/r.sock" "$dir/raw.img" >"$dir/qemu.log" 2>&1 & pids+=($!)
nbdkit --foreground -U "$dir/m.sock" memory 4G & pids+=($!)
for s in "${targets[@]}"; do for _ in $(seq 100); do [[ -S $dir/$s.sock ]] && break; sleep 0.1; done; done
sleep 1
uri() { echo "nbd+unix:///?socket=$dir/$1.sock"; }
data=(--buffer_compress_percentage="${COMPRESS_PERCENT:-50}" --buffer_compress_chunk=4096 --refill_buffers=1 --size=4g)
job() { # target rw bs qd [rwmixread] -> "iops mean_latency_us"
  fio --name=j --ioengine=nbd --uri="$(uri "$1")" --rw="$2" ${5:+--rwmixread=$5} --bs="$3" --iodepth="$4" \
      --time_based=1 --runtime="$slice" "${data[@]}" --output-format=json --output="$dir/o.json" >/dev/null 2>&1
  python3 - "$dir/o.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
side = j["write"] if j["write"]["iops"] > 0 else j["read"]
print(f'{j["read"]["iops"] + j["write"]["iops"]:.0f} {side["lat_ns"]["mean"] / 1000:.0f}')
PY
}
for s in "${targets[@]}"; do
  # A failed fill (a server that did not start, a full disk under it) says so, with the
  # server's log, instead of ending the run without a word.
  fio --name=fill --ioengine=nbd --uri="$(uri "$s")" --rw=write --bs=128k --iodepth=32 "${data[@]}" \
    >"$dir/fill.log" 2>&1 || {
    echo "compare.sh: filling target $s failed (disk: $(df -h --output=avail "$dir" | tail -1 | tr -d ' ') free):" >&2
    grep -iE 'error|err=' "$dir/fill.log" | tail -3 >&2 || tail -5 "$dir/fill.log" >&2
    for log in "$dir"/serve*.log "$dir"/qemu.log; do [[ -s $log ]] && { echo "--- $log" >&2; tail -5 "$log" >&2; }; done
    exit 1
  }
done
header="| workload | zdisk IOPS | raw IOPS | memory IOPS | zdisk/raw | zdisk/memory | mean lat µs zdisk / raw |"
rule="|---|---|---|---|---|---|---|"
[[ -n ${ENCRYPTED:-} ]] && header+=" encrypted IOPS | encrypted/zdisk |" rule+="---|---|"
[[ -n ${BEFORE_BIN:-} ]] && header+=" before IOPS | zdisk/before |" rule+="---|---|"
echo "$header"
echo "$rule"
row() { # name rw bs qd [mix]
  if [[ -n ${ROWS:-} ]]; then
    local wanted=0 word
    IFS=, read -ra words <<<"$ROWS"
    for word in "${words[@]}"; do [[ $1 == *"$word"* ]] && wanted=1; done
    ((wanted)) || return 0
  fi
  # Each target runs ROUNDS slices, the targets taking turns, so that the disk's drift over
  # the row falls on all of them alike; IOPS and latency are the means over the slices.
  local targets_now=(z r m) t round i l
  [[ -n ${ENCRYPTED:-} ]] && targets_now+=(e)
  [[ -n ${BEFORE_BIN:-} ]] && targets_now+=(b)
  declare -A iops=() lat=()
  for round in $(seq "$rounds"); do
    for t in "${targets_now[@]}"; do
      read -r i l < <(job "$t" "$2" "$3" "$4" "${5:-}")
      iops[$t]=$((${iops[$t]:-0} + i)) lat[$t]=$((${lat[$t]:-0} + l))
    done
  done
  local zi=$((iops[z] / rounds)) zl=$((lat[z] / rounds)) ri=$((iops[r] / rounds)) rl=$((lat[r] / rounds))
  local mi=$((iops[m] / rounds))
  local extra=""
  if [[ -n ${ENCRYPTED:-} ]]; then
    local ei=$((iops[e] / rounds))
    extra=$(python3 -c "print(f' $ei | {$ei/$zi:.2f} |')")
  fi
  if [[ -n ${BEFORE_BIN:-} ]]; then
    local bi=$((iops[b] / rounds))
    extra+=$(python3 -c "print(f' $bi | {$zi/$bi:.2f} |')")
  fi
  python3 -c "print(f'| $1 | $zi | $ri | $mi | {$zi/$ri:.2f}x | {$zi/$mi:.2f} | $zl / $rl |$extra')"
}
row "4K random read QD32 (sequentially filled)" randread 4k 32
row "128K seq read QD32 (sequentially filled)" read 128k 32
row "128K seq read QD1 (sequentially filled)" read 128k 1
row "4K random write QD32" randwrite 4k 32
row "4K 70/30 QD32" randrw 4k 32 70
row "128K seq write QD32" write 128k 32
row "4K random write QD1" randwrite 4k 1
row "4K random read QD32 (after random writes)" randread 4k 32
row "128K seq read QD32 (after random writes)" read 128k 32
row "128K seq read QD1 (after random writes)" read 128k 1
"$zdisk" stat "$dir/s.zdisk"
if [[ -n ${ENCRYPTED:-} ]]; then "$zdisk" stat "$dir/e.zdisk"; fi
