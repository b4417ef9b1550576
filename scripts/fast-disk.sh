#!/usr/bin/env bash
# A disk faster than this VM's own (~800 MB/s of 128K O_DIRECT writes): an ext4 file system
# on a loop device whose image lives in RAM (tmpfs), the loop in direct-I/O mode, so files
# on it take O_DIRECT (zdisk serve, qemu-nbd --cache=none) and 128K writes run ~1.9 GB/s.
# For the rows measured "on a disk that does >= 1 GB/s" (docs/cpu.md, "On a >= 1 GB/s
# disk"): point scripts/compare.sh's WORKDIR or `zdisk db bench --dir` at DIR.
#
# It is not an NVMe drive: the loop device's kernel thread copies every byte on the same
# two cores the servers use (a drive's DMA costs the host nothing), and its syncs are
# cheap. Writing fewer bytes saves zdisk that copy; report it with the numbers.
# Holds up to SIZE of RAM while up: what was written to it (deleting files does not give it back).
#
#   usage: scripts/fast-disk.sh up DIR [SIZE]    (SIZE for truncate; default 10G)
#          scripts/fast-disk.sh down DIR
set -euo pipefail
usage() { sed -n '/^#   usage/,/^#          /p' "$0" | sed 's/^# \{0,3\}//' >&2; exit 2; }
[[ $# -ge 2 ]] || usage
action=$1 dir=$(realpath -m "$2") size=${3:-10G}
image=/dev/shm/zdisk-fast-disk.$(echo "$dir" | md5sum | cut -c1-12).img
case $action in
  up)
    mountpoint -q "$dir" && { echo "fast-disk.sh: $dir is a mount point already" >&2; exit 1; }
    [[ -e $image ]] && { echo "fast-disk.sh: $image exists (run: $0 down $dir)" >&2; exit 1; }
    mkdir -p "$dir"
    truncate -s "$size" "$image"
    loop=$(losetup --show -f --direct-io=on "$image")
    mkfs.ext4 -q -F "$loop"
    mount "$loop" "$dir"
    # What it does raw, so every report names the disk it ran on.
    fio --name=fast-disk --filename="$dir/fio.probe" --size=1G --rw=write --bs=128k --direct=1 \
      --ioengine=libaio --iodepth=8 --output-format=terse --terse-version=3 \
      | awk -F';' -v dir="$dir" -v loop="$loop" \
        '{ printf "fast-disk.sh: %s on %s: 128K O_DIRECT writes %.0f MB/s\n", dir, loop, $48 * 1024 / 1e6 }'
    rm -f "$dir/fio.probe"
    ;;
  down)
    loop=$(findmnt -n -o SOURCE --target "$dir" 2>/dev/null || true)
    if mountpoint -q "$dir"; then umount "$dir"; fi
    [[ $loop == /dev/loop* ]] && losetup -d "$loop"
    rm -f "$image"
    ;;
  *) usage ;;
esac
