#!/bin/bash
# Usage: scripts/recompress-capacity.sh NAME CORPUS PHYSICAL [LEVEL]: format a store with defaults (zstd:1,
# adaptive LZ4 fallback), serve it, nbdcopy the corpus in, print the live statistics,
# stop; then zdisk recompress --train [--level LEVEL] (offline), stat, check (docs/space.md, "Trained dictionaries").
set -euo pipefail
NAME=$1; CORPUS=$2; PHYS=$3; LEVEL=${4:-3}
Z=${ZDISK_BIN:-target/release/zdisk}
export ZDISK_PLUGIN=${ZDISK_PLUGIN:-$(dirname "$Z")/libnbdkit_zdisk_plugin.so}
D=${ZDISK_MEASURE_DIR:-/var/tmp/zdisk-recompress-capacity}/$NAME; rm -rf "$D"; mkdir -p "$D"
$Z format "$D/s.zdisk" --physical-size "$PHYS" >/dev/null
$Z serve "$D/s.zdisk" --unix "$D/s.sock" --pid-file "$D/nbdkit.pid" > "$D/serve.out" 2> "$D/serve.err" &
SERVE=$!
for i in $(seq 100); do [ -S "$D/s.sock" ] && break; sleep 0.1; done
sleep 1
echo "load before copy: $(cat /proc/loadavg)"
/usr/bin/time -f "nbdcopy %e s" nbdcopy --flush "$CORPUS" "nbd+unix:///?socket=$D/s.sock"
sleep 2.5; $Z stat "$D/s.zdisk" --json > "$D/stat-served.json"
python3 -c "import json,sys;s=json.load(open('$D/stat-served.json'));print('served: comp_ratio %.3f raw %d lz4 %d zstd %d fallback %d' % (s['comp_ratio'],s['blocks_written_raw'],s['blocks_written_lz4'],s['blocks_written_zstd'],s['codec_fallback_blocks']))"
kill -TERM $SERVE; wait $SERVE || true
$Z stat "$D/s.zdisk" --json > "$D/stat-default.json"
python3 -c "import json,sys;s=json.load(open('$D/stat-default.json'));print('default: comp_ratio %.3f physical %d raw %d lz4 %d zstd %d fallback %d' % (s['comp_ratio'],s['physical_size'],s['blocks_written_raw'],s['blocks_written_lz4'],s['blocks_written_zstd'],s['codec_fallback_blocks']))"
echo "load before recompress: $(cat /proc/loadavg)"
/usr/bin/time -f "recompress --train %e s wall, %U s user" $Z recompress "$D/s.zdisk" --train --level "$LEVEL" --json > "$D/recompress-train.json"
python3 -c "import json;r=json.load(open('$D/recompress-train.json'));a=r['after'];print('after --train: comp_ratio %.3f -> %.3f, physical %d -> %d, dictionary %s, recompressed %d (dict %d), cpu %.2f s, %.1f s' % (r['before']['comp_ratio'],a['comp_ratio'],r['before']['physical_size'],a['physical_size'],r['dictionary'],a['recompressed_fragments'],a['recompressed_fragments_dictionary'],a['recompress_cpu_ns']/1e9,r['seconds']))"
$Z stat "$D/s.zdisk" --json > "$D/stat-train.json"
python3 -c "import json;s=json.load(open('$D/stat-train.json'));print('stat after: comp_ratio %.3f dictionary_count %d bytes %d' % (s['comp_ratio'],s['dictionary_count'],s['dictionary_bytes']))"
$Z check "$D/s.zdisk" --json | python3 -c "import json,sys;c=json.load(sys.stdin);print('check clean:',c['clean'])"
