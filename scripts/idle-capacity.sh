#!/bin/bash
# Usage: scripts/idle-capacity.sh NAME CORPUS[,CORPUS...] PHYSICAL [SECONDS]
# The capacity a store reaches with defaults alone (docs/space.md, "Idle work"): format with
# defaults (zstd:1, adaptive LZ4 fallback, idle work after 2 s, first dictionary at 16 MiB),
# serve; for each corpus in turn, nbdcopy it in (from offset 0: a later one overwrites the
# start of the earlier ones), then leave the store idle and print comp_ratio every 2 s until
# idle work has stopped for 6 s (at most SECONDS, default 120). Then stop; stat and check
# offline.
set -euo pipefail
NAME=$1; CORPORA=$2; PHYS=$3; LIMIT=${4:-120}
Z=${ZDISK_BIN:-target/release/zdisk}
export ZDISK_PLUGIN=${ZDISK_PLUGIN:-$(dirname "$Z")/libnbdkit_zdisk_plugin.so}
D=${ZDISK_MEASURE_DIR:-/var/tmp/zdisk-idle-capacity}/$NAME; rm -rf "$D"; mkdir -p "$D"
$Z format "$D/s.zdisk" --physical-size "$PHYS" >/dev/null
$Z serve "$D/s.zdisk" --unix "$D/s.sock" --pid-file "$D/nbdkit.pid" > "$D/serve.out" 2> "$D/serve.err" &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S "$D/s.sock" ] && break; sleep 0.1; done
sleep 1

show() { # seconds since the copy; prints the store's live statistics, then an IDLE line
  $Z stat "$D/s.zdisk" --json > "$D/stat.json"
  python3 - "$1" "$D/stat.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[2]))
print("t+%3ss comp_ratio %.3f physical %d fallback %d dictionaries trained %d, newest %d; idle segments %d; recompressed %d (dictionary %d), cpu %.2f s"
      % (sys.argv[1], s['comp_ratio'], s['physical_size'], s['codec_fallback_blocks'], s['dictionaries_trained_idle'],
         s['dictionary_newest_id'], s['idle_segments_recompressed'], s['recompressed_fragments'],
         s['recompressed_fragments_dictionary'], s['recompress_cpu_ns'] / 1e9))
print("IDLE", s['idle_segments_recompressed'], s['physical_size'], s['dictionaries_trained_idle'])
PY
}

for CORPUS in ${CORPORA//,/ }; do
  echo "load before copy: $(cat /proc/loadavg)"
  /usr/bin/time -f "nbdcopy $(basename "$CORPUS") %e s" nbdcopy --flush "$CORPUS" "nbd+unix:///?socket=$D/s.sock"
  last=""; same=0
  for t in $(seq 0 2 "$LIMIT"); do
    [ "$t" = 0 ] || sleep 2
    out=$(show "$t"); echo "$out" | grep -v ^IDLE
    now=$(echo "$out" | grep ^IDLE)
    if [ "$now" = "$last" ]; then same=$((same + 1)); else same=0; fi
    last=$now
    [ $same -ge 3 ] && break
  done
done
kill -TERM $SERVE; wait $SERVE || true
trap - EXIT
$Z stat "$D/s.zdisk" --json | python3 -c "import json,sys;s=json.load(sys.stdin);print('offline: comp_ratio %.3f dictionaries %d' % (s['comp_ratio'],s['dictionary_count']))"
$Z check "$D/s.zdisk" --json | python3 -c "import json,sys;c=json.load(sys.stdin);print('check clean:',c['clean'])"
