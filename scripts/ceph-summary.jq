# scripts/ceph-summary.jq — report.json of `scripts/ceph-demo.sh bench` -> summary.md
def f($d): if . == null then "—" else (. * pow(10; $d) | round / pow(10; $d) | tostring) end;
def pct: if . == null then "—" else (. * 100 | round | tostring) + "%" end;
def x: if . == null then "—" else (f(2) + "x") end;
def gib: if . == null then "—" else (. / 1073741824 | f(2)) + " GiB" end;
def casename: {"zdisk": "zdisk (Ceph compression off)", "zdisk-zstd1": "zdisk zstd:1 (Ceph compression off)",
            "bluestore-zstd": "raw + BlueStore zstd force", "bluestore-lz4": "raw + BlueStore lz4 force",
            "raw": "raw, no compression"}[.] // .;
def yes: if . then "**met**" else "not met" end;

. as $r
| [
  "# zdisk under Ceph: the SNIA case study side by side",
  "",
  "\($r.config.osds) BlueStore OSDs on one host, pool size 2, \($r.config.images) RBD images of \($r.config.image_bytes | gib), fio rbd engine, QD\($r.config.qd) per image, `buffer_compress_percentage=\($r.config.buffer_compress_percentage)`, \($r.config.rounds) round(s), the case order rotated each round. Each OSD device is \($r.config.osd_bytes | gib) (what Ceph sees); a zdisk store has \($r.config.zdisk_physical_bytes | gib) of physical space under it (logical = \($r.config.zdisk_native_fraction) x physical). Raw devices are sparse files behind qemu-nbd (O_DIRECT), attached through the same transport as zdisk.",
  "",
  "Host: \($r.host.cpu), \($r.host.cores) cores, kernel \($r.host.kernel), Ceph \($r.host.ceph), \($r.host.fio), zdisk \($r.host.zdisk) (\($r.host.git)), backing filesystem \($r.host.backing_fs). Load average at start \($r.loadavg_start), at end \($r.loadavg_end). Wall time \($r.wall_s) s.",
  "",
  "## Per case (mean over rounds)",
  "",
  "| case | 128K write MB/s | 128K read MB/s | 4K randwrite IOPS | CPU s/GB written (named) | CPU s/GB (host total) | host CPU busy | backing bytes / client byte | host disk used | space saved vs raw | comp ratio |",
  "|---|---|---|---|---|---|---|---|---|---|---|",
  ($r.cases[] | "| \(.case | casename) | \(.write_mb_s | f(1)) | \(.read_mb_s | f(1)) | \(.randwrite_iops | f(0)) | \(.cpu_s_per_gb.named | f(2)) | \(.cpu_s_per_gb.host | f(2)) | \(.cpu_busy_pct.host | f(0))% | \(.backing_bytes_per_client_byte | f(2)) | \(.host_disk_bytes | gib) | \(.space_saving | pct) | \(if .zdisk_comp_ratio then (.zdisk_comp_ratio | f(2)) + " (zdisk)" elif .bluestore_comp_ratio then (.bluestore_comp_ratio | f(2)) + " allocated (" + (.bluestore_compressor_ratio | f(2)) + " compressor)" else "—" end) |"),
  "",
  "Bandwidth is the client's (before 2x replication). \"named\" CPU is the Ceph daemons, the device servers (zdisk's nbdkit or qemu-nbd), the transport (nbdfuse) and fio; \"host total\" is every busy tick of the machine (/proc/stat) — it adds the kernel's loop and FUSE work and anything else running. Backing bytes are what the device servers wrote to the disk (/proc/PID/io), both replicas included. Host disk used is the allocated size of the OSD backing files after the write phase (BlueStore's RocksDB and metadata included). Space saved is against the raw case of the same round. BlueStore's ratio is original / allocated bytes of compressed blobs (what the disk holds) and, in brackets, original / compressor output.",
  "",
  "## CPU split of the 128K write phase (seconds per GB written)",
  "",
  "| case | OSD processes | mon + mgr | device servers | transport (nbdfuse) | fio (client) | kernel + other | host total |",
  "|---|---|---|---|---|---|---|---|",
  ($r.cases[] | "| \(.case | casename) | \(.cpu_s_per_gb.osd | f(2)) | \(.cpu_s_per_gb.monmgr | f(2)) | \(.cpu_s_per_gb.server | f(2)) | \(.cpu_s_per_gb.transport | f(2)) | \(.cpu_s_per_gb.client | f(2)) | \(.cpu_s_per_gb.other | f(2)) | \(.cpu_s_per_gb.host | f(2)) |"),
  "",
  "## zdisk against the others (same-round ratios, geometric mean over rounds)",
  "",
  "| zdisk case | versus | write bandwidth | read bandwidth | 4K randwrite IOPS | CPU per GB (named) | CPU per GB (host) | space saving |",
  "|---|---|---|---|---|---|---|---|",
  ($r.ratios[] | "| \(.zdisk | casename) | \(.versus | casename) | \(.write_bw.mean | x) | \(.read_bw.mean | x) | \(.randwrite_iops.mean | x) | \(.cpu_per_gb_named.mean | x) | \(.cpu_per_gb_host.mean | x) | \(.space_saving.mean | x) |"),
  "",
  "## Goals (issue 19) against BlueStore zstd force",
  "",
  "| zdisk case | write bandwidth ≥ 1.2x | CPU per GB ≤ 0.75x | space saving ≥ 0.85x of zstd's |",
  "|---|---|---|---|",
  ($r.goals[] | "| \(.zdisk | casename) | \(.write_bw.value | x): \(.write_bw.met | yes) (\(.write_bw.fraction_of_goal | pct) of the goal) | \(.cpu_per_gb.value | x) named, \(.cpu_per_gb.value_host_total | x) host: \(.cpu_per_gb.met | yes) | \(.space_saving.value | x): \(.space_saving.met | yes) |"),
  "",
  "## The seed's result (SNIA, 12 x CSD 3000, one node, 40 RBD images, QD128)",
  "",
  "| case | write GB/s | read GB/s | CPU | compression ratio |",
  "|---|---|---|---|---|",
  "| BlueStore zstd force | 6.3 | 21.1 | 93% (write) | 2.285 |",
  "| drive compression, Ceph off | 8.3 (1.32x) | 22.5 | 66.5% (write) | ~2 |",
  "",
  "## Every round",
  "",
  "| round | case | write MB/s | read MB/s | randwrite IOPS | CPU s/GB named | CPU s/GB host | space saved | load average (before write, after randwrite) |",
  "|---|---|---|---|---|---|---|---|---|",
  ($r.per_round[] | "| \(.round) | \(.case | casename) | \(.write_mb_s | f(1)) | \(.read_mb_s | f(1)) | \(.randwrite_iops | f(0)) | \(.cpu_s_per_gb.named | f(2)) | \(.cpu_s_per_gb.host | f(2)) | \(.space_saving | pct) | \(.loadavg | join(" / ")) |"),
  "",
  "Command: `\($r.command)`"
] | .[]
