"""Fills a whole NBD export, then overwrites it twice at random, 32 requests in flight on
one connection (libnbd's asynchronous calls), and reads every block back.

Usage: fill_and_overwrite.py URI SEED DATA, DATA one of
  incompressible  every byte random
  2to1            2,000 random bytes then zeroes: each block compresses to about half

Writes in flight together never overlap (NBD may complete them in any order).
Phases: a sequential fill in 128 KiB writes; one pass of random 4 KiB writes and one of
random 128 KiB-aligned 128 KiB writes, each writing the export's size in bytes; a flush; a
read of every block. Any failed request (ENOSPC included) or wrong block exits 1, naming
the phase, offset and error. A block's contents are a function of (seed, LBA, version), so
the check needs no copy of the data."""

import random
import sys
import time

import nbd

BLOCK = 4096
BIG = 128 << 10
QUEUE_DEPTH = 32


def block_bytes(seed, lba, version, data):
    rng = random.Random((seed << 40) ^ (lba << 8) ^ version)
    if data == "incompressible":
        return rng.randbytes(BLOCK)
    return rng.randbytes(2000) + bytes(BLOCK - 2000)


class Writer:
    """Keeps up to QUEUE_DEPTH writes in flight; fails on the first error."""

    def __init__(self, h, phase):
        self.h, self.phase, self.in_flight = h, phase, []

    def write(self, payload, offset):
        # Requests in flight together may complete in any order: never two on one block.
        end = offset + len(payload)
        while len(self.in_flight) >= QUEUE_DEPTH or any(
            o < end and offset < o + len(b) for _, o, b in self.in_flight
        ):
            self.reap()
        buf = nbd.Buffer.from_bytearray(bytearray(payload))
        self.in_flight.append((self.h.aio_pwrite(buf, offset), offset, buf))

    def reap(self):
        self.h.poll(-1)
        still = []
        for cookie, offset, buf in self.in_flight:
            try:
                # Raises the request's error (ENOSPC: "No space left on device").
                if not self.h.aio_command_completed(cookie):
                    still.append((cookie, offset, buf))
            except nbd.Error as e:
                sys.exit(f"{self.phase}: write at {offset} failed: {e}")
        self.in_flight = still

    def drain(self):
        while self.in_flight:
            self.reap()


def main():
    uri, seed, data = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    assert data in ("incompressible", "2to1"), data
    h = nbd.NBD()
    h.connect_uri(uri)
    size = h.get_size() // BIG * BIG
    blocks = size // BLOCK
    version = [0] * blocks
    rng = random.Random(seed)

    def write_range(writer, lba, count):
        payload = b"".join(block_bytes(seed, lba + i, version[lba + i] + 1, data) for i in range(count))
        for i in range(count):
            version[lba + i] += 1
        writer.write(payload, lba * BLOCK)

    start = time.monotonic()
    w = Writer(h, "fill")
    for lba in range(0, blocks, BIG // BLOCK):
        write_range(w, lba, BIG // BLOCK)
    w.drain()
    print(f"fill: {size} bytes in {time.monotonic() - start:.1f} s", flush=True)
    for name, length in (("random 4K", BLOCK), ("random 128K", BIG)):
        start = time.monotonic()
        w = Writer(h, f"overwrite {name}")
        per = length // BLOCK
        for _ in range(size // length):
            write_range(w, rng.randrange(blocks // per) * per, per)
        w.drain()
        print(f"overwrite {name}: {size} bytes in {time.monotonic() - start:.1f} s", flush=True)
    h.flush()
    for lba in range(0, blocks, BIG // BLOCK):
        got = h.pread(BIG, lba * BLOCK)
        for i in range(BIG // BLOCK):
            want = block_bytes(seed, lba + i, version[lba + i], data)
            if got[i * BLOCK:(i + 1) * BLOCK] != want:
                sys.exit(f"verify: block {lba + i} (version {version[lba + i]}) reads back wrong")
    print(f"verified {blocks} blocks", flush=True)


if __name__ == "__main__":
    main()
