#!/usr/bin/env bash
# Installs what zdisk needs on Debian/Ubuntu (run as root). Idempotent: installs only what a
# missing tool asks for.
#   usage: bash scripts/setup.sh [--db] [--ceph] [--all]
#   (none)  what `zdisk demo`, `zdisk serve` and `zdisk attach` need (scripts/demo.sh)
#   --db    MariaDB, sysbench and PostgreSQL for `zdisk db` (docs/apps.md)
#   --ceph  Ceph's mon, mgr and OSD and jq for scripts/ceph-demo.sh (docs/ceph.md)
#   --all   everything, with libnbd's Python binding for the interop tests (scripts/test.sh)
# Rust's cargo must be there already (https://rustup.rs): checked first.
set -euo pipefail

want_db=0 want_ceph=0 want_tests=0
for arg in "$@"; do
  case $arg in
    --db) want_db=1 ;;
    --ceph) want_ceph=1 ;;
    --all) want_db=1 want_ceph=1 want_tests=1 ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup: unknown option $arg (try --help)" >&2; exit 2 ;;
  esac
done

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo (Rust stable) is required: install it with rustup (https://rustup.rs), then run this again" >&2
  exit 1
fi

# package: the tools it brings (a missing tool installs its package)
packages=(
  "build-essential:cc"            # C parts of the codec crates (zstd, libdeflate) and AWS-LC
  "pkg-config:pkg-config"         # finds the system OpenSSL for zdisk serve --tls
  "openssl:openssl"               # TLS certificates (docs/nbd.md, "TLS"; the TLS test makes its own)
  "nbdkit:nbdkit"                 # the NBD server the plugin runs in
  "libnbd-bin:nbdinfo nbdcopy nbdfuse"
  "fio:fio"                       # workloads (nbd engine), demo and tests
  "qemu-utils:qemu-img qemu-nbd"  # interop test, benchmark baseline
  "e2fsprogs:mkfs.ext4 e2fsck"    # filesystem test
  "fuse3:fusermount3"             # nbdfuse (zdisk attach)
  "util-linux:losetup setpriv"
  "mount:mount"
  "tar:tar"
  "coreutils:sha256sum"
  "procps:pgrep"
)
((want_db)) && packages+=(
  "mariadb-server:mariadbd"       # zdisk db: MariaDB
  "mariadb-client:innochecksum"
  "sysbench:sysbench"             # zdisk db: the OLTP load
  "postgresql:pgbench"            # zdisk db: PostgreSQL, pgbench, pg_amcheck, pg_checksums
)
((want_ceph)) && packages+=(
  "ceph-mon:ceph-mon" "ceph-mgr:ceph-mgr" "ceph-osd:ceph-osd" "ceph-common:ceph rbd"
  "jq:jq"                         # scripts/ceph-demo.sh and its smoke test
)
((want_tests)) && packages+=("systemd:systemd-analyze")   # the install test verifies the units

missing=()
for entry in "${packages[@]}"; do
  package=${entry%%:*}
  for tool in ${entry#*:}; do
    if ! command -v "$tool" >/dev/null 2>&1 && [[ ! -x /usr/sbin/$tool && ! -x /sbin/$tool ]]; then
      missing+=("$package")
      break
    fi
  done
done
if ! pkg-config --exists openssl 2>/dev/null && [[ ! -e /usr/include/openssl/ssl.h ]]; then
  missing+=(libssl-dev)            # OpenSSL 3's headers: the native server's TLS (crates/nbd)
fi
if ((want_tests)) && ! /usr/bin/python3 -c 'import nbd' >/dev/null 2>&1; then
  missing+=(python3-libnbd)        # interop test: concurrent partial-block requests
fi
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: run as root (apt-get install needs it)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The FUSE + loop path of `zdisk attach` needs the fuse module and loop devices.
modprobe fuse 2>/dev/null || true
modprobe loop 2>/dev/null || true
