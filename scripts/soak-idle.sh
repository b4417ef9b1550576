#!/usr/bin/env bash
# Soak, then idle (issue 48): a store at 2x with the map cache a sixteenth of its map, filled
# with fio's 2:1 data, then SECONDS of mixed random overwrites at QD32 (4K and 64K writes,
# 30% reads, offsets skewed 80/20) — under load the write path stores what arrives while
# its cores are busy with LZ4 — then IDLE seconds without requests, while idle work
# recompresses it. Prints write errors (ENOSPC: must be 0), comp_ratio after the load and
# after the idle time, and the ratio of the same data written slowly (a second store filled
# with the fallback off: what the codec gives), with the gap in percent (issue 48's goal:
# within 3%).
#   usage: bash scripts/soak-idle.sh [PHYSICAL=4G] [SECONDS=3600] [IDLE=120] [WORKDIR]
# Needs a release build (cargo build --release -p zdisk -p zdisk-nbdkit), fio, nbdkit.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
zdisk=${ZDISK_BIN:-$here/target/release/zdisk}
physical=${1:-4G}
seconds=${2:-3600}
idle=${3:-120}
dir=${4:-$(mktemp -d /var/tmp/zdisk-soak.XXXXXX)}
mkdir -p "$dir"
pid=
cleanup() { [[ -n $pid ]] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -f "$dir"/*.sock; }
trap cleanup EXIT
data=(--buffer_compress_percentage=50 --buffer_compress_chunk=4096 --refill_buffers --randrepeat=0)
ratio() { "$zdisk" stat "$dir/$1.zdisk" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["comp_ratio"])'; }
serve() { # name [serve args...]
  local name=$1; shift
  "$zdisk" serve "$dir/$name.zdisk" --unix "$dir/$name.sock" "$@" >"$dir/serve-$name.log" 2>&1 & pid=$!
  for _ in $(seq 100); do [[ -S $dir/$name.sock ]] && break; sleep 0.1; done
}
stop() { kill "$pid"; wait "$pid" 2>/dev/null || true; pid=; }
errors() { python3 -c 'import json,sys; t=open(sys.argv[1]).read(); j=json.loads(t[t.index("{"):])["jobs"]; print(sum(x.get("total_err", x.get("error", 0)) for x in j))' "$1"; }

# What the codec gives when written slowly: the same data with the fallback off.
rm -f "$dir"/slow.zdisk "$dir"/s.zdisk
"$zdisk" format "$dir/slow.zdisk" --physical-size 1G --logical-size 2x >/dev/null
ZDISK_CODEC_FALLBACK=never serve slow
fio --name=slow --ioengine=nbd --uri="nbd+unix:///?socket=$dir/slow.sock" "${data[@]}" --rw=write --bs=128k \
  --size=512m --iodepth=8 --output-format=json >"$dir/slow.json"
stop
codec_ratio=$(ratio slow)

"$zdisk" format "$dir/s.zdisk" --physical-size "$physical" --logical-size 2x >/dev/null
logical_bytes=$("$zdisk" stat "$dir/s.zdisk" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["provisioned_cap"])')
map_kib=$((logical_bytes / 4096 * 8 / 1024))
serve s --map-cache "$((map_kib / 16))K"
uri="nbd+unix:///?socket=$dir/s.sock"
fio --name=fill --ioengine=nbd --uri="$uri" "${data[@]}" --rw=write --bs=128k --iodepth=32 --continue_on_error=all \
  --output-format=json >"$dir/fill.json"
echo "filled $((logical_bytes >> 20)) MiB (map cache $((map_kib / 16)) KiB, a sixteenth of the map): comp_ratio $(ratio s)" >&2
fio --ioengine=nbd --uri="$uri" "${data[@]}" --continue_on_error=all --output-format=json --time_based \
  --runtime="$seconds" --norandommap --random_generator=tausworthe64 --random_distribution=zoned:80/20:20/80 \
  --name=small --rw=randrw --rwmixread=30 --bs=4k --iodepth=16 \
  --name=large --rw=randrw --rwmixread=30 --bs=64k --iodepth=16 >"$dir/soak.json"
loaded=$(ratio s)
sleep "$idle"
idled=$(ratio s)
"$zdisk" stat "$dir/s.zdisk" --json >"$dir/stat.json"
stop
python3 - "$codec_ratio" "$loaded" "$idled" "$(errors "$dir/fill.json")" "$(errors "$dir/soak.json")" "$dir/stat.json" "$seconds" "$idle" <<'EOF'
import json, sys
codec, loaded, idled = (float(x) for x in sys.argv[1:4])
fill_err, soak_err = sys.argv[4:6]
s = json.load(open(sys.argv[6]))
print(f"soak {sys.argv[7]} s, idle {sys.argv[8]} s: write errors fill {fill_err}, soak {soak_err}")
print(f"comp_ratio: codec written slowly {codec:.3f}; after the load {loaded:.3f}; after idle {idled:.3f} "
      f"({100 * (codec - idled) / codec:+.1f}% below the codec's)")
print(f"WA {s['write_amplification']:.3f}; idle segments recompressed {s.get('idle_segments_recompressed', 0)}, "
      f"idle room steps {s.get('idle_room_steps', 0)}; LZ4 fallback blocks {s.get('codec_fallback_blocks', 0)}")
EOF
