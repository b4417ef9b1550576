"""Two requests at once on one NBD connection, with libnbd's asynchronous calls, that touch
parts of one block or of two adjacent blocks (disjoint or overlapping): every pairing of
write, write-zeroes and trim. Each byte must end up as one whole request left it, in some
order. Usage: partial_block_races.py URI SEED ROUNDS. Exits 1 on the first lost update."""

import random
import sys

import nbd

BLOCK = 4096


def apply(image, base, kind, offset, length, tag):
    """What a request does to a plain image (trim unmaps whole blocks only)."""
    if kind == "write":
        image[offset - base:offset - base + length] = bytes([tag]) * length
    elif kind == "zero":
        image[offset - base:offset - base + length] = bytes(length)
    else:
        start = -(-offset // BLOCK) * BLOCK
        end = (offset + length) // BLOCK * BLOCK
        if end > start:
            image[start - base:end - base] = bytes(end - start)


def main():
    uri, seed, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    h = nbd.NBD()
    h.connect_uri(uri)
    kinds = ["write", "zero", "trim"]
    for r in range(rounds):
        a, b = rng.choice(kinds), rng.choice(kinds)
        blocks = rng.choice([1, 2])
        overlap = rng.random() < 0.5
        base = (16 + (r % 64) * 4) * BLOCK
        span = blocks * BLOCK
        initial = bytearray(((i * 7) & 0xFF) | 1 for i in range(span))
        h.pwrite(bytes(initial), base)
        cut = rng.randrange(1, span)
        if overlap:
            shared = rng.randint(1, min(cut, span - cut, 512))
            start = cut - min(shared, cut - 1)
            ra, rb = (0, cut + shared), (start, span - start)
        else:
            ra, rb = (0, cut), (cut, span - cut)
        requests = [(a, base + ra[0], ra[1], 0xA5), (b, base + rb[0], rb[1], 0x5A)]
        pending = []
        for kind, offset, length, tag in requests:
            if kind == "write":
                buf = nbd.Buffer.from_bytearray(bytearray([tag]) * length)
                pending.append(h.aio_pwrite(buf, offset))
            elif kind == "zero":
                pending.append(h.aio_zero(length, offset))
            else:
                pending.append(h.aio_trim(length, offset))
        while pending:
            h.poll(-1)
            pending = [c for c in pending if not h.aio_command_completed(c)]
        got = h.pread(span, base)
        orders = []
        for first, second in (requests, requests[::-1]):
            image = bytearray(initial)
            apply(image, base, *first)
            apply(image, base, *second)
            orders.append(bytes(image))
        if got not in orders:
            print(f"round {r}: {requests} over {blocks} block(s): an update was lost", file=sys.stderr)
            sys.exit(1)
    h.shutdown()
    print(f"{rounds} rounds")


main()
