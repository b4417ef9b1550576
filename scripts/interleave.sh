#!/usr/bin/env bash
# Interleaved side-by-side runs of one fio job on stores already served in DIR (NAME.sock
# each, served by `zdisk serve STORE --unix DIR/NAME.sock`): ROUNDS rounds of SECS seconds
# per store, the stores taking turns, so that this VM's drifting disk speed falls on all
# alike. Prints each slice's IOPS and the server's CPU time per request (utime + stime of the
# nbdkit process serving that socket, from /proc).
#   usage: bash scripts/interleave.sh DIR RW BS ROUNDS SECS NAME...
#   e.g.   bash scripts/interleave.sh /work/prof randwrite 4k 5 8 e s
# Set ZDISK_IDLE_AFTER_MS=0 for the servers: one store's idle work would take the cores
# while another is measured. 2:1 data, QD32, 4 GiB of offsets (fill the stores first).
set -euo pipefail
dir=$1 rw=$2 bs=$3 rounds=$4 secs=$5
shift 5
data=(--buffer_compress_percentage=50 --buffer_compress_chunk=4096 --refill_buffers=1 --size=4g)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
for round in $(seq "$rounds"); do
  for name in "$@"; do
    pid=$(pgrep -f "nbdkit.*-U $dir/$name.sock " | head -1)
    [[ -n $pid ]] || { echo "no server for $dir/$name.sock" >&2; exit 1; }
    before=$(cpu_ticks "$pid")
    fio --name=j --ioengine=nbd --uri="nbd+unix:///?socket=$dir/$name.sock" --rw="$rw" --bs="$bs" --iodepth=32 \
      --time_based=1 --runtime="$secs" "${data[@]}" --output-format=json --output="$dir/interleave.json" >/dev/null 2>&1
    after=$(cpu_ticks "$pid")
    python3 - "$dir/interleave.json" "$name" "$round" "$before" "$after" "$(getconf CLK_TCK)" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
ios = j["read"]["total_ios"] + j["write"]["total_ios"]
iops = j["read"]["iops"] + j["write"]["iops"]
cpu_s = (int(sys.argv[5]) - int(sys.argv[4])) / int(sys.argv[6])
print(f"round {sys.argv[3]} {sys.argv[2]}: {iops:.0f} IOPS, server CPU {cpu_s * 1e6 / ios:.1f} µs a request")
PY
  done
done
