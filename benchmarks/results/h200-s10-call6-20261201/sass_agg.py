import csv, gzip, io, sys, re, collections
def load(path):
    lines = gzip.open(path,'rt').read().splitlines()
    i = next(k for k,l in enumerate(lines) if l.startswith('"Address"'))
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[i:]))))
    return rows
rows = load(sys.argv[1])
stalls = [c for c in rows[0] if c.startswith('stall_') and 'Not Issued' not in c]
tot = collections.Counter(); total = 0
for r in rows:
    for c in stalls: tot[c] += int(r[c] or 0)
    total += int(r['Warp Stall Sampling (All Samples)'] or 0)
print('total samples', total)
for c,v in tot.most_common(8): print(f'  {c:24s} {v:8d} {v/total:6.1%}')
# top instructions
top = sorted(rows, key=lambda r: -int(r['Warp Stall Sampling (All Samples)'] or 0))[:25]
for r in top:
    s = int(r['Warp Stall Sampling (All Samples)']); 
    main = max(stalls, key=lambda c: int(r[c] or 0))
    idx = rows.index(r)
    print(f"{idx:5d} {s:7d} {s/total:6.1%} {main:18s} {r['Source'].strip()[:70]}")
# opcode classes
cls = collections.Counter()
for r in rows:
    op = r['Source'].strip().split()[0] if r['Source'].strip() else ''
    if op.startswith('@'): op = r['Source'].strip().split()[1]
    cls[op.split('.')[0]] += int(r['Warp Stall Sampling (All Samples)'] or 0)
print([ (k, f"{v/total:.1%}") for k,v in cls.most_common(14)])
