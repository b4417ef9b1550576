#!/usr/bin/env bash
# What a flush costs, side by side: commit-shaped fio jobs (random writes, each followed by
# a flush: fio's fsync=1 sends NBD_CMD_FLUSH; its nbd engine refuses fdatasync) against one zdisk store served in turn by
# two builds of zdisk, and against a raw file behind `qemu-nbd --cache=none --aio=native`,
# the targets taking turns for ROUNDS rounds of SECS seconds each, so this VM's drifting
# disk speed falls on all alike. Written for the flush proof (docs/format.md, "Flush
# proof"): OLD is a build without it, NEW one with it.
#   usage: bash scripts/flush-cost.sh OLD_ZDISK NEW_ZDISK [ROUNDS] [SECS] [DIR]
#   e.g.   bash scripts/flush-cost.sh /work/target-old/release/zdisk target/release/zdisk 3 8 /work/fc
# Each build's nbdkit plugin must sit next to its zdisk. 2:1 data, 2 GiB targets, 1 GiB
# written first; the store is formatted --preallocate (as a database's store should be:
# docs/format.md, "Backing allocation"). Prints IOPS and mean flush latency per slice.
set -euo pipefail
old=$1 new=$2 rounds=${3:-3} secs=${4:-8}
dir=${5:-$(mktemp -d /var/tmp/zdisk-flush-cost.XXXXXX)}
mkdir -p "$dir"
export ZDISK_IDLE_AFTER_MS=0
data=(--buffer_compress_percentage=50 --buffer_compress_chunk=4096 --refill_buffers=1 --size=1g)
server=
stop() { [[ -n $server ]] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null; server=; true; }
trap 'stop' EXIT
serve() { # NAME: starts the target NAME on $dir/NAME.sock
  case $1 in
    raw) qemu-nbd -f raw --cache=none --aio=native -t -e 8 -k "$dir/raw.sock" "$dir/raw.img" & ;;
    old) "$old" serve "$dir/s.zdisk" --unix "$dir/old.sock" >/dev/null 2>&1 & ;;
    new) "$new" serve "$dir/s.zdisk" --unix "$dir/new.sock" >/dev/null 2>&1 & ;;
  esac
  server=$!
  for _ in $(seq 100); do [[ -S $dir/$1.sock ]] && break; sleep 0.1; done
}
job() { # NAME BS JOBS SECS-or-"fill"
  local args=(--rw=randwrite --bs="$2" --iodepth=1 --numjobs="$3" --fsync=1 --time_based=1 --runtime="$4")
  [[ $4 == fill ]] && args=(--rw=write --bs=1m --iodepth=8 --numjobs=1)
  fio --name=j --ioengine=nbd --uri="nbd+unix:///?socket=$dir/$1.sock" "${args[@]}" "${data[@]}" \
    --group_reporting=1 --output-format=json --output="$dir/fio.json" >/dev/null 2>&1
}
rm -f "$dir/s.zdisk" "$dir/raw.img"
"$new" format "$dir/s.zdisk" --physical-size 2G --preallocate >/dev/null
dd if=/dev/zero of="$dir/raw.img" bs=1M count=2048 status=none conv=fsync
for target in raw new; do serve "$target"; job "$target" 1m 1 fill; stop; done
for shape in "4k 1" "16k 1" "4k 4"; do
  read -r bs jobs <<<"$shape"
  echo "randwrite $bs, $jobs job(s) at QD1, a flush after every write"
  for round in $(seq "$rounds"); do
    for target in raw old new; do
      serve "$target"
      job "$target" "$bs" "$jobs" "$secs"
      stop
      python3 - "$dir/fio.json" "$target" "$round" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
w, s = j["write"], j["sync"]
print(f"  round {sys.argv[3]} {sys.argv[2]:>3}: {w['iops']:7.0f} IOPS, write {w['clat_ns']['mean']/1e3:6.0f} µs, "
      f"flush {s['lat_ns']['mean']/1e3:6.0f} µs")
PY
    done
  done
done
