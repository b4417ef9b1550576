#!/usr/bin/env bash
# Performance consistency at native capacity (seed 004's test, issue 15): a store formatted at
# 1x with an over-provisioning, filled completely with incompressible data (128K sequential
# writes), then 4K random writes at QD32 across every LBA for SECONDS, IOPS logged per second.
# Prints mean IOPS, the worst second as a share of the mean, and the p50/p99.9/max write
# latency, over the last two thirds of the run (the first third reaches steady state).
#   usage: bash scripts/consistency.sh [PHYSICAL=1G] [OP_PERCENT=10] [SECONDS=90] [WORKDIR]
# CONSISTENCY_TARGET=raw runs the same job against a raw file served by qemu-nbd --cache=none;
# CONSISTENCY_TARGET=memory against nbdkit's memory plugin with zdisk's thread count (8): the
# transport's own tail, with no storage behind it.
# ZDISK_SERVE_ARGS adds options to `zdisk serve` (e.g. "--threads 4"); CONSISTENCY_FIO_ARGS to
# the steady-state fio job (e.g. "--rate_iops=30000", the same writes below saturation).
# CONSISTENCY_RANDOMMAP=1 writes the LBAs as fio's default random map does (each once a pass).
# Needs a release build (cargo build --release -p zdisk -p zdisk-nbdkit), fio, nbdkit.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
zdisk=${ZDISK_BIN:-$here/target/release/zdisk}
physical=${1:-1G}
op=${2:-10}
seconds=${3:-90}
dir=${4:-$(mktemp -d /var/tmp/zdisk-consistency.XXXXXX)}
mkdir -p "$dir"
pid=
cleanup() { [[ -n $pid ]] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -f "$dir/s.sock"; }
trap cleanup EXIT
if [[ ${CONSISTENCY_TARGET:-zdisk} == raw ]]; then
  # The baseline: the same job against a raw file of PHYSICAL bytes on the same disk.
  rm -f "$dir/raw.img"; truncate -s "$physical" "$dir/raw.img"; op=raw
  qemu-nbd -f raw --cache=none --aio=native --persistent --shared=8 -k "$dir/s.sock" "$dir/raw.img" \
    >"$dir/serve.log" 2>&1 & pid=$!
elif [[ ${CONSISTENCY_TARGET:-zdisk} == memory ]]; then
  op=memory
  nbdkit --foreground -t 8 -U "$dir/s.sock" memory "$physical" >"$dir/serve.log" 2>&1 & pid=$!
else
  "$zdisk" format "$dir/s.zdisk" --physical-size "$physical" --over-provision "$op" --force | grep -E "native|over-provision"
  "$zdisk" serve "$dir/s.zdisk" --unix "$dir/s.sock" ${ZDISK_SERVE_ARGS:-} >"$dir/serve.log" 2>&1 & pid=$!
fi
for _ in $(seq 100); do [[ -S $dir/s.sock ]] && break; sleep 0.1; done
uri="nbd+unix:///?socket=$dir/s.sock"
common=(--ioengine=nbd "--uri=$uri" --buffer_compress_percentage=0 --refill_buffers --randrepeat=0)
# Offsets drawn independently, with replacement (as Iometer draws them in seed 004's test, and
# as `zdisk bench` runs every random job): fio's default random map instead writes each block
# once per pass over the device, a permutation whose passes make GC's yield rise and fall
# with the pass (docs/space.md, "Why fio's random map makes waves"). CONSISTENCY_RANDOMMAP=1
# keeps fio's default.
steady_order=(--norandommap --random_generator=tausworthe64)
[[ ${CONSISTENCY_RANDOMMAP:-0} == 1 ]] && steady_order=()
fio --name=fill "${common[@]}" --rw=write --bs=128k --iodepth=32 --output-format=json >"$dir/fill.json"
rm -f "$dir"/iops*.log
fio --name=steady "${common[@]}" "${steady_order[@]}" --rw=randwrite --bs=4k --iodepth=32 --time_based --runtime="$seconds" \
  ${CONSISTENCY_FIO_ARGS:-} --write_iops_log="$dir/iops" --log_avg_msec=1000 --percentile_list=50:99:99.9 \
  --output-format=json >"$dir/steady.json"
[[ $op == raw || $op == memory ]] && echo '{}' >"$dir/stat.json" || "$zdisk" stat "$dir/s.zdisk" --json >"$dir/stat.json" 2>/dev/null || true
python3 - "$dir" "$op" <<'EOF'
import glob, json, sys
d, op = sys.argv[1], sys.argv[2]
iops = [int(l.split(",")[1]) for f in glob.glob(f"{d}/iops*.log") for l in open(f) if l.strip()]
steady = iops[len(iops) // 3:]
mean = sum(steady) / len(steady)
def fio_json(path):  # fio's nbd engine prints a line before the JSON
    text = open(path).read()
    return json.loads(text[text.index("{"):])
job = fio_json(f"{d}/steady.json")["jobs"][0]["write"]
p = job["clat_ns"]["percentile"]
p50, p999 = p["50.000000"] / 1e6, p["99.900000"] / 1e6
stat = json.load(open(f"{d}/stat.json"))
print(f"| {op if op in ('raw', 'memory') else op + '%'} | {len(steady)} | {mean:.0f} | {min(steady) / mean:.2f} | {p50:.2f} | {p999:.2f} | {p999 / p50:.1f} | {job['clat_ns']['max'] / 1e6:.0f} | {stat.get('write_amplification', 0):.2f} |")
EOF
