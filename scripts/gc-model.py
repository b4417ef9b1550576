#!/usr/bin/env python3
"""A block-level model of zdisk's log GC, to see what a victim policy and hot/cold separation
can reach before building them (docs/space.md, "Hot and cold").

The model: NSEG segments of PER fragments each (1 MiB segments of 2:1 blocks: 512), the
working set filled to UTIL of them, then random overwrites (uniform, 80/20 or zipf:THETA);
GC runs whenever fewer than RESERVE segments are free, and moves a victim's live fragments
to the host stream's open segment (one stream) or to a cold stream's (separated). A victim
may be restricted to segments last written at least LAG host writes ago (the engine's
reuse horizon makes younger victims slower to free). It counts fragments moved per fragment
written in the second half of the run; WA for 2:1 data is about 0.512 x (1 + that) plus
~0.03 of metadata. No record headers, checkpoints or timing: a lower bound on the engine.

    python3 scripts/gc-model.py                # every pattern, policy and separation
    python3 scripts/gc-model.py 80/20 --lag 25000
    python3 scripts/gc-model.py zipf:1.2 --segments 511 --reserve 13   # the full bench (minutes)
    python3 scripts/gc-model.py uniform --passes-of-permutations --waves   # fio's random map

`--passes-of-permutations` writes the uniform pattern as fio does by default (a random map:
every block once per pass, in random order) instead of drawing each write independently
(as Iometer and `fio --norandommap` do); `--waves` prints GC's work per host write in
windows of a twentieth of the blocks, and the lowest window's host rate as a share of the
mean, for a disk shared by host writes and GC's reads and writes (docs/space.md, "Why fio's
random map makes waves").
"""
import argparse
import bisect
import random


def picker(pattern, blocks, rnd, permutations=False):
    """The block each host write goes to, and the set of the hottest fifth of the blocks."""
    if pattern == "uniform" and permutations:
        order = []

        def next_of_pass():
            if not order:
                order.extend(range(blocks))
                rnd.shuffle(order)
            return order.pop()

        return next_of_pass, set(range(blocks // 5))
    if pattern == "uniform":
        return (lambda: rnd.randrange(blocks)), set(range(blocks // 5))
    scatter = list(range(blocks))
    rnd.shuffle(scatter)
    hot = blocks // 5
    if pattern == "80/20":
        pick = lambda: scatter[rnd.randrange(hot)] if rnd.random() < 0.8 else scatter[hot + rnd.randrange(blocks - hot)]
        return pick, set(scatter[:hot])
    theta = float(pattern.split(":")[1])
    cumulative, total = [], 0.0
    for rank in range(1, blocks + 1):
        total += 1 / rank**theta
        cumulative.append(total)
    pick = lambda: scatter[min(bisect.bisect_left(cumulative, rnd.random() * total), blocks - 1)]
    return pick, set(scatter[:hot])


def run(pattern, policy, streams, nseg=127, per=512, util=0.8, reserve=4, passes=8, lag=0, seed=1, data_age=False,
        permutations=False, windows=None):
    """streams: 1 (one stream), 2 (host + cold), N > 2 (host + N-1 cold streams by how many
    times GC moved the block: GC's first move to the first, its second to the second, ...),
    0 (an oracle that knows each block's class: the hottest fifth of the blocks and the rest
    each in streams of their own, host writes and GC's moves apart — a bound for separation)."""
    rnd = random.Random(seed)
    blocks = int(util * nseg * per)
    live = [0] * nseg
    held = [[] for _ in range(nseg)]  # fragments written to each segment (live or dead)
    written_at = [0] * nseg
    where = [-1] * blocks
    moves = [0] * blocks  # times GC moved each block since the host last wrote it
    born = [0] * blocks  # when the host last wrote each block
    born_sum = [0] * nseg  # of the live blocks in each segment
    free = list(range(nseg))
    open_segment = {}
    clock = 0

    def append(stream, block):
        segment = open_segment.get(stream)
        if segment is None or len(held[segment]) >= per:
            segment = free.pop(0)
            open_segment[stream] = segment
            held[segment], live[segment], born_sum[segment] = [], 0, 0
        if where[block] >= 0:
            live[where[block]] -= 1
            born_sum[where[block]] -= born[block]
        where[block] = segment
        held[segment].append(block)
        live[segment] += 1
        born_sum[segment] += born[block]
        written_at[segment] = clock

    def clean_one():
        busy = set(open_segment.values())
        candidates = [s for s in range(nseg) if s not in free and s not in busy and len(held[s]) >= per]
        if lag:
            settled = [s for s in candidates if written_at[s] <= clock - lag]
            candidates = settled or candidates

        def cost_benefit(s):
            u = live[s] / per
            # The age of the segment's last write, or (data_age) of its live data's host writes.
            age = clock - (born_sum[s] / live[s] if data_age and live[s] else written_at[s])
            return (1 - u) * (age + 1) / (1 + u)

        victim = min(candidates, key=lambda s: live[s]) if policy == "greedy" else max(candidates, key=cost_benefit)
        moved = [b for b in held[victim] if where[b] == victim]
        for block in moved:
            moves[block] += 1
            if streams == 0:
                append(("hot moved", "cold moved")[block not in hot], block)
            else:
                append(0 if streams == 1 else min(moves[block], streams - 1), block)
        held[victim], live[victim] = [], 0
        free.append(victim)
        return len(moved)

    for block in range(blocks):
        append(0, block)
    pick, hot = picker(pattern, blocks, rnd, permutations)
    total = passes * blocks
    moved = written = 0
    window, window_moved = max(blocks // 20, 1), 0
    for i in range(total):
        clock += 1
        while len(free) < reserve:
            gained = clean_one()
            window_moved += gained
            if i >= total // 2:
                moved += gained
        if windows is not None and i % window == window - 1:
            windows.append(window_moved / window)
            window_moved = 0
        block = pick()
        moves[block], born[block] = 0, clock
        append(0 if streams != 0 or block in hot else "cold written", block)
        if i >= total // 2:
            written += 1
    return moved / written


def print_waves(windows):
    """Moved per written in each window, and how low a disk-bound host rate goes: each host
    write costs itself plus a read and a write of every fragment GC moves."""
    print("moved per written, window by window:", " ".join(f"{w:.1f}" for w in windows))
    steady = windows[len(windows) // 4:]
    rates = [1 / (1 + 2 * w) for w in steady]
    print(f"lowest window's host rate / mean: {min(rates) / (sum(rates) / len(rates)):.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("patterns", nargs="?", default="uniform,80/20,zipf:1.2")
    parser.add_argument("--lag", type=int, default=0, help="victims at least this many host writes old first")
    parser.add_argument("--streams", default="1,2", help="stream counts to model (1: one, 2: host + cold, N: N-1 cold streams by moves)")
    parser.add_argument("--policies", default="greedy,cost-benefit")
    parser.add_argument("--util", type=float, default=0.8)
    parser.add_argument("--segments", type=int, default=127, help="segments in the store (the quick bench: 127, the full one: 511)")
    parser.add_argument("--reserve", type=int, default=4,
                        help="segments GC keeps free (the engine holds its host reserve and pacing band: ~13 of the full bench's 511)")
    parser.add_argument("--data-age", action="store_true", help="cost-benefit ages a segment by its live data's host writes")
    parser.add_argument("--passes-of-permutations", action="store_true", help="uniform writes as fio's random map makes them")
    parser.add_argument("--waves", action="store_true", help="print GC's work per host write window by window")
    args = parser.parse_args()
    if args.reserve < 4 and "0" in args.streams.split(","):
        parser.error("the oracle keeps four streams open: --reserve must be at least 4")
    print("| pattern | policy | streams | moved per written | WA, 2:1 data (model) |")
    print("|---|---|---|---|---|")
    for pattern in args.patterns.split(","):
        for policy in args.policies.split(","):
            for streams in map(int, args.streams.split(",")):
                windows = [] if args.waves else None
                ratio = run(pattern, policy, streams, nseg=args.segments, util=args.util, reserve=args.reserve, lag=args.lag,
                            data_age=args.data_age, permutations=args.passes_of_permutations, windows=windows)
                if windows:
                    print_waves(windows)
                name = {0: "oracle: hot and cold apart", 1: "one", 2: "host + cold"}.get(streams, f"host + {streams - 1} cold by moves")
                print(f"| {pattern} | {policy} | {name} | {ratio:.2f} | {0.512 * (1 + ratio) + 0.03:.2f} |", flush=True)


if __name__ == "__main__":
    main()
