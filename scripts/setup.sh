#!/usr/bin/env bash
# Installs what zdisk needs to build, serve and test on Debian/Ubuntu (run as root).
# Idempotent: does nothing when every tool is already there.
set -euo pipefail

packages=(
  build-essential pkg-config        # C parts of the codec crates (zstd, libdeflate) and AWS-LC
  nbdkit                            # the NBD server the plugin runs in
  libnbd-bin                        # nbdinfo, nbdcopy, nbdfuse
  fio                               # workloads (nbd engine), demo and tests
  qemu-utils                        # qemu-img (interop test), qemu-nbd (benchmark baseline)
  e2fsprogs                         # mkfs.ext4, e2fsck (filesystem test)
  fuse3                             # fusermount3 (nbdfuse)
  util-linux mount                  # losetup, mount
  tar coreutils procps
  mariadb-server mariadb-client     # zdisk db: MariaDB, innochecksum (docs/apps.md)
  sysbench                          # zdisk db: the OLTP load
  postgresql                        # zdisk db: PostgreSQL, pgbench, pg_amcheck, pg_checksums
  ceph-mon ceph-mgr ceph-osd ceph-common jq   # scripts/ceph-demo.sh and its smoke test (docs/ceph.md)
  python3-libnbd                    # interop test: concurrent partial-block requests (libnbd's Python API)
)
tools=(cc pkg-config nbdkit nbdinfo nbdcopy nbdfuse fio qemu-img qemu-nbd mkfs.ext4 e2fsck fusermount3 losetup mount tar sha256sum
       mariadbd innochecksum sysbench pgbench ceph-mon ceph-mgr ceph-osd ceph rbd jq)

missing=()
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
/usr/bin/python3 -c 'import nbd' >/dev/null 2>&1 || missing+=("python3-libnbd")
if ((${#missing[@]})); then
  echo "setup: installing packages for: ${missing[*]}" >&2
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: run as root (apt-get install needs it)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${packages[@]}"
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo (Rust stable) is required: install it with rustup (https://rustup.rs)" >&2
  exit 1
fi
# The FUSE + loop path of `zdisk attach` needs the fuse module and loop devices.
modprobe fuse 2>/dev/null || true
modprobe loop 2>/dev/null || true
