"""The batch-row fault of experiments/NOTES.md 94, piece by piece, as run on one H200 (torch 2.11):
the compressed branch's flex call with documents (3 rows of 1024 tokens, row 0 one document, 63
compressed keys, fp32), each row against that row alone on the reference backend ("want"), and
against two readings of a wrong row (row 0's documents for every row; no documents). Variants:
eager; compiled with the BlockMask built inside the graph (the layer's way: since the fix through
the `masks.core.band_lists` op) or outside it; without the K/V expansion; torch's own
create_block_mask built outside and inside the graph; per-block document tensors; padded keys.

    python experiments/traced_block_mask_h200.py      (from the repository root, a CUDA GPU)"""
import time
import torch
from torch.nn.attention.flex_attention import flex_attention, create_block_mask
from masks import MaskContext, get_mask_builder
from masks.builders import compressed_causal
from nsa_flex import NSAConfig
from nsa_flex.rules import cmp_visible
import nsa_flex.attention as A

torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
if not torch.cuda.is_available():
    raise SystemExit("traced_block_mask_h200.py: needs a CUDA GPU")
DEV = "cuda"; B, T = 3, 1024
cfg = NSAConfig(n_heads=8, n_kv_heads=2, d_qk=64, d_v=64, dim=256, l=32, d=16, l_sel=64, n_sel=8,
                window=256, backend="flex")
l, dd = cfg.l, cfg.d
docs = torch.zeros(B, T, dtype=torch.long, device=DEV); docs[1, 300:] = 1; docs[2, 100:] = 1; docs[2, 700:] = 2
S = cfg.num_cmp(T)
torch.manual_seed(0)
q = torch.randn(B, 8, T, 64, device=DEV); k = torch.randn(B, 2, S, 64, device=DEV); v = torch.randn(B, 2, S, 64, device=DEV)


def spec_for(di):
    return get_mask_builder("compressed_causal")(MaskContext(cfg, di.shape[0], T, DEV, doc_ids=di))


def ref(spec, rows=None):
    return A.attend_reference(q, k, v, spec)[0]


want = torch.cat([A.attend_reference(q[b:b+1], k[b:b+1], v[b:b+1], spec_for(docs[b:b+1]))[0] for b in range(B)])
hyp = {"row0docs": ref(spec_for(docs[:1].expand(B, T).contiguous())), "nodocs": ref(compressed_causal(l, dd))}


def err(g, w):
    fin = torch.isfinite(w)
    g, w = torch.where(fin, g, 0), torch.where(fin, w, 0)
    return " ".join("%.1e" % float((g[i] - w[i]).abs().max() / w[i].abs().max()) for i in range(B))


def report(name, fn):
    torch._dynamo.reset()
    t0 = time.time()
    try:
        got = fn()
    except Exception as e:
        print(f"{name}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True); return
    got = got.float()
    print(f"{name} ({time.time()-t0:.0f}s): vs want [{err(got, want)}] vs row0docs [{err(got, hyp['row0docs'])}] "
          f"vs nodocs [{err(got, hyp['nodocs'])}] nan {int(got.isnan().sum())}", flush=True)


C = lambda f: torch.compile(f, fullgraph=True, dynamic=False)
report("eager attend_flex", lambda: A.attend_flex(q, k, v, spec_for(docs))[0])
report("compiled attend_flex (spec inside)", lambda: C(lambda q, k, v: A.attend_flex(q, k, v, spec_for(docs))[0])(q, k, v))
pre = spec_for(docs).with_block_mask(B, T, S, DEV, A.FLEX_BLOCK)
report("compiled attend_flex (BlockMask built outside)", lambda: C(lambda q, k, v: A.attend_flex(q, k, v, pre)[0])(q, k, v))
orig = A.expand_kv_heads
A.expand_kv_heads = lambda *a: False
report("compiled attend_flex, no K/V expansion (enable_gqa)", lambda: C(lambda q, k, v: A.attend_flex(q, k, v, spec_for(docs))[0])(q, k, v))
A.expand_kv_heads = orig
spec = spec_for(docs)
tbm = create_block_mask(spec.mask_mod, B, None, T, S, device=DEV)
kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
report("compiled flex_attention, torch's create_block_mask, expanded K/V", lambda: C(lambda q, k, v: flex_attention(q, k, v, block_mask=tbm))(q, kr, vr))
report("compiled flex_attention, torch's create_block_mask, enable_gqa", lambda: C(lambda q, k, v: flex_attention(q, k, v, block_mask=tbm, enable_gqa=True))(q, k, v))
ourbm = spec.block_mask(B, T, S, DEV, A.FLEX_BLOCK)
report("compiled flex_attention, torch's create_block_mask traced in the graph", lambda: C(lambda q, k, v: flex_attention(q, k, v, block_mask=create_block_mask(spec.mask_mod, B, None, T, S, device=DEV)))(q, kr, vr))
report("compiled flex_attention, our BlockMask, expanded K/V", lambda: C(lambda q, k, v: flex_attention(q, k, v, block_mask=ourbm))(q, kr, vr))
print("our bm shapes", tuple(ourbm.kv_num_blocks.shape), tuple(ourbm.full_kv_num_blocks.shape), "torch bm", tuple(tbm.kv_num_blocks.shape),
      "equal lists", bool(torch.equal(ourbm.kv_num_blocks, tbm.kv_num_blocks)), bool(torch.equal(ourbm.full_kv_num_blocks, tbm.full_kv_num_blocks)))
first = docs[:, (torch.arange(S, device=DEV) * dd).clamp_max(T - 1)].contiguous()
last = docs[:, (torch.arange(S, device=DEV) * dd + l - 1).clamp_max(T - 1)].contiguous()
def mm2(b, h, qi, kv):
    return cmp_visible(kv, qi, l, dd) & (first[b, kv] == docs[b, qi]) & (last[b, kv] == docs[b, qi])
bm2 = create_block_mask(mm2, B, None, T, S, device=DEV)
report("compiled flex_attention, per-block doc tensors [B,S]", lambda: C(lambda q, k, v: flex_attention(q, k, v, block_mask=bm2))(q, kr, vr))
P = 128
kp = torch.cat([kr, kr.new_zeros(B, 8, P - S, 64)], 2); vp = torch.cat([vr, vr.new_zeros(B, 8, P - S, 64)], 2)
def mm3(b, h, qi, kv):
    return spec.mask_mod(b, h, qi, kv) & (kv < S)
bm3 = create_block_mask(mm3, B, None, T, P, device=DEV)
report("compiled flex_attention, keys padded to 128", lambda: C(lambda q, k, v: flex_attention(q, k, v, block_mask=bm3))(q, kp, vp))
def mm4(b, h, qi, kv):  # the document test without clamp_max
    return cmp_visible(kv, qi, l, dd) & (docs[b, kv * dd] == docs[b, qi])
bm4 = create_block_mask(mm4, B, None, T, S, device=DEV)
report("compiled flex_attention, doc test docs[b, kv*d] (no clamp, first token only)", lambda: C(lambda q, k, v: flex_attention(q, k, v, block_mask=bm4))(q, kr, vr))
