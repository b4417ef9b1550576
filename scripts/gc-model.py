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
"""
import argparse
import bisect
import random


def picker(pattern, blocks, rnd):
    if pattern == "uniform":
        return lambda: rnd.randrange(blocks)
    scatter = list(range(blocks))
    rnd.shuffle(scatter)
    if pattern == "80/20":
        hot = blocks // 5
        return lambda: scatter[rnd.randrange(hot)] if rnd.random() < 0.8 else scatter[hot + rnd.randrange(blocks - hot)]
    theta = float(pattern.split(":")[1])
    cumulative, total = [], 0.0
    for rank in range(1, blocks + 1):
        total += 1 / rank**theta
        cumulative.append(total)
    return lambda: scatter[min(bisect.bisect_left(cumulative, rnd.random() * total), blocks - 1)]


def run(pattern, policy, separate, nseg=127, per=512, util=0.8, reserve=4, passes=8, lag=0, seed=1):
    rnd = random.Random(seed)
    blocks = int(util * nseg * per)
    live = [0] * nseg
    held = [[] for _ in range(nseg)]  # fragments written to each segment (live or dead)
    written_at = [0] * nseg
    where = [-1] * blocks
    free = list(range(nseg))
    open_segment = {}
    clock = 0

    def append(stream, block):
        segment = open_segment.get(stream)
        if segment is None or len(held[segment]) >= per:
            segment = free.pop(0)
            open_segment[stream] = segment
            held[segment], live[segment] = [], 0
        if where[block] >= 0:
            live[where[block]] -= 1
        where[block] = segment
        held[segment].append(block)
        live[segment] += 1
        written_at[segment] = clock

    def clean_one():
        busy = set(open_segment.values())
        candidates = [s for s in range(nseg) if s not in free and s not in busy and len(held[s]) >= per]
        if lag:
            settled = [s for s in candidates if written_at[s] <= clock - lag]
            candidates = settled or candidates

        def cost_benefit(s):
            u = live[s] / per
            return (1 - u) * (clock - written_at[s] + 1) / (1 + u)

        victim = min(candidates, key=lambda s: live[s]) if policy == "greedy" else max(candidates, key=cost_benefit)
        moved = [b for b in held[victim] if where[b] == victim]
        for block in moved:
            append("cold" if separate else "host", block)
        held[victim], live[victim] = [], 0
        free.append(victim)
        return len(moved)

    for block in range(blocks):
        append("host", block)
    pick = picker(pattern, blocks, rnd)
    total = passes * blocks
    moved = written = 0
    for i in range(total):
        clock += 1
        while len(free) < reserve:
            gained = clean_one()
            if i >= total // 2:
                moved += gained
        append("host", pick())
        if i >= total // 2:
            written += 1
    return moved / written


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("patterns", nargs="?", default="uniform,80/20,zipf:1.2")
    parser.add_argument("--lag", type=int, default=0, help="victims at least this many host writes old first")
    args = parser.parse_args()
    print("| pattern | policy | streams | moved per written | WA, 2:1 data (model) |")
    print("|---|---|---|---|---|")
    for pattern in args.patterns.split(","):
        for policy in ("greedy", "cost-benefit"):
            for separate in (False, True):
                ratio = run(pattern, policy, separate, lag=args.lag)
                streams = "host + cold" if separate else "one"
                print(f"| {pattern} | {policy} | {streams} | {ratio:.2f} | {0.512 * (1 + ratio) + 0.03:.2f} |", flush=True)


if __name__ == "__main__":
    main()
