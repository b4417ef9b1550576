#!/bin/bash
# Usage: scripts/idle-yield.sh [CORPUS] [HOG_SECONDS] [PHYSICAL]
# Whether idle work takes CPU other processes want (docs/space.md, "Idle work", spare CPU):
# for each setting — idle work off, on without the spare-CPU check (ZDISK_IDLE_SPARE_CORES=0),
# on with the default check — format a store, serve it, copy CORPUS in (default the 64 MiB
# text corpus, which leaves idle work seconds of training and recompression), then at once
# run one CPU-bound loop per core for HOG_SECONDS (default 15) and count its iterations,
# reading the store's idle counters before and after; then wait (up to 60 s) for idle work
# to finish. Prints one line per setting.
set -euo pipefail
CORPUS=${1:-/var/tmp/zdisk-corpora/text-lines.bin}; HOG=${2:-15}; PHYS=${3:-512M}
Z=${ZDISK_BIN:-target/release/zdisk}
export ZDISK_PLUGIN=${ZDISK_PLUGIN:-$(dirname "$Z")/libnbdkit_zdisk_plugin.so}
D=${ZDISK_MEASURE_DIR:-/var/tmp/zdisk-idle-yield}; mkdir -p "$D"
CORES=$(nproc)
idle_counters() { # prints "dictionaries_trained_idle idle_segments_recompressed"
  $Z stat "$D/s.zdisk" --json | python3 -c "import json,sys;s=json.load(sys.stdin);print(s['dictionaries_trained_idle'],s['idle_segments_recompressed'])"
}
hog() { # one busy loop per core for $HOG s; prints the summed iterations
  local pids=() i
  for i in $(seq "$CORES"); do
    python3 -c "import time
t=time.time()+$HOG;n=0
while time.time()<t: n+=1
print(n)" >"$D/hog.$i" &
    pids+=($!)
  done
  wait "${pids[@]}"
  cat "$D"/hog.* | awk '{n+=$1} END {print n}'; rm -f "$D"/hog.*
}
for setting in off no-check default; do
  rm -f "$D"/s.zdisk "$D"/s.sock
  $Z format "$D/s.zdisk" --physical-size "$PHYS" >/dev/null
  args=(); envs=()
  case $setting in
    off) args=(--idle-after 0) ;;
    no-check) envs=(ZDISK_IDLE_SPARE_CORES=0) ;;
  esac
  env "${envs[@]}" "$Z" serve "$D/s.zdisk" --unix "$D/s.sock" "${args[@]}" >"$D/serve.out" 2>"$D/serve.err" &
  serve=$!
  for _ in $(seq 100); do [ -S "$D/s.sock" ] && break; sleep 0.1; done
  nbdcopy --flush "$CORPUS" "nbd+unix:///?socket=$D/s.sock"
  before=$(idle_counters)
  iterations=$(hog)
  during=$(idle_counters)
  waited=0
  while [ "$setting" != off ] && [ $waited -lt 60 ]; do
    sleep 2; waited=$((waited + 2))
    now=$(idle_counters)
    [ "$now" = "$last" ] 2>/dev/null && break
    last=$now
  done
  after=$(idle_counters); last=""
  echo "$setting: hog $iterations iterations in $HOG s on $CORES cores; idle (dictionaries, segments) at copy end $before, after the hog $during, at rest $after (+${waited} s)"
  kill -TERM $serve; wait $serve || true
done
