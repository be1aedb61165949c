import csv, sys, collections
def load(fn):
    rows = list(csv.reader(open(fn)))
    hdr = rows[1]; data = rows[2:]
    return hdr, data
for w in ("cuflash", "cudnn"):
    hdr, data = load(f"{w}_sass.csv")
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    tot = collections.Counter(); byop = collections.defaultdict(collections.Counter)
    allsamp = 0; execd = collections.Counter()
    for r in data:
        src = r[ix["Source"]].strip()
        op = src.split()[0] if src else "?"
        if op.startswith("@"): op = src.split()[1]
        op = op.split(".")[0]
        s = int(r[ix["Warp Stall Sampling (All Samples)"]] or 0); allsamp += s
        execd[op] += int((r[ix["Instructions Executed"]] or "0").replace(",",""))
        for h in stalls:
            v = int(r[ix[h]] or 0); tot[h] += v; byop[op][h] += v
    print(w, "samples", allsamp)
    for h, v in tot.most_common(12): print(f"  {h:28s} {v:8d} {v/allsamp:.3f}")
    opt = sorted(byop.items(), key=lambda kv: -sum(kv[1].values()))[:14]
    for op, c in opt:
        s = sum(c.values()); print(f"   {op:10s} {s/allsamp:.3f}  exec {execd[op]:>10d} ", ", ".join(f"{k[6:]}={v/allsamp:.3f}" for k, v in c.most_common(3)))
