#!/usr/bin/env bash
# Two builds of zdisk side by side on the same stores: each round serves every store with
# the first build, then with the second, one fio slice of SECS seconds each, so that this
# VM's drifting disk speed and the stores' own state (free space, GC) fall on both alike.
# Prints each slice's IOPS and the server's CPU time per request.
#   usage: bash scripts/ab-builds.sh OLD_ZDISK NEW_ZDISK ROUNDS SECS RW BS STORE[:KEYFILE]...
#   e.g.   bash scripts/ab-builds.sh /tmp/base/release/zdisk target/release/zdisk 4 8 randwrite 4k \
#            /work/prof/enc/s.zdisk /work/prof/enc/e.zdisk:/work/prof/enc/key
# Fill the stores first (2:1 data over 4 GiB of offsets, as `scripts/compare.sh` does).
# Idle work is off while serving (ZDISK_IDLE_AFTER_MS=0), as in `scripts/interleave.sh`.
set -euo pipefail
old=$1 new=$2 rounds=$3 secs=$4 rw=$5 bs=$6
shift 6
sock=$(mktemp -u /tmp/zdisk-ab.XXXXXX.sock)
server=
stop() { [[ -n $server ]] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null; server=; true; }
trap 'stop; rm -f "$sock"' EXIT
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
for round in $(seq "$rounds"); do
  for build in old new; do
    bin=$old; [[ $build == new ]] && bin=$new
    for spec in "$@"; do
      store=${spec%%:*} key=; [[ $spec == *:* ]] && key=${spec#*:}
      ZDISK_IDLE_AFTER_MS=0 "$bin" serve "$store" ${key:+--key-file "$key"} --unix "$sock" >/dev/null 2>&1 &
      server=$!
      for _ in $(seq 100); do [[ -S $sock ]] && break; sleep 0.1; done
      pid=$(pgrep -f "nbdkit.*-U $sock " | head -1)
      before=$(cpu_ticks "$pid")
      fio --name=j --ioengine=nbd --uri="nbd+unix:///?socket=$sock" --rw="$rw" --bs="$bs" --iodepth=32 \
        --time_based=1 --runtime="$secs" --buffer_compress_percentage=50 --buffer_compress_chunk=4096 \
        --refill_buffers=1 --size=4g --output-format=json --output="$sock.json" >/dev/null 2>&1
      after=$(cpu_ticks "$pid")
      python3 - "$sock.json" "$round $build $(basename "$store")" "$before" "$after" "$(getconf CLK_TCK)" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
ios = j["read"]["total_ios"] + j["write"]["total_ios"]
iops = j["read"]["iops"] + j["write"]["iops"]
cpu_s = (int(sys.argv[4]) - int(sys.argv[3])) / int(sys.argv[5])
print(f"round {sys.argv[2]}: {iops:.0f} IOPS, server CPU {cpu_s * 1e6 / ios:.1f} µs a request")
PY
      stop
      while pgrep -f "nbdkit.*-U $sock " >/dev/null; do sleep 0.1; done
      rm -f "$sock" "$sock.json"
    done
  done
done
