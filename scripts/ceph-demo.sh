#!/usr/bin/env bash
# A small Ceph cluster (one host, N BlueStore OSDs, pool size 2, RBD) on zdisk devices, and
# the SNIA Ceph case study (shared/seeds/002) side by side on the same disk. See docs/ceph.md.
#
#   scripts/ceph-demo.sh bench  [options]   the case study: zdisk vs BlueStore zstd/lz4 vs raw
#   scripts/ceph-demo.sh smoke  [options]   tiny cluster on zdisk, one short fio run (CI)
#   scripts/ceph-demo.sh space  [options]   discard gives zdisk space back; ENOSPC under an OSD
#   scripts/ceph-demo.sh fault  [options]   kill a zdisk server under a running OSD; recovery
#   scripts/ceph-demo.sh guard  --conf C --osd-store ID=STORE ...  (see docs/ceph.md)
#   scripts/ceph-demo.sh report --out DIR   re-render a bench report from its runs.jsonl
#
# The shell stands clusters up, measures and tears down; the zdisk binary reads the sizes
# (`zdisk size`) and writes the report (`zdisk ceph report`: report.json, summary.md,
# report.html from runs.jsonl and meta.json).
#
# Every daemon, device, mount and temporary file it starts is torn down on exit, on Ctrl-C /
# SIGTERM and after a failure. Needs root, Debian's ceph-mon, ceph-mgr, ceph-osd, ceph-common,
# fio (with the rbd engine), jq, nbdfuse (libnbd-bin), fuse3, qemu-nbd (qemu-utils) and a
# release build of zdisk (cargo build --release).
set -Eeuo pipefail

COMMAND="$0 $*"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODE=${1:-}
[[ $# -gt 0 ]] && shift

usage() {
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
  cat <<'EOF'

Options (defaults in brackets):
  --dir DIR             parent of the work directory; must accept O_DIRECT [/var/tmp]
  --out DIR             report directory [./zdisk-ceph-<mode>-<unix time>]
  --zdisk PATH          zdisk binary [target/release/zdisk of this checkout]
  --osds N              OSDs, N >= 3 [3]
  --osd-size SIZE       the block device each OSD sees (logical size) [4G; smoke 1G]
  --native-fraction F   zdisk's logical size = F x its physical size for "native" OSDs [0.8]
  --zdisk-format ARGS   extra `zdisk format` options of the `zdisk` case [none: the default codec]
  --cases LIST          bench cases [zdisk,zdisk-zstd1,bluestore-zstd,bluestore-lz4,raw]
  --images N            RBD images [2]
  --image-size SIZE     size of each image [1G; smoke 128M]
  --rounds N            bench rounds; the case order rotates every round [2]
  --runtime S           seconds of 128K reads and of 4K random writes [20; smoke 3]
  --qd N                fio iodepth per image [128 (the seed's)]
  --compress-pct P      fio buffer_compress_percentage [60 (the seed's)]
  --seed N              fault mode: which OSD and when (printed; reruns the same fault)
  --keep                leave the work directory (stores, logs) behind
EOF
}

# ---------------------------------------------------------------- options
DIR=${TMPDIR:-/var/tmp}
OUT=""
ZDISK=""
OSDS=3
OSD_SIZE=""
NATIVE=0.8
ZFMT=""
CASES="zdisk,zdisk-zstd1,bluestore-zstd,bluestore-lz4,raw"
IMAGES=2
IMAGE_SIZE=""
ROUNDS=2
RUNTIME=""
QD=128
PCT=60
SEED=""
KEEP=0
GUARD_CONF=""
GUARD_STORES=()
GUARD_INTERVAL=2

while [[ $# -gt 0 ]]; do
  case $1 in
    --dir) DIR=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --zdisk) ZDISK=$2; shift 2 ;;
    --osds) OSDS=$2; shift 2 ;;
    --osd-size) OSD_SIZE=$2; shift 2 ;;
    --native-fraction) NATIVE=$2; shift 2 ;;
    --zdisk-format) ZFMT=$2; shift 2 ;;
    --cases) CASES=$2; shift 2 ;;
    --images) IMAGES=$2; shift 2 ;;
    --image-size) IMAGE_SIZE=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --runtime) RUNTIME=$2; shift 2 ;;
    --qd) QD=$2; shift 2 ;;
    --compress-pct) PCT=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --conf) GUARD_CONF=$2; shift 2 ;;
    --osd-store) GUARD_STORES+=("$2"); shift 2 ;;
    --interval) GUARD_INTERVAL=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "ceph-demo: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case $MODE in
  bench|smoke|space|fault|guard|report) ;;
  ""|-h|--help|help) usage; [[ -z $MODE ]] && exit 2; exit 0 ;;
  *) echo "ceph-demo: unknown mode '$MODE' (bench, smoke, space, fault, guard, report)" >&2; exit 2 ;;
esac

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }
bad() { echo "ceph-demo: $*" >&2; exit 2; }
is_uint "$OSDS" && ((OSDS >= 3)) || bad "--osds must be a whole number >= 3 (pool size 2 needs a spare OSD to recover onto)"
is_uint "$IMAGES" && ((IMAGES >= 1)) || bad "--images must be >= 1"
is_uint "$ROUNDS" && ((ROUNDS >= 1)) || bad "--rounds must be >= 1"
is_uint "$QD" && ((QD >= 1)) || bad "--qd must be >= 1"
is_uint "$PCT" && ((PCT <= 100)) || bad "--compress-pct must be 0..100"
[[ $NATIVE =~ ^0?\.[0-9]+$|^1(\.0*)?$ ]] || bad "--native-fraction must be in (0, 1]"
[[ -z $SEED ]] || is_uint "$SEED" || bad "--seed must be a whole number"

# The zdisk binary: it also reads the sizes below and writes the bench report.
[[ -n $ZDISK ]] || ZDISK=$ROOT/target/release/zdisk
[[ -x $ZDISK ]] || { echo "ceph-demo: $ZDISK not found: run 'cargo build --release' first (or --zdisk PATH)" >&2; exit 1; }
ZDISK=$(readlink -f "$ZDISK")

# Sizes as every zdisk command reads them (`zdisk size`: 64M, 1.5G, binary units), in whole
# 4 KiB blocks.
to_bytes() { local b; b=$("$ZDISK" size "$1") && echo $((b / 4096 * 4096)); }
if [[ $MODE == smoke ]]; then
  OSD_SIZE=${OSD_SIZE:-1G} IMAGE_SIZE=${IMAGE_SIZE:-128M} RUNTIME=${RUNTIME:-3}
fi
OSD_SIZE=${OSD_SIZE:-4G} IMAGE_SIZE=${IMAGE_SIZE:-1G} RUNTIME=${RUNTIME:-20}
OSD_BYTES=$(to_bytes "$OSD_SIZE") || bad "--osd-size: not a size: $OSD_SIZE"
IMAGE_BYTES=$(to_bytes "$IMAGE_SIZE") || bad "--image-size: not a size: $IMAGE_SIZE"
is_uint "$RUNTIME" && ((RUNTIME >= 1)) || bad "--runtime must be whole seconds >= 1"
((OSD_BYTES >= 1024 ** 3)) || bad "--osd-size must be at least 1G (BlueStore's RocksDB needs room)"
IFS=, read -r -a CASE_LIST <<<"$CASES"
for c in "${CASE_LIST[@]}"; do
  case $c in zdisk|zdisk-zstd1|bluestore-zstd|bluestore-lz4|raw) ;; *) bad "unknown case '$c' (zdisk, zdisk-zstd1, bluestore-zstd, bluestore-lz4, raw)" ;; esac
done
# Client data must fit: IMAGES x IMAGE x 2 replicas on OSDS devices, at most ~70% full.
if [[ $MODE != guard ]] && (( IMAGES * IMAGE_BYTES * 2 * 10 > OSDS * OSD_BYTES * 7 )); then
  bad "--images x --image-size x 2 replicas must stay under 70% of --osds x --osd-size"
fi

# ---------------------------------------------------------------- tools
need() { # need TOOL PACKAGE
  command -v "$1" >/dev/null 2>&1 || { echo "ceph-demo: '$1' not found: apt-get install $2" >&2; exit 1; }
}
check_tools() {
  [[ $(id -u) -eq 0 ]] || { echo "ceph-demo: run as root (loop devices, FUSE, Ceph daemons)" >&2; exit 1; }
  need ceph-mon ceph-mon; need ceph-mgr ceph-mgr; need ceph-osd ceph-osd
  need ceph ceph-common; need rbd ceph-common; need ceph-authtool ceph-common; need monmaptool ceph-base
  need fio fio; need jq jq; need nbdfuse libnbd-bin; need fusermount3 fuse3; need qemu-nbd qemu-utils
  need losetup util-linux; need setsid util-linux; need timeout coreutils
  fio --enghelp=rbd >/dev/null 2>&1 || { echo "ceph-demo: this fio has no rbd engine: apt-get install fio librbd1" >&2; exit 1; }
  [[ -e /dev/fuse ]] || { modprobe fuse 2>/dev/null || true; }
  [[ -e /dev/fuse ]] || { echo "ceph-demo: /dev/fuse missing (modprobe fuse)" >&2; exit 1; }
}

# ---------------------------------------------------------------- state, logging, teardown
WORK=""           # the work directory (cluster, stores, raw files, run dir)
CL=""             # the current cluster's directory
CONF=""           # its ceph.conf
DAEMONS=()        # "name:pid" of every Ceph daemon running
DEVS=()           # "kind:device:store-or-file:extra" of every attached device
BG=()             # other background pids we own (fio, guard)
declare -A OSD_DEV OSD_STORE OSD_UUID

log() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "${OUT:-/dev/null}/run.log" >&2; }
die() { log "FAILED: $*"; exit 1; }

ceph_() { timeout 60 ceph -c "$CONF" "$@"; }
rbd_() { timeout 300 rbd -c "$CONF" "$@"; }

stop_pid() { # stop_pid PID [grace seconds]: TERM, then KILL after the grace
  local pid=$1 grace=${2:-30} i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < grace * 10; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
}

stop_daemons() {
  local d pids=()
  for d in "${DAEMONS[@]}"; do
    [[ $d == osd.* ]] && pids+=("${d#*:}") && kill -TERM "${d#*:}" 2>/dev/null || true
  done
  for d in "${pids[@]}"; do stop_pid "$d" 30; done
  for d in "${DAEMONS[@]}"; do stop_pid "${d#*:}" 20; done
  DAEMONS=()
}

detach_all() {
  local entry kind dev rest i
  for ((i = ${#DEVS[@]} - 1; i >= 0; i--)); do
    entry=${DEVS[i]}
    IFS=: read -r kind dev rest <<<"$entry"
    detach_one "$kind" "$dev" "$rest" || log "warning: detaching $dev failed"
  done
  DEVS=()
}

detach_one() { # detach_one KIND DEVICE EXTRA
  local kind=$1 dev=$2 extra=$3
  case $kind in
    zdisk)
      ZDISK_RUN_DIR=$WORK/run "$ZDISK" detach "$dev" >>"$WORK/attach.log" 2>&1 ;;
    raw)
      # extra = fuse_dir,nbdfuse_pid,qemu_nbd_pid  (or nbd,,qemu_nbd_pid)
      local fuse_dir nbdfuse_pid qemu_pid
      IFS=, read -r fuse_dir nbdfuse_pid qemu_pid <<<"$extra"
      if [[ $fuse_dir == nbd ]]; then
        nbd-client -d "$dev" >>"$WORK/attach.log" 2>&1 || true
      else
        losetup -d "$dev" 2>>"$WORK/attach.log" || true
        local i
        for ((i = 0; i < 100; i++)); do fusermount3 -u "$fuse_dir" 2>/dev/null && break; sleep 0.1; done
        stop_pid "$nbdfuse_pid" 30
        rmdir "$fuse_dir" 2>/dev/null || true
      fi
      stop_pid "$qemu_pid" 30 ;;
  esac
}

teardown_cluster() {
  [[ -n $CL ]] || return 0
  log "teardown: daemons, devices"
  stop_daemons
  detach_all
  CL="" CONF=""
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM ERR
  set +e
  local p
  for p in "${BG[@]}"; do stop_pid "$p" 10; done
  teardown_cluster
  if [[ -n $WORK && -d $WORK ]]; then
    if ((KEEP)); then log "kept $WORK"; else rm -rf "$WORK"; fi
  fi
  ((rc == 0)) || log "exit status $rc (everything started was torn down)"
  exit "$rc"
}

# ---------------------------------------------------------------- devices
# attach_zdisk NAME FORMAT-ARGS...: a zdisk store of logical size OSD_BYTES -> ATTACHED
ATTACHED=""
attach_zdisk() {
  local name=$1; shift
  local store=$WORK/$name.zdisk phys dev
  phys=$(awk -v l="$OSD_BYTES" -v f="$NATIVE" 'BEGIN { p = l / f; printf "%d", int(p / 4096) * 4096 }')
  [[ -n ${ZDISK_PHYS_OVERRIDE:-} ]] && phys=$ZDISK_PHYS_OVERRIDE
  # --sparse: host_disk_bytes compares what the files take, as thin as the raw images.
  "$ZDISK" format "$store" --physical-size "$phys" --logical-size "$OSD_BYTES" --force --sparse "$@" >>"$WORK/attach.log" 2>&1 \
    || die "zdisk format $store failed (see $WORK/attach.log)"
  # Freed segments go back to the host (ZDISK_DISCARD_FREED=on), so host_disk_bytes compares
  # thin zdisk files with the raw images qemu-nbd punches on discard.
  dev=$(ZDISK_DISCARD_FREED=${ZDISK_DISCARD_FREED:-on} ZDISK_RUN_DIR=$WORK/run "$ZDISK" attach "$store" 2>>"$WORK/attach.log") || die "zdisk attach $store failed (see $WORK/attach.log)"
  DEVS+=("zdisk:$dev:$store")
  ATTACHED=$dev
}

# attach_raw NAME: a raw file of OSD_BYTES behind qemu-nbd (O_DIRECT, discard passed down),
# the same transport as `zdisk attach`: the kernel NBD client if present, else nbdfuse + loop.
# The device goes to ATTACHED.
attach_raw() {
  local name=$1 qpid dev
  local file=$WORK/$name.raw sock=$WORK/run/$name.sock
  rm -f "$file"; truncate -s "$OSD_BYTES" "$file"
  # nbdfuse's connections as `zdisk attach` opens them (4 per core, 8..64), all let in.
  local conns=$(( $(nproc) * 4 )); (( conns < 8 )) && conns=8; (( conns > 64 )) && conns=64
  setsid qemu-nbd -f raw --cache=none --aio=native --discard=unmap -t -e "$conns" -k "$sock" "$file" \
    </dev/null >>"$WORK/run/$name.qemu-nbd.log" 2>&1 &
  qpid=$!
  local i
  for ((i = 0; i < 100; i++)); do [[ -S $sock ]] && break; sleep 0.1; done
  [[ -S $sock ]] || die "qemu-nbd did not create $sock"
  if ls /dev/nbd[0-9]* >/dev/null 2>&1 && command -v nbd-client >/dev/null; then
    local n
    for n in /dev/nbd*; do [[ -e /sys/block/${n#/dev/}/pid ]] || { dev=$n; break; }; done
    nbd-client -unix "$sock" "$dev" -b 4096 >>"$WORK/attach.log" 2>&1 || die "nbd-client failed"
    DEVS+=("raw:$dev:nbd,,$qpid")
  else
    local fuse_dir=$WORK/run/fuse-$name pidf=$WORK/run/fuse-$name.pid fpid
    mkdir -p "$fuse_dir"; rm -f "$pidf"
    setsid nbdfuse -C "$conns" -P "$pidf" "$fuse_dir/nbd" "nbd+unix:///?socket=$sock" </dev/null >/dev/null 2>>"$WORK/attach.log" &
    fpid=$!
    for ((i = 0; i < 300; i++)); do [[ -s $pidf ]] && break; kill -0 $fpid 2>/dev/null || break; sleep 0.1; done
    [[ -s $pidf ]] || { stop_pid "$qpid" 5; die "nbdfuse did not start (see $WORK/attach.log)"; }
    dev=$(losetup --direct-io=on -f --show "$fuse_dir/nbd" 2>/dev/null || losetup -f --show "$fuse_dir/nbd") \
      || { DEVS+=("raw:none:$fuse_dir,$fpid,$qpid"); die "losetup on $fuse_dir/nbd failed"; }
    DEVS+=("raw:$dev:$fuse_dir,$fpid,$qpid")
  fi
  ATTACHED=$dev
}

# pids of the server and the transport of a device: "server transport"
device_pids() {
  local dev=$1 entry kind d rest
  for entry in "${DEVS[@]}"; do
    IFS=: read -r kind d rest <<<"$entry"
    [[ $d == "$dev" ]] || continue
    if [[ $kind == zdisk ]]; then
      local st=$WORK/run/attach/$(basename "$dev").json uuid
      uuid=$(jq -r .uuid "$st")
      # server_pid: the process serving NBD (`zdisk serve` itself, or its nbdkit); older
      # builds wrote nbdkit_pid
      echo "$(jq -r '.server_pid // .nbdkit_pid' "$WORK/run/$uuid.serve.json") $(jq -r '.nbdfuse_pid // empty' "$st")"
    else
      local f p q; IFS=, read -r f p q <<<"$rest"; echo "$q $p"
    fi
  done
}

# ---------------------------------------------------------------- cluster
PORT_BASE=$((41000 + $$ % 2000))

# cluster_up CASE: devices for CASE, one mon, one mgr, OSDS OSDs, pool rbd (size 2), images.
cluster_up() {
  local case=$1 extra_conf=${2:-}
  CL=$WORK/cluster-$case
  rm -rf "$CL"; mkdir -p "$CL/run" "$CL/log"
  CONF=$CL/ceph.conf
  OSD_DEV=() OSD_UUID=()
  local fsid port
  fsid=$(cat /proc/sys/kernel/random/uuid)
  port=$PORT_BASE; PORT_BASE=$((PORT_BASE + 1))
  cat >"$CONF" <<EOF
[global]
fsid = $fsid
mon_host = [v2:127.0.0.1:$port]
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
run_dir = $CL/run
log_file = $CL/log/\$name.log
mon_data = $CL/\$name
mgr_data = $CL/\$name
osd_data = $CL/\$name
keyring = $CL/keyring
mon_data_avail_warn = 1
mon_data_avail_crit = 0
osd_pool_default_size = 2
osd_pool_default_min_size = 1
osd_crush_chooseleaf_type = 0
osd_pool_default_pg_autoscale_mode = off
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false
auth_allow_insecure_global_id_reclaim = false
mon_warn_on_insecure_global_id_reclaim_allowed = false
osd_objectstore = bluestore
# memory kept modest: 3 OSDs + mon + mgr fit in ~4 GiB
osd_memory_target = 1073741824
bluestore_cache_autotune = true
mon_memory_target = 268435456
# the seed's: freed BlueStore space is discarded (TRIM) on the device
bdev_enable_discard = true
bdev_async_discard = true
# compression, where a case turns it on per pool, at BlueStore's defaults (zstd level 1)
$extra_conf
[mon]
admin_socket = $CL/run/\$name.asok
[mgr]
admin_socket = $CL/run/\$name.asok
[osd]
admin_socket = $CL/run/\$name.asok
[client]
admin_socket =
EOF
  monmaptool --create --addv a "[v2:127.0.0.1:$port]" --fsid "$fsid" "$CL/monmap" >>"$CL/log/setup.log" 2>&1
  ceph-authtool --create-keyring "$CL/keyring" --gen-key -n mon. --cap mon 'allow *' >>"$CL/log/setup.log" 2>&1
  mkdir -p "$CL/mon.a" "$CL/mgr.x"
  ceph-mon -c "$CONF" --mkfs -i a --monmap "$CL/monmap" --keyring "$CL/keyring" >>"$CL/log/setup.log" 2>&1 \
    || die "ceph-mon --mkfs failed (see $CL/log/setup.log)"
  ceph-mon -c "$CONF" -i a -f >>"$CL/log/mon.a.out" 2>&1 &
  DAEMONS+=("mon.a:$!")
  ceph-mgr -c "$CONF" -i x -f >>"$CL/log/mgr.x.out" 2>&1 &
  DAEMONS+=("mgr.x:$!")
  ceph_ -s >/dev/null 2>&1 || die "the monitor did not answer (see $CL/log/mon.a.log)"

  local i dev
  for ((i = 0; i < OSDS; i++)); do
    case $case in
      zdisk*|space*|fault*) attach_zdisk "osd$i-$case" ${CASE_ZFMT:-} ;;
      *) attach_raw "osd$i-$case" ;;
    esac
    dev=$ATTACHED
    # Loop devices report rotational=1; the seed's drives are NVMe SSDs, and BlueStore picks
    # its SSD settings (compression blob sizes 8K-64K, no deferred writes of 64K) from this.
    if [[ $dev == /dev/loop* ]]; then echo 0 >"/sys/block/${dev#/dev/}/queue/rotational" || true; fi
    add_osd "$dev"
  done
  wait_for "all $OSDS OSDs up" 120 osds_up "$OSDS"
  ceph_ osd pool create rbd 32 32 replicated >>"$CL/log/setup.log" 2>&1
  ceph_ osd pool set rbd size 2 >>"$CL/log/setup.log" 2>&1
  ceph_ osd pool set rbd min_size 1 >>"$CL/log/setup.log" 2>&1
  case $case in
    bluestore-zstd) ceph_ osd pool set rbd compression_mode force >/dev/null 2>&1
                    ceph_ osd pool set rbd compression_algorithm zstd >/dev/null 2>&1 ;;
    bluestore-lz4) ceph_ osd pool set rbd compression_mode force >/dev/null 2>&1
                   ceph_ osd pool set rbd compression_algorithm lz4 >/dev/null 2>&1 ;;
  esac
  rbd_ pool init rbd >>"$CL/log/setup.log" 2>&1
  for ((i = 0; i < IMAGES; i++)); do rbd_ create --size "$((IMAGE_BYTES / 1024 / 1024))M" "rbd/img$i"; done
  wait_for "every PG active+clean" 180 pgs_clean
}

add_osd() { # add_osd DEVICE: a BlueStore OSD on DEVICE (mkfs + start)
  local dev=$1 uuid id
  uuid=$(cat /proc/sys/kernel/random/uuid)
  id=$(ceph_ osd new "$uuid") || die "ceph osd new failed"
  mkdir -p "$CL/osd.$id"
  ln -sfn "$dev" "$CL/osd.$id/block"
  ceph-osd -c "$CONF" -i "$id" --mkfs --osd-uuid "$uuid" >>"$CL/log/setup.log" 2>&1 \
    || die "ceph-osd --mkfs on $dev failed (see $CL/log/setup.log)"
  OSD_DEV[$id]=$dev OSD_UUID[$id]=$uuid
  start_osd "$id"
}

start_osd() {
  local id=$1
  ceph-osd -c "$CONF" -i "$id" -f >>"$CL/log/osd.$id.out" 2>&1 &
  DAEMONS+=("osd.$id:$!")
}

osd_pid() { local d; for d in "${DAEMONS[@]}"; do [[ ${d%%:*} == "osd.$1" ]] && echo "${d#*:}"; done; return 0; }
forget_daemon() { local d keep=(); for d in "${DAEMONS[@]}"; do [[ ${d%%:*} == "$1" ]] || keep+=("$d"); done; DAEMONS=("${keep[@]}"); }

osds_up() { [[ $(ceph_ osd stat -f json 2>/dev/null | jq -r .num_up_osds) -ge $1 ]]; }
osds_up_in() { local j; j=$(ceph_ osd stat -f json 2>/dev/null) && [[ $(jq -r .num_up_osds <<<"$j") -ge $1 && $(jq -r .num_in_osds <<<"$j") -ge $1 ]]; }
osd_is_down() { [[ $(ceph_ osd dump -f json 2>/dev/null | jq -r --argjson id "$1" '.osds[] | select(.osd == $id) | .up') == 0 ]]; }
pgs_clean() {
  local j
  j=$(ceph_ pg stat -f json 2>/dev/null) || return 1
  jq -e '.pg_summary as $s | ($s.num_pgs > 0) and ([$s.num_pg_by_state[] | select(.name == "active+clean") | .num] | add // 0) == $s.num_pgs' <<<"$j" >/dev/null
}
pgs_active() {
  local j
  j=$(ceph_ pg stat -f json 2>/dev/null) || return 1
  jq -e '.pg_summary as $s | ($s.num_pgs > 0) and ([$s.num_pg_by_state[] | select(.name | test("^active")) | .num] | add // 0) == $s.num_pgs' <<<"$j" >/dev/null
}
pg_states() { ceph_ pg stat 2>/dev/null | head -c 300; }

wait_for() { # wait_for WHAT SECONDS COMMAND...
  local what=$1 secs=$2; shift 2
  local t0=$SECONDS
  until "$@"; do
    ((SECONDS - t0 < secs)) || die "timed out after ${secs}s waiting for $what ($(pg_states))"
    sleep 1
  done
  log "  $what ($((SECONDS - t0)) s)"
}

# ---------------------------------------------------------------- measurement
ticks() { # ticks PID...: utime + stime of each whole process (all threads), summed
  local p s=0 f
  for p in "$@"; do
    [[ -r /proc/$p/stat ]] || continue
    f=$(sed 's/^.*) //' "/proc/$p/stat")
    s=$((s + $(awk '{ print $12 + $13 }' <<<"$f")))
  done
  echo "$s"
}
host_busy() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9; exit }' /proc/stat; }
# CPU of the waited-for children of process CLIENT_PID (fio, run by run_workload's shell)
child_ticks() { sed 's/^.*) //' "/proc/$CLIENT_PID/stat" | awk '{ print $14 + $15 }'; }
io_writes() { local p s=0; for p in "$@"; do [[ -r /proc/$p/io ]] && s=$((s + $(awk '/^write_bytes/ { print $2 }' "/proc/$p/io"))); done; echo "$s"; }

# group pids of the running cluster
pids_osd() { local d; for d in "${DAEMONS[@]}"; do [[ $d == osd.* ]] && echo "${d#*:}"; done; return 0; }
pids_monmgr() { local d; for d in "${DAEMONS[@]}"; do [[ $d == mon.* || $d == mgr.* ]] && echo "${d#*:}"; done; return 0; }
pids_server() { local id; for id in "${!OSD_DEV[@]}"; do set -- $(device_pids "${OSD_DEV[$id]}"); echo "$1"; done; }
pids_transport() { local id; for id in "${!OSD_DEV[@]}"; do set -- $(device_pids "${OSD_DEV[$id]}"); [[ -n ${2:-} ]] && echo "$2"; done; return 0; }

snapshot() { # one JSON object: CPU ticks per group, host busy ticks, backing bytes written, load
  local osd monmgr server transport
  osd=$(ticks $(pids_osd)) monmgr=$(ticks $(pids_monmgr))
  server=$(ticks $(pids_server)) transport=$(ticks $(pids_transport))
  jq -nc --argjson osd "$osd" --argjson monmgr "$monmgr" --argjson server "$server" \
    --argjson transport "$transport" --argjson host "$(host_busy)" \
    --argjson io "$(io_writes $(pids_server))" --argjson zw "$(zdisk_sum backing_write_bytes)" \
    --argjson t "$(date +%s.%N)" --arg load "$(cut -d' ' -f1-3 /proc/loadavg)" \
    '{t: $t, osd: $osd, monmgr: $monmgr, server: $server, transport: $transport,
      host: $host, server_write_bytes: $io, zdisk_backing_write_bytes: $zw, loadavg: $load}'
}

zdisk_stats() { # JSON array of `zdisk stat --json` of every zdisk OSD store of this cluster
  local entry kind d store out="[]"
  for entry in "${DEVS[@]}"; do
    IFS=: read -r kind d store <<<"$entry"
    [[ $kind == zdisk ]] || continue
    out=$(jq -c --argjson s "$(ZDISK_RUN_DIR=$WORK/run "$ZDISK" stat "$store" --json)" '. + [$s]' <<<"$out")
  done
  echo "$out"
}
zdisk_sum() { zdisk_stats | jq --arg k "$1" '[.[][$k]] | add // 0'; }

fio_job() { # fio_job NAME RW BS [time_based]: writes the job file, prints its path
  local name=$1 rw=$2 bs=$3 timed=${4:-} i
  local f=$OUT/fio/$name.fio
  mkdir -p "$OUT/fio"
  {
    echo "[global]"
    echo "ioengine=rbd"
    echo "clientname=admin"
    echo "pool=rbd"
    echo "direct=1"
    echo "rw=$rw"
    echo "bs=$bs"
    echo "iodepth=$QD"
    echo "buffer_compress_percentage=$PCT"
    echo "refill_buffers"
    echo "randrepeat=0"
    echo "norandommap"
    echo "group_reporting"
    echo "thread"
    if [[ -n $timed ]]; then echo "time_based"; echo "runtime=$timed"; fi
    if [[ -n ${FIO_EXTRA:-} ]]; then echo "$FIO_EXTRA"; fi
    for ((i = ${FIO_FIRST_IMAGE:-0}; i < IMAGES; i++)); do echo "[img$i]"; echo "rbdname=img$i"; done
  } >"$f"
  echo "$f"
}

# run_workload TAG NAME RW BS [runtime]: runs fio, prints one JSON result line
run_workload() {
  local tag=$1 name=$2 rw=$3 bs=$4 timed=${5:-} job out before after c0 c1
  job=$(fio_job "$tag-$name" "$rw" "$bs" "$timed")
  out=$OUT/fio/$tag-$name.json
  CLIENT_PID=$BASHPID
  before=$(snapshot)
  c0=$(child_ticks)
  CEPH_CONF=$CONF timeout $((RUNTIME + 1200)) fio "$job" --output-format=json --output="$out" >"$OUT/fio/$tag-$name.stderr" 2>&1 \
    || die "fio $name failed on $tag (see $OUT/fio/$tag-$name.stderr)"
  c1=$(child_ticks)
  after=$(snapshot)
  jq -c --arg name "$name" --argjson b "$before" --argjson a "$after" --arg fio "$out" --argjson client "$((c1 - c0))" '
    .jobs[0] as $j
    | ($j.write.io_bytes + $j.read.io_bytes) as $bytes
    | {workload: $name, fio_json: $fio,
       runtime_s: (($j.write.runtime + $j.read.runtime) / 1000 / (if $j.write.runtime > 0 and $j.read.runtime > 0 then 2 else 1 end)),
       write_bytes: $j.write.io_bytes, read_bytes: $j.read.io_bytes,
       mb_per_s: (($j.write.bw_bytes + $j.read.bw_bytes) / 1e6),
       iops: ($j.write.iops + $j.read.iops),
       p99_us: ((if $j.write.io_bytes > 0 then $j.write else $j.read end).clat_ns.percentile["99.000000"] / 1000),
       errors: $j.error,
       wall_s: ($a.t - $b.t),
       cpu_s: {osd: (($a.osd - $b.osd) / 100), monmgr: (($a.monmgr - $b.monmgr) / 100),
               server: (($a.server - $b.server) / 100), transport: (($a.transport - $b.transport) / 100),
               client: ($client / 100), host: (($a.host - $b.host) / 100)},
       server_write_bytes: ($a.server_write_bytes - $b.server_write_bytes),
       zdisk_backing_write_bytes: ($a.zdisk_backing_write_bytes - $b.zdisk_backing_write_bytes),
       loadavg_before: $b.loadavg, loadavg_after: $a.loadavg}
    | .cpu_s.named = (.cpu_s.osd + .cpu_s.monmgr + .cpu_s.server + .cpu_s.transport + .cpu_s.client)
    | .cpu_s.other = (.cpu_s.host - .cpu_s.named)' "$out"
}

space_snapshot() { # JSON: what the case's data takes, from Ceph, BlueStore, zdisk and the host
  local df perf="[]" id f du=0
  df=$(ceph_ df detail -f json)
  for id in "${!OSD_DEV[@]}"; do
    perf=$(jq -c --argjson p "$(timeout 30 ceph --admin-daemon "$CL/run/osd.$id.asok" perf dump bluestore 2>/dev/null || echo '{}')" \
      --argjson id "$id" '. + [{osd: $id} + ($p.bluestore // {} | {bluestore_allocated, bluestore_stored,
        bluestore_compressed, bluestore_compressed_allocated, bluestore_compressed_original})]' <<<"$perf")
  done
  # what the backing files hold on the host's disk (allocated blocks; both punch holes on discard)
  for f in "$WORK"/osd*-"${CURRENT_CASE}".zdisk "$WORK"/osd*-"${CURRENT_CASE}".raw; do
    [[ -e $f ]] && du=$((du + $(du --block-size=1 "$f" | cut -f1)))
  done
  jq -nc --argjson df "$df" --argjson perf "$perf" --argjson z "$(zdisk_stats)" --argjson du "$du" '
    ($df.pools[] | select(.name == "rbd") | .stats) as $p
    | {host_disk_bytes: $du,
       pool: {stored: $p.stored, bytes_used: $p.bytes_used, compress_bytes_used: $p.compress_bytes_used,
              compress_under_bytes: $p.compress_under_bytes},
       cluster_used_bytes: $df.stats.total_used_raw_bytes,
       bluestore: $perf,
       bluestore_compressed_original: ([$perf[].bluestore_compressed_original // 0] | add),
       bluestore_compressed_allocated: ([$perf[].bluestore_compressed_allocated // 0] | add),
       bluestore_allocated: ([$perf[].bluestore_allocated // 0] | add),
       zdisk: (if ($z | length) > 0 then
         {stores: ($z | map({uuid, comp_ratio, physical_size, logical_size, free_space, provisioned_cap, space_flag, backing_write_bytes, host_write_bytes})),
          physical_size: ([$z[].physical_size] | add), logical_size: ([$z[].logical_size] | add),
          free_space: ([$z[].free_space] | add),
          comp_ratio: (([$z[].logical_size] | add) / ([$z[].physical_size] | add))} else null end)}'
}

wait_stats_settle() { sleep "${1:-7}"; } # mgr pool statistics lag the OSDs by up to 5 s

host_info() {
  jq -nc --arg cpu "$(awk -F': ' '/model name/ { print $2; exit }' /proc/cpuinfo)" --argjson cores "$(nproc)" \
    --arg kernel "$(uname -r)" --arg mem "$(awk '/MemTotal/ { print $2 * 1024 }' /proc/meminfo)" \
    --arg ceph "$(ceph --version | awk '{ print $3 }')" --arg fio "$(fio --version)" \
    --arg zdisk "$("$ZDISK" --version 2>/dev/null || echo unknown)" --arg fs "$(df -T "$DIR" | awk 'NR == 2 { print $2 }')" \
    --arg nbdkit "$(nbdkit --version 2>/dev/null | head -1)" --arg git "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)" \
    '{cpu: $cpu, cores: $cores, kernel: $kernel, mem_bytes: ($mem | tonumber), ceph: $ceph, fio: $fio,
      zdisk: $zdisk, nbdkit: $nbdkit, backing_fs: $fs, git: $git}'
}

transport_info() { # how the OSD devices are attached
  local id dev dio="n/a"
  for id in "${!OSD_DEV[@]}"; do
    dev=${OSD_DEV[$id]}
    [[ -r /sys/block/${dev#/dev/}/loop/dio ]] && dio=$(cat "/sys/block/${dev#/dev/}/loop/dio")
    echo "$dev dio=$dio"
  done | jq -Rsc 'split("\n") | map(select(length > 0))'
}

setup_work() {
  check_tools
  [[ -d $DIR ]] || bad "--dir $DIR does not exist"
  WORK=$(mktemp -d "$DIR/zdisk-ceph.XXXXXX")
  mkdir -p "$WORK/run"
  OUT=${OUT:-$PWD/zdisk-ceph-$MODE-$(date +%s)}
  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)
  : >"$OUT/run.log"
  trap cleanup EXIT
  trap 'log "FAILED: line $LINENO: $BASH_COMMAND"' ERR
  trap 'log "interrupted"; exit 130' INT
  trap 'log "terminated"; exit 143' TERM
  # O_DIRECT check: zdisk and qemu-nbd --cache=none need it (tmpfs refuses).
  dd if=/dev/zero of="$WORK/.odirect" bs=4096 count=1 oflag=direct status=none 2>/dev/null \
    || bad "$DIR does not accept O_DIRECT (tmpfs?); pass --dir on a disk filesystem"
  rm -f "$WORK/.odirect"
  log "work directory $WORK, report $OUT"
}

case_zfmt() { # format options of a zdisk case
  case $1 in
    zdisk) echo "$ZFMT" ;;
    zdisk-zstd1) echo "--codec zstd:1" ;;
    *) echo "" ;;
  esac
}

# ---------------------------------------------------------------- bench
run_case() { # run_case ROUND POSITION CASE: one cluster, three workloads; prints one JSON line
  local round=$1 pos=$2 case=$3 t0=$SECONDS setup tag w r rw space
  CURRENT_CASE=$case
  CASE_ZFMT=$(case_zfmt "$case")
  log "round $round, case $case ($pos): cluster up"
  cluster_up "$case"
  setup=$((SECONDS - t0))
  tag=r$round-$case
  log "  128K sequential write QD$QD, ${IMAGES} x $IMAGE_SIZE"
  w=$(run_workload "$tag" 128k-seqwrite write 128k)
  wait_stats_settle
  space=$(space_snapshot)
  log "  128K sequential read QD$QD, ${RUNTIME}s"
  r=$(run_workload "$tag" 128k-seqread read 128k "$RUNTIME")
  log "  4K random write QD$QD, ${RUNTIME}s"
  rw=$(run_workload "$tag" 4k-randwrite randwrite 4k "$RUNTIME")
  local transport; transport=$(transport_info)
  teardown_cluster
  jq -nc --argjson round "$round" --argjson pos "$pos" --arg case "$case" --argjson setup "$setup" \
    --argjson w "$w" --argjson r "$r" --argjson rw "$rw" --argjson space "$space" --argjson tr "$transport" \
    --arg zfmt "$CASE_ZFMT" \
    '{round: $round, position: $pos, case: $case, zdisk_format: $zfmt, setup_s: $setup, devices: $tr,
      workloads: [$w, $r, $rw], space_after_write: $space}'
}

bench() {
  setup_work
  local host load0 runs="$OUT/runs.jsonl" r i n=${#CASE_LIST[@]} c
  host=$(host_info)
  load0=$(cut -d' ' -f1-3 /proc/loadavg)
  : >"$runs"
  log "bench: cases ${CASES}, $ROUNDS round(s), $OSDS OSDs of $OSD_SIZE, $IMAGES images of $IMAGE_SIZE, QD$QD, compress ${PCT}%"
  for ((r = 0; r < ROUNDS; r++)); do
    for ((i = 0; i < n; i++)); do
      c=${CASE_LIST[$(((i + r) % n))]}
      run_case "$r" "$i" "$c" >>"$runs"
    done
  done
  write_meta "$host" "$load0"
  make_report "$OUT"
  log "report: $OUT/summary.md, $OUT/report.html, $OUT/report.json"
  cat "$OUT/summary.md"
}

write_meta() { # write_meta HOST-JSON LOAD0: OUT/meta.json, what the report reads besides runs.jsonl
  jq -nc --argjson host "$1" --arg load0 "$2" --arg load1 "$(cut -d' ' -f1-3 /proc/loadavg)" \
    --argjson cfg "$(config_json)" --arg cmd "$COMMAND" --argjson wall "$SECONDS" \
    '{host: $host, load0: $load0, load1: $load1, cfg: $cfg, cmd: $cmd, wall: $wall}' >"$OUT/meta.json"
}

make_report() { # make_report OUTDIR: report.json, summary.md, report.html from runs.jsonl + meta.json
  "$ZDISK" ceph report "$1"
}

config_json() {
  jq -nc --argjson osds "$OSDS" --argjson osd_bytes "$OSD_BYTES" --argjson native "$NATIVE" \
    --arg zfmt "$ZFMT" --arg cases "$CASES" --argjson images "$IMAGES" --argjson image_bytes "$IMAGE_BYTES" \
    --argjson rounds "$ROUNDS" --argjson runtime "$RUNTIME" --argjson qd "$QD" --argjson pct "$PCT" --arg dir "$DIR" \
    '{osds: $osds, osd_bytes: $osd_bytes, zdisk_native_fraction: $native, zdisk_physical_bytes: (($osd_bytes / $native / 4096 | floor) * 4096),
      zdisk_format: $zfmt, cases: ($cases | split(",")), images: $images, image_bytes: $image_bytes, rounds: $rounds,
      runtime_s: $runtime, qd: $qd, buffer_compress_percentage: $pct, dir: $dir, pool_size: 2, pgs: 32,
      osd_memory_target: 1073741824, bdev_enable_discard: true}'
}

# ---------------------------------------------------------------- smoke (CI)
smoke() {
  setup_work
  local t0=$SECONDS w r host load0
  host=$(host_info) load0=$(cut -d' ' -f1-3 /proc/loadavg)
  log "smoke: $OSDS OSDs on zdisk ($OSD_SIZE each), pool size 2, $IMAGES image(s) of $IMAGE_SIZE"
  CURRENT_CASE=zdisk CASE_ZFMT=$ZFMT
  cluster_up zdisk
  local up=$((SECONDS - t0))
  # Write with a checksum in every block, then read it all back through Ceph and verify.
  w=$(FIO_EXTRA=$'verify=crc32c\ndo_verify=1\nverify_fatal=1\nverify_state_save=0' run_workload smoke write-verify write 128k)
  wait_stats_settle 6
  local space; space=$(space_snapshot)
  r=$(run_workload smoke 128k-seqread read 128k "$RUNTIME")
  local health; health=$(ceph_ health)
  local transport; transport=$(transport_info)
  teardown_cluster
  jq -nc --argjson w "$w" --argjson r "$r" --argjson s "$space" --arg h "$health" --argjson up "$up" --argjson wall "$SECONDS" \
    '{schema: "zdisk-ceph-smoke/1", cluster_up_s: $up, wall_s: $wall, health: $h, workloads: [$w, $r], space: $s}' >"$OUT/smoke.json"
  # The smoke as a one-round bench of the zdisk case, through the bench's report: its write
  # phase is a 128K sequential write (verified on top), the report's 128k-seqwrite; it has no
  # 4K random-write phase (those columns stay empty).
  jq -nc --argjson w "$w" --argjson r "$r" --argjson s "$space" --argjson tr "$transport" --argjson up "$up" --arg zfmt "$ZFMT" \
    '{round: 0, position: 0, case: "zdisk", zdisk_format: $zfmt, setup_s: $up, devices: $tr,
      workloads: [($w | .workload = "128k-seqwrite"), $r], space_after_write: $s}' >"$OUT/runs.jsonl"
  CASES=zdisk ROUNDS=1 write_meta "$host" "$load0"
  make_report "$OUT" || die "zdisk ceph report failed on the smoke's run"
  local ratio errs
  ratio=$(jq '.space.zdisk.comp_ratio' "$OUT/smoke.json")
  errs=$(jq '[.workloads[].errors] | add' "$OUT/smoke.json")
  log "smoke: cluster up in ${up}s, total ${SECONDS}s, health '$health', zdisk comp_ratio $ratio, fio errors $errs"
  [[ $errs == 0 ]] || die "fio reported errors"
  [[ $health == HEALTH_OK* ]] || die "cluster health was '$health', not HEALTH_OK"
  awk -v r="$ratio" 'BEGIN { exit !(r > 1.5) }' || die "zdisk comp_ratio $ratio: the ${PCT}% compressible data did not compress under Ceph"
  echo "smoke: ok"
}

SCRIPT_MODES_LOADED=1
# shellcheck source=scripts/ceph-modes.sh
source "$ROOT/scripts/ceph-modes.sh"

case $MODE in
  bench) bench ;;
  smoke) smoke ;;
  space) space ;;
  fault) fault ;;
  guard) guard ;;
  report) # re-render a bench report from its runs.jsonl and meta.json: report --out DIR
    [[ -f $OUT/runs.jsonl && -f $OUT/meta.json ]] || bad "report: --out DIR must hold runs.jsonl and meta.json of a bench run"
    make_report "$OUT"; cat "$OUT/summary.md" ;;
esac
