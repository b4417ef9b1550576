# scripts/ceph-report.jq — turns the runs of `scripts/ceph-demo.sh bench` (one JSON object per
# case and round, slurped) into report.json (schema zdisk-ceph/1). Every ratio is taken
# between cases of the same round (side by side in time), then averaged over the rounds.
# Arguments: $host $load0 $load1 $cfg $cmd $wall.

def mean: if length == 0 then null else add / length end;
def gmean: if length == 0 or any(.[]; . == null or . <= 0) then null else (map(log) | add / length | exp) end;
def w($name): .workloads[] | select(.workload == $name);
def safe_div($a; $b): if $a == null or $b == null or $b == 0 then null else $a / $b end;

# per run: the numbers the report compares
def metrics:
  (w("128k-seqwrite")) as $w
  | (w("128k-seqread")) as $r
  | (w("4k-randwrite")) as $rw
  | ($w.write_bytes / 1e9) as $gb
  | {
      round, case,
      write_mb_s: $w.mb_per_s, read_mb_s: $r.mb_per_s, randwrite_iops: $rw.iops,
      write_p99_us: $w.p99_us, randwrite_p99_us: $rw.p99_us,
      fio_errors: ($w.errors + $r.errors + $rw.errors),
      # CPU seconds per GB the client wrote (the 128K write phase)
      cpu_s_per_gb: {named: safe_div($w.cpu_s.named; $gb), host: safe_div($w.cpu_s.host; $gb),
                     osd: safe_div($w.cpu_s.osd; $gb), server: safe_div($w.cpu_s.server; $gb),
                     transport: safe_div($w.cpu_s.transport; $gb), client: safe_div($w.cpu_s.client; $gb),
                     monmgr: safe_div($w.cpu_s.monmgr; $gb), other: safe_div($w.cpu_s.other; $gb)},
      # share of the host's two cores busy during the write phase
      cpu_busy_pct: {named: (100 * $w.cpu_s.named / $w.wall_s / $host.cores), host: (100 * $w.cpu_s.host / $w.wall_s / $host.cores)},
      randwrite_cpu_s_per_kio: safe_div($rw.cpu_s.named; $rw.iops * $rw.runtime_s / 1000),
      # bytes the device servers sent to the backing disk per byte the client wrote
      backing_bytes_per_client_byte: safe_div($w.server_write_bytes; $w.write_bytes),
      zdisk_backing_bytes_per_client_byte: (if $w.zdisk_backing_write_bytes > 0 then safe_div($w.zdisk_backing_write_bytes; $w.write_bytes) else null end),
      host_disk_bytes: .space_after_write.host_disk_bytes,
      stored_bytes: .space_after_write.pool.stored,
      zdisk_comp_ratio: .space_after_write.zdisk.comp_ratio,
      zdisk_physical_size: .space_after_write.zdisk.physical_size,
      # what BlueStore allocated for compressed blobs (4 KiB units), and what its compressor produced
      bluestore_comp_ratio: safe_div(.space_after_write.bluestore_compressed_original; .space_after_write.bluestore_compressed_allocated),
      bluestore_compressor_ratio: safe_div(.space_after_write.bluestore_compressed_original; ([.space_after_write.bluestore[].bluestore_compressed // 0] | add)),
      pool_compress_under_bytes: .space_after_write.pool.compress_under_bytes,
      pool_compress_bytes_used: .space_after_write.pool.compress_bytes_used,
      loadavg: [$w.loadavg_before, $rw.loadavg_after]
    };


. as $runs
| [ $runs[] | metrics ] as $m
| ($cfg.cases) as $cases
| [ $m[].round ] | unique as $rounds
# the same round's raw (uncompressed) footprint is the reference for space saved
| [ $m[] | . as $x
    | ([ $m[] | select(.round == $x.round and .case == "raw") ][0]) as $raw
    | . + {space_saving: (if $raw then (1 - safe_div($x.host_disk_bytes; $raw.host_disk_bytes)) else null end)} ] as $m
| def rel($a; $b; f): [ $rounds[] as $r
      | ([ $m[] | select(.round == $r and .case == $a) ][0]) as $x
      | ([ $m[] | select(.round == $r and .case == $b) ][0]) as $y
      | if $x and $y then safe_div($x | f; $y | f) else empty end ];
  def summary($name; $vals): {($name): {mean: ($vals | gmean), per_round: $vals}};
  [ $cases[] as $c
    | [ $m[] | select(.case == $c) ] as $rs
    | {case: $c, rounds: ($rs | length),
       write_mb_s: ([$rs[].write_mb_s] | mean), read_mb_s: ([$rs[].read_mb_s] | mean),
       randwrite_iops: ([$rs[].randwrite_iops] | mean),
       write_p99_us: ([$rs[].write_p99_us] | mean), randwrite_p99_us: ([$rs[].randwrite_p99_us] | mean),
       cpu_s_per_gb: ($rs[0].cpu_s_per_gb | keys | map({(.): ([$rs[].cpu_s_per_gb[.]] | map(select(. != null)) | mean)}) | add),
       cpu_busy_pct: {named: ([$rs[].cpu_busy_pct.named] | mean), host: ([$rs[].cpu_busy_pct.host] | mean)},
       randwrite_cpu_s_per_kio: ([$rs[].randwrite_cpu_s_per_kio] | mean),
       backing_bytes_per_client_byte: ([$rs[].backing_bytes_per_client_byte] | mean),
       zdisk_backing_bytes_per_client_byte: ([$rs[].zdisk_backing_bytes_per_client_byte | select(. != null)] | mean),
       host_disk_bytes: ([$rs[].host_disk_bytes] | mean),
       space_saving: ([$rs[].space_saving | select(. != null)] | mean),
       zdisk_comp_ratio: ([$rs[].zdisk_comp_ratio | select(. != null)] | mean),
       zdisk_physical_size: ([$rs[].zdisk_physical_size | select(. != null)] | mean),
       bluestore_comp_ratio: ([$rs[].bluestore_comp_ratio | select(. != null)] | mean),
       bluestore_compressor_ratio: ([$rs[].bluestore_compressor_ratio | select(. != null)] | mean),
       fio_errors: ([$rs[].fio_errors] | add)} ] as $cs
| {
    schema: "zdisk-ceph/1",
    command: $cmd, wall_s: $wall, config: $cfg, host: $host,
    loadavg_start: $load0, loadavg_end: $load1,
    cases: $cs,
    # zdisk (each codec) against BlueStore zstd force and against raw, per round, geometric mean
    ratios: ([ ("zdisk", "zdisk-zstd1") as $z | select($cases | index($z))
      | ("bluestore-zstd", "bluestore-lz4", "raw") as $b | select($cases | index($b))
      | {zdisk: $z, versus: $b}
        + summary("write_bw"; rel($z; $b; .write_mb_s))
        + summary("read_bw"; rel($z; $b; .read_mb_s))
        + summary("randwrite_iops"; rel($z; $b; .randwrite_iops))
        + summary("cpu_per_gb_named"; rel($z; $b; .cpu_s_per_gb.named))
        + summary("cpu_per_gb_host"; rel($z; $b; .cpu_s_per_gb.host))
        + summary("space_saving"; rel($z; $b; .space_saving)) ]),
    goals: ([ ("zdisk", "zdisk-zstd1") as $z | select(($cases | index($z)) and ($cases | index("bluestore-zstd")))
      | (rel($z; "bluestore-zstd"; .write_mb_s) | gmean) as $bw
      | (rel($z; "bluestore-zstd"; .cpu_s_per_gb.named) | gmean) as $cpu
      | (rel($z; "bluestore-zstd"; .cpu_s_per_gb.host) | gmean) as $cpuh
      | (rel($z; "bluestore-zstd"; .space_saving) | gmean) as $sp
      | {zdisk: $z,
         write_bw: {goal: ">= 1.2x BlueStore zstd force", value: $bw, met: ($bw != null and $bw >= 1.2), fraction_of_goal: safe_div($bw; 1.2)},
         cpu_per_gb: {goal: "<= 0.75x BlueStore zstd force (25% less)", value: $cpu, value_host_total: $cpuh,
                      met: ($cpu != null and $cpu <= 0.75), saving: (if $cpu then 1 - $cpu else null end)},
         space_saving: {goal: ">= 0.85x BlueStore zstd's saving (within 15%)", value: $sp, met: ($sp != null and $sp >= 0.85)}} ]),
    per_round: $m,
    runs: $runs
  }
