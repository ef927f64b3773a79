import torch
def f(q):
    p = torch.cuda.get_device_properties(q.device)
    if (p.major, p.minor) >= (8, 0):
        return q * 2
    return q * 3
def g(q):
    if torch.cuda.get_device_capability(q.device) >= (8, 0):
        return q * 2
    return q * 3
q = torch.randn(4, device="cuda")
for fn in (f, g):
    try:
        r = torch.compile(fn, fullgraph=True)(q)
        print(fn.__name__, "ok", torch.equal(r, q * 2))
    except Exception as e:
        print(fn.__name__, "FAIL", type(e).__name__, str(e)[:300])
