#!/usr/bin/env bash
# Builds the real-data corpora of the codec benchmark (docs/space.md, "Codec choice"):
#
#   text-lines.bin      64 MiB of lines from the changelogs and copyright files under
#                       /usr/share/doc (.gz ones gunzipped), blank lines dropped, shuffled with
#                       a fixed seed (not de-duplicated: repeated changelog phrases are real).
#   real-files.bin      the first 256 MiB of zdisk bench's real-data stream
#                       (crates/bench/src/corpus.rs: regular files under /usr/share and /usr/lib,
#                       sorted walk, the two trees interleaved file by file, concatenated).
#   db-tablespace.ibd   MariaDB sbtest*.ibd files of the "modified schema" (sysbench plus two
#                       text columns, crates/apps/src/zdisk_oltp.lua, as `zdisk db bench` loads
#                       it), after a write_only run, concatenated (16 KiB pages, 4 KiB aligned).
#   vm-image.raw        a 2 GiB ext4 image (qemu-img + mke2fs -d) holding a debootstrap'd
#                       Debian bookworm root (minbase plus a kernel and an SSH server).
#   MANIFEST            sizes, sha256, seeds and how each file was made.
#
# Usage: scripts/codec-corpora.sh [OUTDIR]        (default /var/tmp/zdisk-corpora; run as root)
# Env:   CORPUS_SEED (default 20)  STEPS="text real db vm" (subset to build)  FORCE=1 (rebuild)
#        DB_TABLES (4) DB_ROWS (150000) DB_RUN_SECONDS (300) DB_THREADS (4)
#        VM_SUITE (bookworm) VM_MIRROR (http://deb.debian.org/debian) VM_SIZE (2G)
#
# Needs python3; db needs mariadb-server and sysbench; vm needs debootstrap, qemu-utils,
# e2fsprogs and network access to the Debian mirror. A step whose tools are missing is skipped
# with a message. The text and real-file corpora depend on the packages installed here, the VM
# image on the mirror's state when it is made: the MANIFEST records what went in.
set -euo pipefail

# The body is one function, so bash has read all of it before it runs (editing the file
# while it runs cannot derail it).
main() {

  OUT=${1:-/var/tmp/zdisk-corpora}
  SEED=${CORPUS_SEED:-20}
  STEPS=${STEPS:-text real db vm}
  FORCE=${FORCE:-0}
  DB_TABLES=${DB_TABLES:-4}
  DB_ROWS=${DB_ROWS:-150000}
  DB_RUN_SECONDS=${DB_RUN_SECONDS:-300}
  DB_THREADS=${DB_THREADS:-4}
  VM_SUITE=${VM_SUITE:-bookworm}
  VM_MIRROR=${VM_MIRROR:-http://deb.debian.org/debian}
  VM_SIZE=${VM_SIZE:-2G}
  REPO=$(cd "$(dirname "$0")/.." && pwd)

  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)
  MANIFEST="$OUT/MANIFEST"
  log() { echo "codec-corpora: $*" >&2; }
  want() { [[ " $STEPS " == *" $1 "* ]]; }
  fresh() { [[ $FORCE == 1 || ! -s "$OUT/$1" ]]; }
  note() { echo "$*" >>"$MANIFEST.new.$$"; }
  about() { local f=$1; shift; echo "$f: $*" >"$OUT/$f.about"; } # written when the file is made
  : >"$MANIFEST.new.$$"
  note "# zdisk codec corpora, made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) by scripts/codec-corpora.sh"
  note "# seed $SEED; steps: $STEPS"

  # --- (a) shuffled text lines -------------------------------------------------------------------
  if want text && fresh text-lines.bin; then
    log "text-lines.bin: changelog and copyright lines under /usr/share/doc, seed $SEED"
    python3 - "$OUT/text-lines.bin" "$SEED" <<'EOF'
import gzip, os, random, sys
out, seed = sys.argv[1], int(sys.argv[2])
files = []
for root, dirs, names in os.walk(b"/usr/share/doc"):
    dirs.sort()
    for n in sorted(names):
        if n == b"copyright" or n.startswith(b"changelog"):
            p = os.path.join(root, n)
            if os.path.isfile(p) and not os.path.islink(p):
                files.append(p)
files.sort()
lines = []
for p in files:
    try:
        data = gzip.open(p).read() if p.endswith(b".gz") else open(p, "rb").read()
    except OSError:
        continue
    lines.extend(l for l in data.split(b"\n") if l.strip())
total = sum(len(l) + 1 for l in lines)
random.Random(seed).shuffle(lines)
want = 64 << 20
buf = bytearray()
for l in lines:
    if len(buf) >= want:
        break
    buf += l + b"\n"
if len(buf) < want:
    sys.exit(f"only {len(buf)} bytes of lines found; need {want}")
open(out, "wb").write(buf[:want])
print(f"{len(files)} files, {len(lines)} lines, {total} bytes of lines; shuffled with random.Random({seed})")
EOF
    about text-lines.bin "64 MiB of /usr/share/doc/**/{changelog*,copyright} lines (gunzipped, blank lines dropped, not de-duplicated), python3 random.Random($SEED).shuffle"
  fi

  # --- (b) the bench's real-file stream ----------------------------------------------------------
  if want real && fresh real-files.bin; then
    log "real-files.bin: first 256 MiB of the bench's real-data stream (/usr/share, /usr/lib)"
    python3 - "$OUT/real-files.bin" <<'EOF'
import os, stat, sys
# Mirrors crates/bench/src/corpus.rs: per root, a depth-first walk with each directory's
# entries sorted by name (files taken in order, then the subdirectories), no symlinks, no empty
# files; the two lists interleaved file by file; the files' bytes concatenated.
want = 256 << 20
def walk(root, budget):
    out, found, stack = [], 0, [root]
    while stack:
        d = stack.pop()
        try:
            entries = sorted(os.listdir(d))
        except OSError:
            continue
        subdirs = []
        for e in entries:
            p = os.path.join(d, e)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                subdirs.append(p)
            elif stat.S_ISREG(st.st_mode) and st.st_size > 0:
                out.append(p)
                found += st.st_size
                if found >= budget:
                    return out
        stack.extend(reversed(subdirs))
    return out
# The bench asks for min(target size, 2 GiB) of distinct bytes, half per root; targets of 2 GiB
# and more (every default one) give this list.
lists = [walk(r, (2 << 30) // 2 + 1) for r in (b"/usr/share", b"/usr/lib")]
files = [l[i] for i in range(max(map(len, lists))) for l in lists if i < len(l)]
left, n = want, 0
with open(sys.argv[1], "wb") as f:
    for p in files:
        try:
            data = open(p, "rb").read(left)
        except OSError:
            continue
        f.write(data)
        left -= len(data)
        n += 1
        if left == 0:
            break
if left:
    sys.exit(f"real files: {want - left} bytes only")
print(f"{n} files")
EOF
    about real-files.bin "first 256 MiB of the stream of crates/bench/src/corpus.rs (/usr/share and /usr/lib interleaved file by file)"
  fi

  # --- (c) MariaDB tablespaces of the modified schema --------------------------------------------
  if want db && fresh db-tablespace.ibd; then
    if ! command -v mariadbd >/dev/null || ! command -v sysbench >/dev/null || ! command -v mariadb-install-db >/dev/null; then
      log "db: skipped (needs mariadb-server, mariadb-client and sysbench: scripts/setup.sh --db)"
    else
      work="$OUT/db-work"
      run=$(mktemp -d /tmp/zdc-db.XXXXXX) # short: the socket path must fit 107 bytes
      rm -rf "$work"
      mkdir -p "$work/tmp"
      # The text lines of crates/apps/src/corpus.rs (write_text_lines): license texts and copyright
      # files, lines of 30-200 ASCII characters without quotes, backslashes or control characters,
      # de-duplicated, sorted, then shuffled by the same xorshift.
      python3 - "$work/text.txt" <<'EOF'
import os, sys
files = [os.path.join("/usr/share/common-licenses", n) for n in os.listdir("/usr/share/common-licenses")] \
      + [os.path.join("/usr/share/doc", n, "copyright") for n in os.listdir("/usr/share/doc")]
lines = set()
for f in sorted(files):
    try:
        text = open(f, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError):
        continue
    for l in text.split("\n"):
        l = "".join(c for c in l.strip() if c not in "'\\\"" and c.isprintable())
        if 30 <= len(l.encode()) <= 200 and l.isascii():
            lines.add(l)
lines = sorted(lines)
n, order, x, M = len(lines), list(range(len(lines))), 0x9E3779B97F4A7C15, (1 << 64) - 1
for i in range(n - 1, 0, -1):
    x ^= (x << 13) & M; x ^= x >> 7; x ^= (x << 17) & M
    j = x % (i + 1)
    order[i], order[j] = order[j], order[i]
open(sys.argv[1], "w").write("".join(lines[i] + "\n" for i in order))
print(f"{n} text lines")
EOF
      cp "$REPO/crates/apps/src/zdisk_oltp.lua" "$work/zdisk_oltp.lua"
      log "db: mariadb-install-db, load $DB_TABLES x $DB_ROWS rows, write_only for $DB_RUN_SECONDS s"
      mariadb-install-db --no-defaults --datadir="$work/data" --user=root \
        --auth-root-authentication-method=normal --skip-test-db --skip-name-resolve >"$work/install.log" 2>&1
      # The settings of crates/apps/src/db.rs (mysql_start), with load_seed's 512 MiB buffer pool
      # while loading and the --quick preset's 32 MiB while running.
      start_db() {
        mariadbd --no-defaults --user=root --datadir="$work/data" --socket="$run/s" \
          --pid-file="$run/pid" --log-error="$work/mariadb.log" --tmpdir="$work/tmp" \
          --skip-networking --skip-log-bin --sync-binlog=0 --slow-query-log=0 \
          --max-connections=500 --max-prepared-stmt-count=4000000 \
          --innodb-buffer-pool-size="$1" --innodb-log-file-size=128M --innodb-flush-method=O_DIRECT \
          --innodb-flush-log-at-trx-commit=1 --innodb-adaptive-hash-index=0 \
          --innodb-file-per-table=1 --innodb-purge-threads=4 --innodb-doublewrite=0 &
        for _ in $(seq 600); do
          mariadb-admin --socket="$run/s" -uroot ping >/dev/null 2>&1 && return 0
          sleep 1
        done
        log "db: mariadbd did not start; see $work/mariadb.log"
        return 1
      }
      stop_db() { mariadb-admin --socket="$run/s" -uroot shutdown; wait; }
      sb() {
        (cd /usr/share/sysbench && sysbench "$work/zdisk_oltp.lua" --db-driver=mysql \
          --mysql-socket="$run/s" --mysql-user=root --mysql-db=sbtest \
          --tables="$DB_TABLES" --table-size="$DB_ROWS" --text_file="$work/text.txt" \
          --rand-seed="$SEED" "$@")
      }
      start_db 512M
      mariadb --socket="$run/s" -uroot -e "CREATE DATABASE sbtest"
      sb --threads=2 prepare >"$work/prepare.out"
      stop_db
      start_db 32M
      sb --threads="$DB_THREADS" --workload=write_only --time="$DB_RUN_SECONDS" --report-interval=0 run >"$work/run.out"
      stop_db
      cat "$work"/data/sbtest/sbtest*.ibd >"$OUT/db-tablespace.ibd"
      ls -l "$work"/data/sbtest/sbtest*.ibd >&2
      grep -E "transactions:" "$work/run.out" >&2 || true
      rm -rf "$work" "$run"
      about db-tablespace.ibd "MariaDB $(mariadbd --version | awk '{print $3}') sbtest1..$DB_TABLES.ibd concatenated: modified schema (crates/apps/src/zdisk_oltp.lua), $DB_TABLES x $DB_ROWS rows by sysbench prepare (--rand-seed=$SEED), then write_only, $DB_THREADS threads, $DB_RUN_SECONDS s, clean shutdown"
    fi
  fi

  # --- (d) a VM image ----------------------------------------------------------------------------
  if want vm && fresh vm-image.raw; then
    if ! command -v debootstrap >/dev/null || ! command -v qemu-img >/dev/null || ! command -v mke2fs >/dev/null; then
      log "vm: skipped (needs debootstrap, qemu-utils, e2fsprogs: apt-get install debootstrap qemu-utils e2fsprogs)"
    else
      root="$OUT/vm-root"
      rm -rf "$root"
      log "vm: debootstrap $VM_SUITE (minbase + kernel + ssh) from $VM_MIRROR"
      debootstrap --variant=minbase \
        --include=linux-image-amd64,systemd-sysv,udev,ifupdown,isc-dhcp-client,openssh-server,less,vim-tiny,ca-certificates \
        "$VM_SUITE" "$root" "$VM_MIRROR" >"$OUT/vm-debootstrap.log" 2>&1 || {
        log "vm: debootstrap failed; see $OUT/vm-debootstrap.log"
        exit 1
      }
      rm -f "$root"/var/cache/apt/archives/*.deb
      chroot "$root" dpkg-query -W -f '${Package} ${Version}\n' >"$OUT/vm-packages.txt"
      rm -f "$OUT/vm-image.raw"
      qemu-img create -q -f raw "$OUT/vm-image.raw" "$VM_SIZE"
      mke2fs -q -F -t ext4 -L vmroot -U 2c0d1ec5-0000-4000-8000-000000000020 \
        -E hash_seed=2c0d1ec5-0000-4000-8000-000000000020 -d "$root" "$OUT/vm-image.raw"
      about vm-image.raw "$VM_SIZE ext4 (mke2fs -d) of debootstrap --variant=minbase $VM_SUITE from $VM_MIRROR + linux-image-amd64, systemd-sysv, openssh-server, ...; $(wc -l <"$OUT/vm-packages.txt") packages (vm-packages.txt)"
      rm -rf "$root"
    fi
  fi

  sizes=()
  for f in text-lines.bin real-files.bin db-tablespace.ibd vm-image.raw; do
    if [[ -s "$OUT/$f" ]]; then
      cat "$OUT/$f.about" >>"$MANIFEST.new.$$" 2>/dev/null || note "$f: (made before .about files existed)"
      sizes+=("$(stat -c %s "$OUT/$f") $(sha256sum "$OUT/$f" | cut -d' ' -f1) $f")
    fi
  done
  note ""
  note "# size sha256 file"
  for l in "${sizes[@]}"; do note "$l"; done
  mv "$MANIFEST.new.$$" "$MANIFEST"
  cat "$MANIFEST"
}

main "$@"
