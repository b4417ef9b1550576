#!/usr/bin/python3
"""The scale check of docs/scale.md, by hand (not in CI: it needs a 2 TiB sparse file).

Formats a 16 TiB logical store on a 2 TiB sparse file, serves it, writes 4,096 blocks
scattered over the whole logical range (each block names its own LBA), flushes, stops,
serves again, and reads them back. Prints, per serve, the time from `zdisk serve` to the
printed URI (accepting connections) and the nbdkit process's peak RSS (VmHWM).

    python3 scripts/scale-check.py [--zdisk PATH] [--dir DIR] [--map-cache SIZE]
"""
import argparse
import os
import random
import subprocess
import sys
import time

import nbd

BLOCK = 4096


def serve(zdisk, store, sock, extra):
    start = time.monotonic()
    proc = subprocess.Popen([zdisk, "serve", store, "--unix", sock, *extra], stdout=subprocess.PIPE, text=True)
    uri = proc.stdout.readline().strip()
    ready = time.monotonic() - start
    if not uri:
        sys.exit("zdisk serve did not print a URI")
    return proc, uri, ready


def nbdkit_peak_rss_kib(server):
    # zdisk serve runs nbdkit as its child; VmHWM is its peak resident set.
    children = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
    for pid in children:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    return -1


def block_of(lba):
    return lba.to_bytes(8, "little") * (BLOCK // 8)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zdisk", default="zdisk")
    ap.add_argument("--dir", default="/var/tmp/zdisk-scale")
    ap.add_argument("--map-cache", default=None)
    ap.add_argument("--blocks", type=int, default=4096)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    store = os.path.join(args.dir, "big.zdisk")
    sock = os.path.join(args.dir, "s.sock")
    if os.path.exists(store):
        os.unlink(store)
    t = time.monotonic()
    subprocess.run([args.zdisk, "format", store, "--physical-size", "2T", "--logical-size", "16T"], check=True)
    print(f"format: {time.monotonic() - t:.2f} s")
    extra = ["--map-cache", args.map_cache] if args.map_cache else []
    blocks = (16 << 40) // BLOCK
    rng = random.Random(14)
    lbas = sorted(rng.sample(range(blocks), args.blocks))

    def session(work):
        """Serves the store, runs `work(handle)` timed, stops; (ready s, work s, result, peak RSS KiB)."""
        proc, uri, ready = serve(args.zdisk, store, sock, extra)
        h = nbd.NBD()
        h.connect_uri(uri)
        t = time.monotonic()
        result = work(h)
        took = time.monotonic() - t
        h.shutdown()
        rss = nbdkit_peak_rss_kib(proc)
        proc.terminate()
        proc.wait()
        return ready, took, result, rss

    def write_all(h):
        for lba in lbas:
            h.pwrite(block_of(lba), lba * BLOCK)
        h.flush()

    ready1, wrote, _, rss1 = session(write_all)
    print(f"serve 1: ready in {ready1:.2f} s, wrote {len(lbas)} scattered blocks in {wrote:.2f} s, nbdkit peak RSS {rss1 / 1024:.0f} MiB")
    ready2, read, bad, rss2 = session(lambda h: sum(1 for lba in lbas if h.pread(BLOCK, lba * BLOCK) != block_of(lba)))
    print(f"serve 2: ready in {ready2:.2f} s, read back {len(lbas)} blocks in {read:.2f} s ({bad} wrong), nbdkit peak RSS {rss2 / 1024:.0f} MiB")
    stat = subprocess.run([args.zdisk, "stat", store], capture_output=True, text=True).stdout
    print(stat)
    ok = bad == 0 and max(rss1, rss2) <= 1 << 20 and max(ready1, ready2) <= 10
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
