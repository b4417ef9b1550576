# scripts/ceph-modes.sh — the `space`, `fault` and `guard` modes of scripts/ceph-demo.sh
# (sourced by it; uses its cluster, device and measurement functions). See docs/ceph.md.
# shellcheck shell=bash

[[ -n ${SCRIPT_MODES_LOADED:-} ]] || { echo "source scripts/ceph-modes.sh from scripts/ceph-demo.sh" >&2; exit 2; }

# ---------------------------------------------------------------- helpers shared by the modes
zsum() { zdisk_stats | jq --arg k "$1" '[.[][$k]] | add // 0'; }
# physical utilisation of each zdisk store: used / (used + free)
zdisk_phys_util() { zdisk_stats | jq -c 'map(.physical_size / (.physical_size + .free_space))'; }

# fio_bg NAME RW BS SECONDS [extra options...]: a background fio on the images, pid -> BG_PID
fio_bg() {
  local name=$1 rw=$2 bs=$3 secs=$4; shift 4
  local job
  job=$(fio_job "$name" "$rw" "$bs" "$secs")
  local o
  for o in "$@"; do sed -i "s/^group_reporting$/group_reporting\n$o/" "$job"; done
  CEPH_CONF=$CONF fio "$job" --output-format=json --output="$OUT/fio/$name.json" >"$OUT/fio/$name.stderr" 2>&1 &
  BG_PID=$!
  BG+=("$BG_PID")
}
bg_wait() { # bg_wait PID SECONDS: waits for a background fio; SIGINT, then KILL after the deadline
  local pid=$1 secs=$2 t0=$SECONDS rc=0
  while kill -0 "$pid" 2>/dev/null && ((SECONDS - t0 < secs)); do sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then
    log "  fio pid $pid still running after ${secs}s (blocked I/O): stopping it"
    kill -INT "$pid" 2>/dev/null; sleep 5; kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || rc=$?
  return "$rc"
}
osd_log_excerpt() { # the lines of an OSD's log that tell why it stopped
  grep -a -E 'abort|Abort|error|Error|EIO|ENOSPC|No space|Input/output|assert|FAILED|full' "$CL/log/osd.$1.log" 2>/dev/null \
    | grep -v -E 'Options\.|register_command|_fsck_on_open|set_numa_affinity|bluestore\(.*\) _open_fsid|log_to_monitors' | tail -n "${2:-12}" || true
}
health() { ceph_ health 2>/dev/null | head -c 400; }

# replace the device of OSD ID (after its server died): detach, check the store, attach again
reattach_osd() {
  local id=$1 old=${OSD_DEV[$1]} entry kind d store keep=() found=""
  for entry in "${DEVS[@]}"; do
    IFS=: read -r kind d store <<<"$entry"
    if [[ $d == "$old" ]]; then found=$store; else keep+=("$entry"); fi
  done
  [[ -n $found ]] || die "no zdisk store behind $old"
  detach_one zdisk "$old" "$found" || log "  warning: zdisk detach $old reported an error (its server was dead)"
  DEVS=("${keep[@]}")
  log "  zdisk check $found"
  ZDISK_RUN_DIR=$WORK/run "$ZDISK" check "$found" --json >"$OUT/check-osd$id.json" 2>>"$WORK/attach.log" \
    || die "zdisk check found damage in $found after its server was killed (see $OUT/check-osd$id.json)"
  local dev
  dev=$(ZDISK_RUN_DIR=$WORK/run "$ZDISK" attach "$found" 2>>"$WORK/attach.log") || die "zdisk attach $found failed"
  DEVS+=("zdisk:$dev:$found")
  [[ $dev == /dev/loop* ]] && { echo 0 >"/sys/block/${dev#/dev/}/queue/rotational" || true; }
  OSD_DEV[$id]=$dev
  ln -sfn "$dev" "$CL/osd.$id/block"
  log "  osd.$id now on $dev"
}

# ---------------------------------------------------------------- fault
fault() {
  setup_work
  [[ -n $SEED ]] || SEED=$(( $(date +%s%N) % 1000000 ))
  RANDOM=$SEED
  local victim=$((RANDOM % OSDS)) delay=$((3 + RANDOM % 8))
  log "fault: seed $SEED (rerun with --seed $SEED): kill the zdisk server under osd.$victim ${delay}s into a 4K random-write load"
  CURRENT_CASE=fault CASE_ZFMT=$ZFMT
  cluster_up fault "mon_osd_down_out_interval = 15
osd_scrub_during_recovery = true"
  local t_start; t_start=$(date +%s)
  # 1. reference data: every 128K block carries a crc32c, verified after writing
  log "  reference data on img0 (fio verify=crc32c)"
  local job=$OUT/fio/fault-ref.fio
  fio_job fault-ref write 128k >/dev/null
  sed -i -e 's/^group_reporting$/group_reporting\nverify=crc32c\ndo_verify=1\nverify_fatal=1\nverify_state_save=0/' \
    -e '/^\[img[1-9][0-9]*\]$/,$d' "$job"
  CEPH_CONF=$CONF fio "$job" --output-format=json --output="$OUT/fio/fault-ref.json" >"$OUT/fio/fault-ref.stderr" 2>&1 \
    || die "writing the reference data failed (see $OUT/fio/fault-ref.stderr)"
  # 2. a client load running through the fault, on the other images
  local load_secs=$((delay + 90))
  FIO_FIRST_IMAGE=1 fio_bg fault-load randwrite 4k "$load_secs"
  local load_pid=$BG_PID
  sleep "$delay"
  # 3. kill the server
  local server; server=$(device_pids "${OSD_DEV[$victim]}" | cut -d' ' -f1)
  local opid; opid=$(osd_pid "$victim")
  log "  kill -9 zdisk's server (pid $server) under osd.$victim (pid $opid, ${OSD_DEV[$victim]})"
  local t_kill=$SECONDS
  kill -KILL "$server"
  # 4. the OSD must stop (BlueStore treats an I/O error from its device as fatal) and Ceph
  #    must mark it down
  local t=$SECONDS osd_exit="still running"
  while ((SECONDS - t < 120)); do
    if ! kill -0 "$opid" 2>/dev/null; then
      wait "$opid" 2>/dev/null && osd_exit=0 || osd_exit=$?
      break
    fi
    sleep 0.5
  done
  local t_exit=$((SECONDS - t_kill))
  forget_daemon "osd.$victim"
  [[ $osd_exit != "still running" ]] || { log "  osd.$victim still runs 120 s after its device died: stopping it"; stop_pid "$opid" 10; }
  wait_for "osd.$victim marked down" 120 osd_is_down "$victim"
  local t_down=$((SECONDS - t_kill))
  local excerpt; excerpt=$(osd_log_excerpt "$victim")
  log "  osd.$victim exited with status $osd_exit after ${t_exit}s; marked down after ${t_down}s"
  printf '%s\n' "$excerpt" | sed 's/^/    | /' >&2
  # 5. recovery from the replica onto the remaining OSDs (the dead one is marked out after 15 s)
  wait_for "PGs active+clean on the remaining OSDs (recovered from the replicas)" 900 pgs_clean
  local t_recovered=$((SECONDS - t_kill)) h_recovered; h_recovered=$(health)
  local load_rc=0
  bg_wait "$load_pid" $((load_secs + 120)) || load_rc=$?
  local load_err; load_err=$(jq '.jobs[0].error' "$OUT/fio/fault-load.json" 2>/dev/null || echo "no result")
  log "  client load during the fault: fio exit $load_rc, error $load_err"
  # 6. restart zdisk and the OSD; Ceph backfills onto it
  reattach_osd "$victim"
  start_osd "$victim"
  wait_for "osd.$victim up" 120 osds_up "$OSDS"
  ceph_ osd in "$victim" >/dev/null 2>&1 || true
  wait_for "all OSDs up and in" 60 osds_up_in "$OSDS"
  sleep 3
  wait_for "PGs active+clean after backfill" 900 pgs_clean
  local t_backfilled=$((SECONDS - t_kill))
  # 7. deep-scrub every PG, then: no inconsistent PG, HEALTH_OK, the reference data verifies
  log "  deep-scrub of every PG"
  local scrub0; scrub0=$(date -u +%Y-%m-%dT%H:%M:%S)
  wait_for "every PG deep-scrubbed" 900 deep_scrub_all_since "$scrub0"
  local inconsistent; inconsistent=$(timeout 60 rados -c "$CONF" list-inconsistent-pg rbd)
  local h_final; h_final=$(health)
  wait_for "HEALTH_OK" 120 health_ok
  h_final=$(health)
  sed -i 's/^do_verify=1$/do_verify=1\nverify_only=1/' "$job"
  local verify_rc=0
  CEPH_CONF=$CONF fio "$job" --output-format=json --output="$OUT/fio/fault-verify.json" >"$OUT/fio/fault-verify.stderr" 2>&1 || verify_rc=$?
  local verify_err; verify_err=$(jq '.jobs[0].error' "$OUT/fio/fault-verify.json" 2>/dev/null || echo "no result")
  teardown_cluster
  jq -n --argjson seed "$SEED" --argjson victim "$victim" --argjson delay "$delay" --arg osd_exit "$osd_exit" \
    --argjson t_exit "$t_exit" --argjson t_down "$t_down" --argjson t_rec "$t_recovered" --argjson t_back "$t_backfilled" \
    --arg excerpt "$excerpt" --arg h_rec "$h_recovered" --arg h_final "$h_final" --arg inconsistent "$inconsistent" \
    --argjson load_rc "$load_rc" --arg load_err "$load_err" --argjson verify_rc "$verify_rc" --arg verify_err "$verify_err" \
    --argjson check "$(cat "$OUT/check-osd$victim.json")" --arg cmd "$COMMAND" --argjson wall "$SECONDS" \
    '{schema: "zdisk-ceph-fault/1", command: $cmd, seed: $seed, victim_osd: $victim, kill_after_s: $delay,
      osd_exit_status: $osd_exit, osd_exit_after_s: $t_exit, marked_down_after_s: $t_down,
      recovered_after_s: $t_rec, health_after_recovery: $h_rec, backfilled_after_s: $t_back,
      osd_log: ($excerpt | split("\n")), client_load: {fio_exit: $load_rc, fio_error: $load_err},
      zdisk_check_after_kill: $check, inconsistent_pgs: ($inconsistent | fromjson? // $inconsistent),
      health_final: $h_final, reference_verify: {fio_exit: $verify_rc, fio_error: $verify_err}, wall_s: $wall}' >"$OUT/fault.json"
  log "fault: osd.$victim exit '$osd_exit' after ${t_exit}s, down after ${t_down}s, recovered after ${t_recovered}s, backfilled after ${t_backfilled}s"
  log "fault: inconsistent PGs $inconsistent, final health '$h_final', reference data verify: fio exit $verify_rc, error $verify_err"
  [[ $osd_exit != "still running" ]] || die "the OSD did not stop when its device failed"
  [[ $(jq -r .clean "$OUT/check-osd$victim.json") == true ]] || die "zdisk check after the kill was not clean"
  [[ $inconsistent == "[]" ]] || die "inconsistent PGs after scrub: $inconsistent"
  [[ $h_final == HEALTH_OK* ]] || die "final health '$h_final'"
  [[ $verify_rc == 0 && $verify_err == 0 ]] || die "the reference data did not verify after recovery and backfill"
  echo "fault: ok (seed $SEED)"
}

health_ok() { [[ $(health) == HEALTH_OK* ]]; }
# true once every PG's last deep scrub is at or after $1 (UTC, ISO); asks (again, every 30 s:
# an OSD may drop a scrub request while it is busy) for a deep scrub of each PG not there yet
LAST_SCRUB_ASK=0
deep_scrub_all_since() {
  local j pg
  j=$(ceph_ pg ls -f json 2>/dev/null) || return 1
  jq -e --arg t "$1" '[.pg_stats[] | .last_deep_scrub_stamp[0:19] >= $t] | all' <<<"$j" >/dev/null && return 0
  if ((SECONDS - LAST_SCRUB_ASK >= 30)); then
    LAST_SCRUB_ASK=$SECONDS
    for pg in $(jq -r --arg t "$1" '.pg_stats[] | select(.last_deep_scrub_stamp[0:19] < $t) | .pgid' <<<"$j"); do
      ceph_ pg deep-scrub "$pg" >/dev/null 2>&1 || true
    done
  fi
  return 1
}

# ---------------------------------------------------------------- space
space() {
  setup_work
  local res=$OUT/space.json
  echo '{}' >"$res"
  put() { jq --argjson v "$2" ".$1 = \$v" "$res" >"$res.tmp" && mv "$res.tmp" "$res"; }

  # A. discard: deleting an RBD image gives zdisk its physical space back (and does not
  #    without bdev_enable_discard)
  local disc parts=${SPACE_PARTS:-A,B,C}
  for disc in true false; do
    [[ $parts == *A* ]] || break
    CURRENT_CASE=space-discard-$disc CASE_ZFMT=$ZFMT
    log "space A: discard $disc: write ${IMAGES} x $IMAGE_SIZE, delete the images, watch zdisk's free_space"
    cluster_up "space-discard-$disc" "bdev_enable_discard = $disc"
    local f0 f1 f2 p0 p1 p2 t0 tl="[]"
    f0=$(zsum free_space) p0=$(zsum physical_size)
    run_workload "space-d$disc" fill write 128k >/dev/null
    sleep 3
    f1=$(zsum free_space) p1=$(zsum physical_size)
    local i
    for ((i = 0; i < IMAGES; i++)); do rbd_ rm "rbd/img$i" >/dev/null 2>&1; done
    t0=$SECONDS
    while ((SECONDS - t0 < 60)); do
      sleep 2
      p2=$(zsum physical_size) f2=$(zsum free_space)
      tl=$(jq -c --argjson t $((SECONDS - t0)) --argjson p "$p2" --argjson f "$f2" '. + [{t_s: $t, physical_size: $p, free_space: $f}]' <<<"$tl")
      # back within 10% of what the fill took: done
      (( (p2 - p0) * 10 < (p1 - p0) )) && break
    done
    log "  free_space: before $f0, after the fill $f1, $((SECONDS - t0))s after deleting $f2 (physical_size $p0 -> $p1 -> $p2)"
    put "discard_$disc" "$(jq -nc --argjson f0 "$f0" --argjson f1 "$f1" --argjson f2 "$f2" --argjson p0 "$p0" --argjson p1 "$p1" \
      --argjson p2 "$p2" --argjson tl "$tl" \
      '{free_space: {before: $f0, after_fill: $f1, after_delete: $f2}, physical_size: {before: $p0, after_fill: $p1, after_delete: $p2},
        returned_fraction: (if $p1 > $p0 then ($p1 - $p2) / ($p1 - $p0) else null end), timeline: $tl}')"
    teardown_cluster
  done

  # B/C. extended capacity: logical 3x physical, incompressible data, until the physical space
  #      runs out — first as it is (B), then with the guard wiring zdisk's physical fullness
  #      to Ceph's nearfull/backfillfull/full ratios (C)
  local with_guard
  for with_guard in no yes; do
    [[ $with_guard == no && $parts != *B* ]] && continue
    [[ $with_guard == yes && $parts != *C* ]] && continue
    CURRENT_CASE=space-x3-guard-$with_guard CASE_ZFMT=$ZFMT
    local phys=$(( OSD_BYTES / 3 / 4096 * 4096 ))
    log "space $([[ $with_guard == no ]] && echo B || echo C): OSDs of $OSD_SIZE on zdisk stores of $((phys / 1048576)) MiB physical (3x), incompressible data, guard: $with_guard"
    # The operator's ratios for this demo leave 20% between "full" and the end of the device:
    # the guard reacts within its interval plus Ceph's report interval (~5 s), and these
    # stores are small (see docs/ceph.md for the arithmetic on real drives).
    ZDISK_PHYS_OVERRIDE=$phys cluster_up "space-x3-guard-$with_guard" "mon_osd_full_ratio = 0.80
mon_osd_backfillfull_ratio = 0.75
mon_osd_nearfull_ratio = 0.70"
    local gpid="" stores=() id
    if [[ $with_guard == yes ]]; then
      for id in "${!OSD_DEV[@]}"; do stores+=(--osd-store "$id=$(store_of "${OSD_DEV[$id]}")"); done
      ZDISK_RUN_DIR=$WORK/run bash "$0" guard --conf "$CONF" "${stores[@]}" --interval 1 --zdisk "$ZDISK" >"$OUT/guard.log" 2>&1 &
      gpid=$!; BG+=("$gpid")
    fi
    # the images hold 2x the physical space of the whole cluster in client bytes
    local need=$(( phys * OSDS ))
    local per=$(( need / IMAGES / 1048576 ))
    local i
    for ((i = 0; i < IMAGES; i++)); do rbd_ resize --size "${per}M" "rbd/img$i" >/dev/null 2>&1 || true; done
    local old_pct=$PCT; PCT=0
    # a fill rate the guard can follow on stores this small: each OSD fills at ~1/3 of
    # 2 x IMAGES x rate (see docs/ceph.md)
    fio_bg "space-x3-$with_guard" write 128k 600 "rate=${SPACE_RATE:-8m}"
    PCT=$old_pct
    local fpid=$BG_PID t0=$SECONDS tl="[]" dead=() st
    # watch: zdisk physical utilisation, Ceph's view, OSD processes
    while kill -0 "$fpid" 2>/dev/null && ((SECONDS - t0 < 600)); do
      sleep 2
      st=$(jq -nc --argjson t $((SECONDS - t0)) --argjson pu "$(zdisk_phys_util)" \
        --argjson osd "$(ceph_ osd df -f json 2>/dev/null | jq -c '[.nodes[] | {id, utilization}]' || echo null)" \
        --argjson flags "$(zdisk_stats | jq -c 'map(.space_flag)')" --arg h "$(health | head -c 200)" \
        --argjson up "$(ceph_ osd stat -f json 2>/dev/null | jq .num_up_osds || echo null)" \
        '{t_s: $t, zdisk_phys_util: $pu, zdisk_space_flag: $flags, ceph_osd_util_pct: $osd, osds_up: $up, health: $h}')
      tl=$(jq -c --argjson s "$st" '. + [$s]' <<<"$tl")
      log "  $(jq -r '"t=\(.t_s)s zdisk physical \(.zdisk_phys_util | map(. * 100 | floor | tostring + "%") | join(" ")), flags \(.zdisk_space_flag), Ceph %USE \(.ceph_osd_util_pct // [] | map(.utilization | floor | tostring + "%") | join(" ")), up \(.osds_up), \(.health)"' <<<"$st")"
      for id in "${!OSD_DEV[@]}"; do
        local p; p=$(osd_pid "$id")
        if [[ -n $p ]] && ! kill -0 "$p" 2>/dev/null; then dead+=("$id"); forget_daemon "osd.$id"; log "  osd.$id exited"; fi
      done
      # stop once the writes are blocked or failed for good: an OSD died, or nothing moves for 30 s
      if ((${#dead[@]})) && ((SECONDS - t0 > 20)); then sleep 15; break; fi
      if [[ $with_guard == yes ]] && health | grep -q -E '[0-9]+ full osd|pool\(s\) full'; then
        log "  Ceph reports full: waiting 30 s to see that no OSD fails"; GUARD_FULL_AT=$((SECONDS - t0)); sleep 30; break
      fi
    done
    # the state once the writes stopped (blocked by Ceph, or failed): did the physical space hold?
    st=$(jq -nc --argjson t $((SECONDS - t0)) --argjson pu "$(zdisk_phys_util)" --argjson flags "$(zdisk_stats | jq -c 'map(.space_flag)')" \
      --arg h "$(health | head -c 200)" '{t_s: $t, zdisk_phys_util: $pu, zdisk_space_flag: $flags, health: $h, final: true}')
    tl=$(jq -c --argjson s "$st" '. + [$s]' <<<"$tl")
    log "  final: $st"
    local rc=0; bg_wait "$fpid" 5 || rc=$?
    local fio_err; fio_err=$(jq '.jobs[0].error' "$OUT/fio/space-x3-$with_guard.json" 2>/dev/null || echo "null")
    local excerpts="{}"
    for id in "${!OSD_DEV[@]}"; do
      excerpts=$(jq -c --arg id "osd.$id" --arg e "$(osd_log_excerpt "$id" 8)" '. + {($id): ($e | split("\n"))}' <<<"$excerpts")
    done
    local hd; hd=$(ceph_ health detail 2>/dev/null | head -c 2000)
    # C: can the operator get out? delete an image, wait for discards, see the guard lift the flags
    local after_delete=null
    if [[ $with_guard == yes ]]; then
      # Pacific's `rbd rm` first moves the image to the trash (an omap write), which a full
      # pool refuses with ENOSPC; Ceph's runbook for a full cluster is to lift the full ratio
      # for the delete. With the writers stopped, stopping the guard does that (it restores
      # the operator's ratios), then the guard starts again.
      stop_pid "$gpid" 10
      log "  guard stopped (operator's ratios restored): $(health | head -c 120)"
      # the stopped fio's watch on the image expires after 30 s; until then rbd rm refuses
      log "  deleting img0 to free space"
      local t1=$SECONDS deleted=no
      while ((SECONDS - t1 < 180)); do
        if timeout 120 rbd -c "$CONF" rm rbd/img0 >>"$OUT/rbd-rm.log" 2>&1; then deleted=yes; break; fi
        sleep 5
      done
      log "  img0 deleted: $deleted ($((SECONDS - t1)) s)"
      sleep 15
      ZDISK_RUN_DIR=$WORK/run bash "$0" guard --conf "$CONF" "${stores[@]}" --interval 1 --zdisk "$ZDISK" >>"$OUT/guard.log" 2>&1 &
      gpid=$!; BG+=("$gpid")
      sleep 15
      after_delete=$(jq -nc --argjson pu "$(zdisk_phys_util)" --arg h "$(health)" --arg d "$deleted" --argjson s $((SECONDS - t1)) \
        '{deleted: $d, seconds: $s, zdisk_phys_util: $pu, health_with_guard_running: $h}')
      log "  after the delete, guard running again: $after_delete"
      stop_pid "$gpid" 10
    fi
    # B: does a crashed OSD come back?
    local restart=null
    if [[ $with_guard == no && ${#dead[@]} -gt 0 ]]; then
      id=${dead[0]}
      log "  restarting osd.$id on its full zdisk store"
      start_osd "$id"; sleep 20
      local p; p=$(osd_pid "$id")
      if kill -0 "$p" 2>/dev/null; then restart='"running 20 s after restart"'; else restart='"exited again"'; forget_daemon "osd.$id"; fi
      restart=$(jq -nc --argjson r "$restart" --arg e "$(osd_log_excerpt "$id" 6)" '{result: $r, log: ($e | split("\n"))}')
      log "  restart: $restart"
    fi
    put "extended_guard_$with_guard" "$(jq -nc --argjson tl "$tl" --argjson dead "$(printf '%s\n' "${dead[@]}" | jq -R 'select(length > 0) | tonumber' | jq -sc .)" \
      --argjson rc "$rc" --arg fe "$fio_err" --argjson ex "$excerpts" --arg hd "$hd" --argjson ad "$after_delete" --argjson rs "$restart" \
      --argjson phys "$phys" --argjson logical "$OSD_BYTES" \
      '{physical_bytes: $phys, logical_bytes: $logical, osds_died: $dead, fio_exit: $rc, fio_error: $fe, timeline: $tl,
        osd_logs: $ex, health_detail: $hd, after_delete: $ad, restart: $rs}')"
    teardown_cluster
  done
  jq --arg cmd "$COMMAND" '. + {schema: "zdisk-ceph-space/1", command: $cmd}' "$res" >"$res.tmp" && mv "$res.tmp" "$res"
  log "space: results in $res"
  jq -r '"discard on: \(.discard_true.returned_fraction) of the fill returned; off: \(.discard_false.returned_fraction)",
         "3x without guard: OSDs died \(.extended_guard_no.osds_died), fio error \(.extended_guard_no.fio_error)",
         "3x with guard: OSDs died \(.extended_guard_yes.osds_died), fio error \(.extended_guard_yes.fio_error)"' "$res"
}

store_of() { local entry kind d s; for entry in "${DEVS[@]}"; do IFS=: read -r kind d s <<<"$entry"; [[ $d == "$1" ]] && echo "$s"; done; return 0; }

# ---------------------------------------------------------------- guard
# Ceph sizes an OSD by its device's logical size; on a zdisk store with a capacity multiplier
# the physical space can run out first. The guard scales Ceph's own nearfull / backfillfull /
# full ratios by the worst OSD's (Ceph-visible utilisation / zdisk physical utilisation), so
# that Ceph's machinery — HEALTH_WARN at nearfull, no backfill into backfillfull OSDs, writes
# blocked at full, deletes still allowed — acts when the *physical* space reaches the ratio.
guard() {
  check_tools
  [[ -n $GUARD_CONF && -f $GUARD_CONF ]] || bad "guard: --conf CEPH_CONF is required"
  ((${#GUARD_STORES[@]})) || bad "guard: give --osd-store ID=STORE for every OSD on zdisk"
  CONF=$GUARD_CONF
  local base applied=1 spec id store
  base=$(ceph_ osd dump -f json | jq -c '{full: .full_ratio, backfillfull: .backfillfull_ratio, nearfull: .nearfull_ratio}')
  echo "guard: operator's ratios $base; watching ${#GUARD_STORES[@]} OSD(s) every ${GUARD_INTERVAL}s"
  trap 'restore_ratios "$base"; exit 0' INT TERM
  while :; do
    local util factor=1 maxpu=0 line=""
    util=$(ceph_ osd df -f json 2>/dev/null | jq -c '[.nodes[] | {key: (.id | tostring), value: (.utilization / 100)}] | from_entries') || { sleep "$GUARD_INTERVAL"; continue; }
    for spec in "${GUARD_STORES[@]}"; do
      id=${spec%%=*} store=${spec#*=}
      local s pu lu flag
      s=$("$ZDISK" stat "$store" --json 2>/dev/null) || continue
      pu=$(jq '.physical_size / (.physical_size + .free_space)' <<<"$s")
      flag=$(jq .space_flag <<<"$s")
      lu=$(jq --arg id "$id" '.[$id] // 0' <<<"$util")
      line+=" osd.$id physical $(awk -v v="$pu" 'BEGIN { printf "%.1f%%", v * 100 }') ceph $(awk -v v="$lu" 'BEGIN { printf "%.1f%%", v * 100 }') flag $flag;"
      maxpu=$(awk -v m="$maxpu" -v p="$pu" 'BEGIN { print (p > m) ? p : m }')
      # only where the physical space fills faster than Ceph thinks, and past the noise
      factor=$(awk -v f="$factor" -v p="$pu" -v l="$lu" 'BEGIN { if (p > 0.05 && p > l && l > 0) { r = l / p; if (r < f) f = r }; if (f < 0.05) f = 0.05; printf "%.4f", f }')
    done
    # lower at once; raise only after space was freed (every OSD well below nearfull
    # physically), because Ceph's own utilisation lags the device by the mgr's report period
    if awk -v a="$applied" -v b="$factor" -v m="$maxpu" -v n="$(jq .nearfull <<<"$base")" \
      'BEGIN { exit !(b < a - 0.01 || (b > a + 0.01 && m < 0.9 * n)) }'; then
      set_ratios "$base" "$factor"
      echo "$(date +%T) guard:$line ratios x$factor"
      applied=$factor
    fi
    sleep "$GUARD_INTERVAL"
  done
}

set_ratios() { # set_ratios BASE-JSON FACTOR: lower/raise in an order that keeps near < backfill < full
  local base=$1 k=$2 n b f
  n=$(jq --argjson k "$k" '.nearfull * $k' <<<"$base") b=$(jq --argjson k "$k" '.backfillfull * $k' <<<"$base") f=$(jq --argjson k "$k" '.full * $k' <<<"$base")
  local cur; cur=$(ceph_ osd dump -f json | jq .full_ratio)
  if awk -v f="$f" -v c="$cur" 'BEGIN { exit !(f < c) }'; then
    ceph_ osd set-nearfull-ratio "$n" >/dev/null; ceph_ osd set-backfillfull-ratio "$b" >/dev/null; ceph_ osd set-full-ratio "$f" >/dev/null
  else
    ceph_ osd set-full-ratio "$f" >/dev/null; ceph_ osd set-backfillfull-ratio "$b" >/dev/null; ceph_ osd set-nearfull-ratio "$n" >/dev/null
  fi
}
restore_ratios() { set_ratios "$1" 1; echo "guard: ratios restored to $1"; }
