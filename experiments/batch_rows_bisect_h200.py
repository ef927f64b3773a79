"""The bisect of experiments/NOTES.md 94, as run on one H200: `gpu_kl_pair`'s layers (the
block-indexer configuration, B = 2 x 1024 tokens, a document boundary at 300), the flex layer
compiled with each piece in turn (indexer, top-n, branches, gate mix) run eager through
torch.compiler.disable, every piece's inputs and outputs compared per batch row with the reference
layer's. At the commit before the band_lists op, the full graph missed row 1 and any graph break
made it exact.

    python experiments/batch_rows_bisect_h200.py      (from the repository root, a CUDA GPU)"""
import sys, time
import torch

if not torch.cuda.is_available():
    raise SystemExit("batch_rows_bisect_h200.py: needs a CUDA GPU")
sys.path.append("tests/layer")
from distill_helpers import gpu_kl_pair
import nsa_flex.layer as L

SHAPE = dict(dim=256, n_heads=8, n_kv_heads=2, d_qk=64, d_v=64, l=32, d=16, l_sel=64, n_sel=8,
             window=256, phi="mlp", sel_scores="indexer", sel_distill=1.0, indexer_heads=2,
             indexer_dim=64)
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
ref, flex, x, d = gpu_kl_pair(SHAPE, lambda m: (m.wq, m.wk["sel"], m.indexer.wq, m.indexer.wk))
ref.telemetry = flex.telemetry = False
mix0 = L.mix_branches
ORIG_TOPN = flex.select_topn


def rowerr(g, w):
    if isinstance(g, (tuple, list)):
        return [e for e in (rowerr(a, b) for a, b in zip(g, w)) if e]
    if not torch.is_tensor(g) or g.dim() < 2 or g.shape[0] != 2 or g.shape != w.shape:
        return None
    if g.dtype in (torch.long, torch.int32, torch.bool):
        return ["eq %.3f" % float((g[i] == w[i]).float().mean()) for i in range(g.shape[0])]
    g, w = g.float(), w.float()
    fin = torch.isfinite(w)
    g, w = torch.where(fin, g, 0), torch.where(fin, w, 0)
    return ["%.1e" % float((g[i] - w[i]).abs().max() / w[i].abs().max().clamp_min(1e-30))
            for i in range(g.shape[0])]


def install(m, store, disable):
    """wrap m's pieces; disable: names run eager."""
    def wrap(name, fn):
        def w(*a, **k):
            out = fn(*a, **k)
            key = name if name != "branch" else f"branch_{a[0]}"
            store[key] = (a, out)
            return out
        return torch.compiler.disable(w) if (name in disable or "all" in disable) else w
    m.__dict__.pop("branch", None); m.select_topn = ORIG_TOPN
    m.indexer.__dict__.pop("forward", None)
    if disable is None:
        return
    m.indexer.forward = wrap("indexer", type(m.indexer).forward.__get__(m.indexer))
    m.select_topn = wrap("select_topn", ORIG_TOPN)
    m.branch = wrap("branch", type(m).branch.__get__(m))
    L.mix_branches = wrap("mix", mix0)


with torch.no_grad():
    rstore = {}
    install(ref, rstore, set())
    want = ref(x, d)
    for dis in [None, {"all"}, {"indexer"}, {"select_topn"}, {"branch"}, {"mix"},
                {"indexer", "select_topn"}]:
        torch._dynamo.reset()
        fstore = {}
        install(flex, fstore, dis if dis is not None else None)
        t0 = time.time()
        c = torch.compile(flex, fullgraph=dis is None)
        try:
            got = c(x, d)
        except Exception as e:
            print("disable", dis, "ERROR", type(e).__name__, str(e)[:300]); continue
        print(f"== disable {dis} ({time.time()-t0:.0f}s): out", rowerr(got, want), flush=True)
        for k in sorted(fstore):
            a, o = fstore[k]
            ra, ro = rstore[k]
            print("   ", k, "out", rowerr(o, ro), "| in", [e for e in rowerr(list(a), list(ra)) if e])
        L.mix_branches = mix0
