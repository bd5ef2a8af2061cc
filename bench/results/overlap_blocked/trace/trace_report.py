# Reads a trace written by trace.patch (one line per event: ns, thread, event id) and prints the
# last 4 overlapped iterations as a timeline, the median time of each event from the iteration's
# start, and the hand-off costs: the issue, the worker's wake-up after the kick, how often the
# caller slept in wait() and its wake-up after the worker finished.
#   python3 trace_report.py ps0_4M.txt
import collections
import statistics
import sys

NAMES = {1: 'start', 2: 'issued', 3: 'comp_end', 4: 'wait_ret', 10: 'kick', 11: 'wk_wake', 12: 'read0',
         13: 'read1', 14: 'phase_ok', 15: 'finish', 16: 'c_sleep', 17: 'c_woke'}

events = sorted(tuple(map(int, line.split())) for line in open(sys.argv[1]))
callers = sorted({t for _, t, i in events if i == 1})
workers = sorted({t for _, t, i in events if i == 11})

# An iteration starts with the first 'start' more than 0.2 ms after the previous iteration's.
iters, cur, last = [], [], None
for e in events:
    if e[2] == 1 and (last is None or e[0] - last > 200000):
        if cur:
            iters.append(cur)
        cur, last = [], e[0]
    cur.append(e)
if cur:
    iters.append(cur)


def who(t):
    if t in callers:
        return 'C%d' % callers.index(t)
    return 'W%d' % workers.index(t) if t in workers else 'T%d' % t


times = collections.defaultdict(list)
issue, wk_wake, c_wake, after_compute = [], [], [], []
slept = total = 0
for k, it in enumerate(iters):
    t0 = min(e[0] for e in it if e[2] == 1)
    for ns, t, i in it:
        times[(who(t), NAMES.get(i, i))].append((ns - t0) / 1000)
    if k >= len(iters) - 4:
        print(' '.join('%s:%s@%d' % (who(t), NAMES.get(i, i), (ns - t0) // 1000) for ns, t, i in it))
    for c in callers:
        mine = collections.defaultdict(list)
        for ns, t, i in it:
            if t == c:
                mine[i].append(ns)
        total += 1
        if mine[1] and mine[2]:
            issue.append((mine[2][0] - mine[1][0]) / 1000)
        if mine[17]:
            slept += 1
            done = [ns for ns, t, i in it if t in workers and i == 15 and ns <= mine[17][0]]
            if done:
                c_wake.append((mine[17][0] - max(done)) / 1000)
        if mine[3] and mine[4]:
            after_compute.append((mine[4][0] - mine[3][0]) / 1000)
    kicks = [ns for ns, t, i in it if i == 10]
    for w in workers:
        woke = [ns for ns, t, i in it if t == w and i == 11]
        if woke and kicks:
            wk_wake.append((woke[0] - min(kicks)) / 1000)

print('median us from the iteration start:')
for key, v in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
    print('  %-4s %-9s n=%3d median %7.1f' % (key[0], key[1], len(v), statistics.median(v)))


def q(v):
    if not v:
        return '-'
    return 'median %.1f (min %.1f, max %.1f, n=%d)' % (statistics.median(v), min(v), max(v), len(v))


print('issue (start -> issued):', q(issue))
print('worker wake-up after the first kick:', q(wk_wake))
print('caller slept in wait: %d of %d' % (slept, total))
print("caller's wake-up after the worker finished:", q(c_wake))
print('wait after the compute (wait_ret - comp_end):', q(after_compute))
