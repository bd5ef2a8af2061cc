import re,bisect
T=[]
for l in open('err.txt'):
    m=re.match(r'T0 ([\d.]+) tid (\d+) R(\d) it(\d+) issue (\d+) done (\d+) compute_end (\d+) wait_end (\d+)',l)
    if m: T.append(tuple(float(x) for x in m.groups()))
P=[]
for l in open('phases.txt'):
    d=dict(re.findall(r'(\w+) ([\d.]+)',l)); P.append({k:float(v) for k,v in d.items()})
P.sort(key=lambda p:p['enter'])
for t0,tid,r,it,issue,done,ce,we in T:
    if r!=0: continue
    # phases in [t0, t0+we]
    ph=[p for p in P if t0-5<=p['enter']<=t0+we]
    s=' | '.join(f"r{int(p['rank'])}{'W' if p['tid']!=tid and p['tid']!=tid+1 else 'C'} enter {p['enter']-t0:.0f} read {p['read0']-t0:.0f}-{p['read1']-t0:.0f} ph2 {p['ph2']-t0:.0f} leave {p['leave']-t0:.0f}" for p in ph)
    print(f"it{int(it)} done {done:.0f} ce {ce:.0f} we {we:.0f} :: {s}")
