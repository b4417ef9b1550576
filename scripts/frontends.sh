#!/usr/bin/env bash
# zdisk's two front ends side by side with the raw disk (issue 44): the same fio job (nbd
# engine, Unix sockets, 2:1 data) against
#   native  zdisk serve (its own NBD server, the default),
#   nbdkit  zdisk serve --frontend nbdkit,
#   raw     qemu-nbd -f raw --cache=none --aio=native on a file on the same disk,
# each target filled sequentially first; every row runs ROUNDS slices (default 2) with the
# targets taking turns, so the disk's drift falls on all alike. Server CPU per request comes
# from /proc/PID/stat (user + system) of each server process around its slices.
#   usage: bash scripts/frontends.sh [WORKDIR] [SECONDS_PER_ROW] [SIZE]
# Needs a release build (cargo build --release -p zdisk -p zdisk-nbdkit). ZDISK_BIN runs
# another build; ROWS=a,b,... runs only rows whose names contain one of the words.
set -euo pipefail
export ZDISK_IDLE_AFTER_MS=0
here=$(cd "$(dirname "$0")/.." && pwd)
zdisk=${ZDISK_BIN:-$here/target/release/zdisk}
dir=${1:-$(mktemp -d /var/tmp/zdisk-frontends.XXXXXX)}
runtime=${2:-20}
size=${3:-2G}
rounds=${ROUNDS:-2}
slice=$((runtime / rounds))
mkdir -p "$dir"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -f "$dir"/*.sock "$dir"/o.json; }
trap cleanup EXIT
rm -f "$dir"/n.zdisk "$dir"/k.zdisk "$dir"/raw.img "$dir"/*.sock "$dir"/*.pid
truncate -s "$size" "$dir/raw.img"
for t in n k; do "$zdisk" format "$dir/$t.zdisk" --physical-size "$size" --logical-size "$size" >/dev/null; done
"$zdisk" serve "$dir/n.zdisk" --unix "$dir/n.sock" --pid-file "$dir/n.pid" >/dev/null 2>"$dir/serve-n.log" & pids+=($!)
"$zdisk" serve "$dir/k.zdisk" --unix "$dir/k.sock" --pid-file "$dir/k.pid" --frontend nbdkit >/dev/null 2>"$dir/serve-k.log" & pids+=($!)
qemu-nbd -f raw --cache=none --aio=native --persistent --shared=8 --socket="$dir/r.sock" --pid-file="$dir/r.pid" "$dir/raw.img" >"$dir/qemu.log" 2>&1 & pids+=($!)
for t in n k r; do for _ in $(seq 200); do [[ -S $dir/$t.sock && -s $dir/$t.pid ]] && break; sleep 0.1; done; done
uri() { echo "nbd+unix:///?socket=$dir/$1.sock"; }
data=(--buffer_compress_percentage=50 --buffer_compress_chunk=4096 --refill_buffers=1 --size="$size")
cpu_ticks() { awk '{print $14 + $15}' "/proc/$(cat "$dir/$1.pid")/stat"; }
job() { # target rw bs qd [rwmixread] -> "ios iops mean_latency_us cpu_ticks"
  local before after
  before=$(cpu_ticks "$1")
  fio --name=j --ioengine=nbd --uri="$(uri "$1")" --rw="$2" ${5:+--rwmixread=$5} --bs="$3" --iodepth="$4" \
      --time_based=1 --runtime="$slice" "${data[@]}" --output-format=json --output="$dir/o.json" >/dev/null 2>&1
  after=$(cpu_ticks "$1")
  python3 - "$dir/o.json" "$((after - before))" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
ios = j["read"]["total_ios"] + j["write"]["total_ios"]
side = j["write"] if j["write"]["iops"] > 0 and j["read"]["iops"] == 0 else j["read"]
print(f'{ios} {j["read"]["iops"] + j["write"]["iops"]:.0f} {side["lat_ns"]["mean"] / 1000:.0f} {sys.argv[2]}')
PY
}
for t in n k r; do
  fio --name=fill --ioengine=nbd --uri="$(uri $t)" --rw=write --bs=128k --iodepth=32 "${data[@]}" >/dev/null 2>&1
done
tick_us=$((1000000 / $(getconf CLK_TCK)))
echo "| job | native IOPS | nbdkit IOPS | raw IOPS | native/raw | nbdkit/raw | mean lat µs native / nbdkit / raw | server CPU µs per I/O native / nbdkit / raw |"
echo "|---|---|---|---|---|---|---|---|"
row() { # name rw bs qd [mix]
  if [[ -n ${ROWS:-} ]]; then
    local wanted=0 word
    IFS=, read -ra words <<<"$ROWS"
    for word in "${words[@]}"; do [[ $1 == *"$word"* ]] && wanted=1; done
    ((wanted)) || return 0
  fi
  declare -A ios=() iops=() lat=() cpu=()
  local round t n i l c
  for round in $(seq "$rounds"); do
    for t in n k r; do
      read -r n i l c < <(job "$t" "$2" "$3" "$4" "${5:-}")
      ios[$t]=$((${ios[$t]:-0} + n)) iops[$t]=$((${iops[$t]:-0} + i)) lat[$t]=$((${lat[$t]:-0} + l))
      cpu[$t]=$((${cpu[$t]:-0} + c))
    done
  done
  python3 - "$1" "$rounds" "$tick_us" "${ios[n]}" "${ios[k]}" "${ios[r]}" "${iops[n]}" "${iops[k]}" "${iops[r]}" \
    "${lat[n]}" "${lat[k]}" "${lat[r]}" "${cpu[n]}" "${cpu[k]}" "${cpu[r]}" <<'PY'
import sys
name, rounds, tick = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ios, iops, lat, cpu = [list(map(int, sys.argv[i:i + 3])) for i in (4, 7, 10, 13)]
iops = [x / rounds for x in iops]; lat = [x / rounds for x in lat]
per = [c * tick / max(n, 1) for c, n in zip(cpu, ios)]
print(f"| {name} | {iops[0]:.0f} | {iops[1]:.0f} | {iops[2]:.0f} | {iops[0] / iops[2]:.2f} | {iops[1] / iops[2]:.2f} "
      f"| {lat[0]:.0f} / {lat[1]:.0f} / {lat[2]:.0f} | {per[0]:.1f} / {per[1]:.1f} / {per[2]:.1f} |")
PY
}
row "4K random read QD32" randread 4k 32
row "4K random read QD1" randread 4k 1
row "4K 70/30 QD32" randrw 4k 32 70
row "8K 66/33 QD32 (OLTP)" randrw 8k 32 66
row "4K random write QD32" randwrite 4k 32
row "128K sequential read QD8" read 128k 8
row "128K sequential write QD8" write 128k 8
