#!/usr/bin/env bash
# What a request costs the server, builds and raw qemu-nbd taking turns: each round, each
# TARGET on a fresh 4 GiB store (or raw image) in DIR with 1 GiB written first, then one fio
# job through NBD (nbd engine, unix socket). Per target and round it prints IOPS, the
# server's CPU per request (/proc/PID/stat, all its threads), context switches per request
# (summed over /proc/PID/task/*/status), futex calls per request (`perf stat`, when perf is
# installed) and the machine's idle share during the job. Written for issue 45's hand-off
# work (docs/nbd.md, "A pass's small writes are shared a batch per worker"): the context
# switches and futex calls per request move far less from run to run than IOPS or CPU time.
#   usage: bash scripts/server-cost.sh DIR ROUNDS TARGET...
#          TARGET: a zdisk binary (served by `zdisk serve`, its native front end) or `raw`
#   e.g.   bash scripts/fast-disk.sh up /mnt/fast 14G
#          bash scripts/server-cost.sh /mnt/fast/cost 3 /tmp/old/zdisk target/release/zdisk raw
# Environment: RW (randwrite), BS (4k), QD (32), SECS (8), COMPRESS_PERCENT (50: fio's 2:1
# data; 0: incompressible), ZDISK_PHYSICAL (4G), ZDISK_SERVE_ARGS (added to `zdisk serve`),
# FIO_ARGS (added to the measured fio job, e.g. "--numjobs=8 --fsync=4 --rwmixread=70" for a
# database's mix: jobs are reported as a group, and flushes count as requests).
# Idle work is off while serving (ZDISK_IDLE_AFTER_MS=0).
set -euo pipefail
usage() { sed -n '/^#   usage/,/^#   e.g./p' "$0" | sed 's/^# \{0,3\}//' >&2; exit 2; }
[[ $# -ge 3 ]] || usage
dir=$1 rounds=$2
shift 2
rw=${RW:-randwrite} bs=${BS:-4k} qd=${QD:-32} secs=${SECS:-8}
for tool in fio qemu-nbd jq; do
  command -v "$tool" >/dev/null || { echo "server-cost.sh: $tool is not installed" >&2; exit 1; }
done
for target in "$@"; do
  [[ $target == raw || -x $target ]] || { echo "server-cost.sh: $target is neither an executable nor raw" >&2; exit 2; }
done
export ZDISK_IDLE_AFTER_MS=0
mkdir -p "$dir"
data=(--buffer_compress_percentage="${COMPRESS_PERCENT:-50}" --buffer_compress_chunk=4096 --refill_buffers=1)
server=
stop() { [[ -n $server ]] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null; server=; true; }
trap 'stop; rm -rf "$dir"/t' EXIT
# CPU ticks of the server (user + system), context switches of its threads, and the
# machine's idle and total ticks.
server_cpu() { awk '{ print $14 + $15 }' "/proc/$server/stat"; }
server_switches() { cat /proc/"$server"/task/*/status | awk '/ctxt_switches/ { s += $2 } END { print s }'; }
machine() { awk 'NR == 1 { print $5 + $6, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9 }' /proc/stat; }
ticks_per_s=$(getconf CLK_TCK)
printf '%-5s %-28s %9s %14s %12s %12s %6s\n' round target IOPS 'CPU µs/req' 'ctxsw/req' 'futex/req' idle%
for round in $(seq "$rounds"); do
  for target in "$@"; do
    rm -rf "$dir/t"
    mkdir -p "$dir/t"
    if [[ $target == raw ]]; then
      truncate -s 4G "$dir/t/raw.img"
      qemu-nbd -f raw --cache=none --aio=native --persistent --shared=8 --socket="$dir/t/s.sock" "$dir/t/raw.img" \
        >"$dir/t/server.log" 2>&1 &
    else
      "$target" format "$dir/t/s.zdisk" --physical-size "${ZDISK_PHYSICAL:-4G}" --logical-size 4G >/dev/null
      # shellcheck disable=SC2086 # ZDISK_SERVE_ARGS is a list of arguments
      "$target" serve "$dir/t/s.zdisk" --unix "$dir/t/s.sock" ${ZDISK_SERVE_ARGS:-} >"$dir/t/server.log" 2>&1 &
    fi
    server=$!
    for _ in $(seq 100); do [[ -S $dir/t/s.sock ]] && break; sleep 0.1; done
    [[ -S $dir/t/s.sock ]] || { echo "server-cost.sh: $target did not start:" >&2; cat "$dir/t/server.log" >&2; exit 1; }
    uri="nbd+unix:///?socket=$dir/t/s.sock"
    fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=128k --iodepth=8 --size=1G "${data[@]}" >/dev/null
    cpu0=$(server_cpu) switches0=$(server_switches)
    read -r idle0 total0 < <(machine)
    futex=
    if command -v perf >/dev/null; then
      perf stat -x, -e syscalls:sys_enter_futex -p "$server" -o "$dir/t/perf.txt" 2>/dev/null &
      futex=$!
    fi
    # fio prints the nbd engine's connection line before its JSON.
    # shellcheck disable=SC2086 # FIO_ARGS is a list of arguments
    fio --name=job --ioengine=nbd --uri="$uri" --rw="$rw" --bs="$bs" --iodepth="$qd" --size=1G --time_based=1 \
      --runtime="$secs" "${data[@]}" --group_reporting=1 ${FIO_ARGS:-} --output-format=json | sed -n '/^{/,$p' >"$dir/t/fio.json"
    futex_calls=-
    if [[ -n $futex ]]; then
      kill -INT "$futex" && wait "$futex" || true
      futex_calls=$(awk -F, '$3 ~ /futex/ { print $1 }' "$dir/t/perf.txt")
    fi
    cpu1=$(server_cpu) switches1=$(server_switches)
    read -r idle1 total1 < <(machine)
    requests=$(jq '.jobs[0].read.total_ios + .jobs[0].write.total_ios + (.jobs[0].sync.total_ios // 0)' "$dir/t/fio.json")
    iops=$(jq '.jobs[0].read.iops + .jobs[0].write.iops' "$dir/t/fio.json")
    name=$target
    [[ $target == raw ]] || name=$(realpath "$target")
    (( ${#name} <= 28 )) || name=…${name: -27}
    awk -v round="$round" -v name="$name" -v iops="$iops" -v n="$requests" -v cpu=$((cpu1 - cpu0)) \
      -v hz="$ticks_per_s" -v sw=$((switches1 - switches0)) -v fx="$futex_calls" \
      -v idle=$((idle1 - idle0)) -v total=$((total1 - total0)) 'BEGIN {
        futex = (fx == "-") ? "-" : sprintf("%.2f", fx / n)
        printf "%-5s %-28s %9.0f %14.1f %12.2f %12s %6.1f\n", round, name, iops, cpu * 1e6 / hz / n, sw / n, futex, 100 * idle / total
      }'
    stop
  done
done
