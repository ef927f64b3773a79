"""CPU retrieval probe (NOTES entry 17): does NSA's selection pick the needle's block at the question?

Trains a small model on the passkey corpus (training documents with `--questions` Q+A pairs) with a
plain AdamW loop and, every `--every` steps, evaluates on 64 held-out standard documents (one
question):
  * teacher-forced answer NLL / exact over the 5 key digits;
  * for NSA (masks with a top-n selection): the selection recall = fraction of (doc, GQA group,
    layer) whose selected blocks at the query position include a selection block holding the key
    digits of the needle's first / second mention (and either), at the last ':' of the question
    (predicts the answer's " ") and at the " " after it (predicts the first digit); `forced` = the
    needle block is forced anyway (block 0 or the n_local most recent blocks), `free` = the recall
    over rows where it is not; `rank` = the rank (1 = best) of the best needle block among the
    valid, non-forced candidates under the scorer's own block importance (Eq. 8-10), `teacher
    rank` the same under the distillation's target (the selected branch's dense block mass);
  * the mean gate (sigmoid) per branch over all positions and at the answer positions, per layer;
  * `oracle`: the answer NLL / exact when the selection's free slot at positions >= the question
    is replaced by the needle's (second-mention) block, i.e. with a perfect selection.

The selected indices are captured by wrapping each layer's `select_topn` (the function the
layer calls; library code unchanged), the gates by a forward hook on each layer's `gate` linear.
With `--set nsa.sel_scores=indexer` the rank is under the indexer's block scores; `--warm_steps N`
trains the first N steps with every block selected (the dense warm-up; evaluation stays top-n).

    OMP_NUM_THREADS=1 python experiments/retrieval_probe.py --masks nsa --steps 8000 \
        --out experiments/results/ablation/cpu_probe/nsa.log
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F

from nsa_flex.apps.generate import build_model, load_job_config
from nsa_flex.rules import forced_and_valid
from masks import MaskContext, builder_info
from nsa_flex.distill import selected_target
from nsa_flex.rope import rope_cos_sin
from nsa_flex.selection import block_scores, select_topn
from nsa_flex.telemetry import DISTILL
from nsa_flex.data.passkey import PASSKEY_NEEDLE, PASSKEY_QUESTION, PasskeyCorpus

p = argparse.ArgumentParser()
p.add_argument("--masks", default="nsa")
p.add_argument("--flavor", default="debugmodel")
p.add_argument("--steps", type=int, default=8000)
p.add_argument("--every", type=int, default=500)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--seq", type=int, default=256)
p.add_argument("--questions", type=int, default=2)
p.add_argument("--no_intro", type=int, default=1)
p.add_argument("--n_eval", type=int, default=64)
p.add_argument("--max_minutes", type=float, default=15.0)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--out", default=None)
p.add_argument("--warm_steps", type=int, default=0,
               help="dense warm-up: for the first N steps every layer selects --warm_n blocks")
p.add_argument("--warm_n", type=int, default=0, help="n_sel during the warm-up (0: all blocks)")
p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
               help="a further override of titan_configs/debug_nsa.toml, e.g. nsa.sel_distill=1.0")
args = p.parse_args()

if args.flavor not in ("debugmodel",):
    import cpu_flavors  # noqa: F401  (registers debug4l / debug4l128 / debug_l32)

logf = open(args.out, "w") if args.out else None


def log(s):
    print(s, flush=True)
    if logf:
        logf.write(s + "\n")
        logf.flush()


jc = load_job_config("titan_configs/debug_nsa.toml",
                     [f"--nsa.masks={args.masks}", f"--model.flavor={args.flavor}",
                      f"--training.seq_len={args.seq}"] + [f"--{o}" for o in args.set])
torch.manual_seed(args.seed)
model, tok = build_model(jc)
with torch.no_grad():
    model.init_weights()
attn = [blk.attention for blk in model.layers.values()]
cfg = attn[0].cfg
has_sel = attn[0].branch_names["sel"] == "topn"
log(f"# {vars(args)}")
log(f"# cfg: l={cfg.l} d={cfg.d} l_sel={cfg.l_sel} n_sel={cfg.n_sel} n_init={cfg.n_init} "
    f"n_local={cfg.n_local} window={cfg.window} H={cfg.n_heads} Hkv={cfg.n_kv_heads} "
    f"sel_distill={cfg.sel_distill} "
    f"branches={attn[0].branch_names} params={sum(x.numel() for x in model.parameters())}")

T, B = args.seq, args.batch
N_SEL = cfg.n_sel  # the selection evaluated (and trained after the warm-up)
WARM_N = args.warm_n or -(-T // cfg.l_sel)


def set_n_sel(n):
    for a in attn:
        a.cfg.n_sel = n
train = PasskeyCorpus(tok, T + 1, seed=0, questions=args.questions)
if args.no_intro:
    # data.py's build() drops the 147-token intro when the filler would be < 8 tokens, but then
    # recomputes n_fill without the extra Q+A pairs (assert: 303 != 257 at seq 256, questions=2):
    # build training documents without the intro (as the held-out ones at seq 256 are)
    train._intro = []
held = PasskeyCorpus(tok, T + 1, seed=0, split="heldout", questions=1)
ev = [held.document(i) for i in range(args.n_eval)]

# ---------------------------------------------------------------- held-out doc geometry
q_len = len(tok.encode(PASSKEY_QUESTION))
geo = []  # per doc: colon pos, space pos, digit positions, key digit positions per mention
for toks, s, key in ev:
    nd = tok.encode(PASSKEY_NEEDLE.format(key=key))
    j = next(i for i in range(len(toks)) if toks[i:i + len(nd)] == nd)
    kd = tok.encode(str(key))
    pre1 = len(tok.encode(PASSKEY_NEEDLE.split("{key}")[0]))
    pre2 = len(tok.encode(PASSKEY_NEEDLE.format(key=key).rsplit(str(key), 1)[0]))
    m1 = list(range(j + pre1, j + pre1 + len(kd)))
    m2 = list(range(j + pre2, j + pre2 + len(kd)))
    assert [toks[i] for i in m1] == kd and [toks[i] for i in m2] == kd, (key, j)
    # answer " 12345." at tokens[s:-1]; digits at s+1 .. s+5 (byte tokenizer: space is its own
    # token); the position predicting token i is i-1
    a = tok.encode(" " + str(key))
    assert toks[s:s + len(a)] == a
    dig = list(range(s + len(a) - len(kd), s + len(a)))
    geo.append(dict(colon=s - 1, space=dig[0] - 1, dig=dig, m1=m1, m2=m2, key=key, needle=j,
                    blk1={i // cfg.l_sel for i in m1}, blk2={i // cfg.l_sel for i in m2}))
X = torch.tensor([d[0] for d in ev])

# ---------------------------------------------------------------- capture machinery
CAP = {"on": False, "layer": None, "sel": {}, "gate": {}, "oracle": None, "x": {}}


def _select(q, k_cmp, lse, cfg_, starts=None, chunk=None, **kw):
    idx = select_topn(q, k_cmp, lse, cfg_, starts, chunk, **kw)
    if CAP["on"]:
        CAP["sel"][CAP["layer"]] = (q, k_cmp, lse, idx.clone(), kw.get("scores"))
    if CAP["oracle"] is not None:  # [B] needle block, [B] first position to override
        blk, t_from = CAP["oracle"]
        t = torch.arange(idx.shape[2]).view(1, 1, -1)
        over = t >= t_from.view(-1, 1, 1)
        idx = idx.clone()
        idx[..., -1] = torch.where(over, blk.view(-1, 1, 1), idx[..., -1])
    return idx


for li, a in enumerate(attn):
    a.telemetry = cfg.sel_distill > 0  # the distillation's KL (telemetry slot DISTILL)
    a.select_topn = _select
    def pre_hook(m, inp, li=li):  # returns None: the inputs stay as they are
        CAP["layer"] = li
        CAP["x"][li] = inp[0].detach()
    a.register_forward_pre_hook(pre_hook)
    a.gate.register_forward_hook(
        lambda m, inp, out, li=li: CAP["gate"].__setitem__(li, torch.sigmoid(out.detach()))
        if CAP["on"] else None)


def answer_metrics(logits):
    lp = F.log_softmax(logits.float(), -1)
    nll, ex = [], []
    for b, g in enumerate(geo):
        pos = torch.tensor(g["dig"]) - 1
        tg = X[b, g["dig"]]
        nll.append(-lp[b, pos, tg].mean().item())
        ex.append(bool((lp[b, pos].argmax(-1) == tg).all()))
    return sum(nll) / len(nll), sum(ex) / len(ex)


def evaluate():
    model.eval()
    set_n_sel(N_SEL)
    res = {}
    with torch.no_grad():
        CAP["on"], CAP["sel"], CAP["gate"] = True, {}, {}
        logits = model(X[:, :-1])
        CAP["on"] = False
        res["nll"], res["exact"] = answer_metrics(logits)
        # gates: mean per branch, all positions / the digit-predicting positions
        gl = []
        for li in sorted(CAP["gate"]):
            g = CAP["gate"][li].view(len(ev), T, cfg.n_heads, 3)
            ans = torch.stack([g[b, torch.tensor(geo[b]["dig"]) - 1] for b in range(len(ev))])
            gl.append("L%d all %s ans %s" % (li, "/".join(f"{v:.2f}" for v in g.mean((0, 1, 2))),
                                              "/".join(f"{v:.2f}" for v in ans.mean((0, 1, 2)))))
        res["gates"] = "; ".join(gl)
        if has_sel:
            res.update(selection_stats())
            # oracle selection: needle (2nd mention, last digit's block) forced into the free slot
            blk = torch.tensor([max(g["blk2"]) for g in geo])
            t_from = torch.tensor([g["colon"] for g in geo])
            CAP["oracle"] = (blk, t_from)
            res["o_nll"], res["o_exact"] = answer_metrics(model(X[:, :-1]))
            CAP["oracle"] = None
    model.train()
    return res


def selection_stats():
    out = {}
    Ns = -(-T // cfg.l_sel)
    for where in ("colon", "space"):
        hits = {"m1": [], "m2": [], "any": []}
        forced_l, free_hits, ranks, ncand, t_ranks = [], [], [], [], []
        for li in sorted(CAP["sel"]):
            q, k_cmp, lse, idx, scores = CAP["sel"][li]
            # the distillation's teacher: the selected branch's dense block mass (its keys from the
            # layer's input), ranked as the scores are
            cos, sin = rope_cos_sin(torch.arange(T), cfg.d_qk, cfg.rope_theta)
            k_sel = attn[li].project_kv(CAP["x"][li], "sel", cos, sin)[0]
            teacher = selected_target(q, k_sel, cfg,
                                      builder_info("causal").fn(MaskContext(cfg, len(ev), T, "cpu")))
            for b, g in enumerate(geo):
                t = g[where]
                if scores is not None:  # the indexer's (sel_scores = "indexer")
                    sc = scores[b, :, t]
                else:
                    sc = block_scores(q[b:b + 1], k_cmp[b:b + 1], None if lse is None else lse[b:b + 1],
                                      cfg, None, t, t + 1)[0, :, 0]  # [Hkv, Ns]
                valid, forced = forced_and_valid(cfg, T, torch.zeros(1, T, dtype=torch.long),
                                                 "cpu", t, t + 1)
                valid, forced = valid[0, 0], forced[0, 0]
                nb = g["blk1"] | g["blk2"]
                f = any(bool(forced[j]) for j in nb)
                for h in range(cfg.n_kv_heads):
                    chosen = set(idx[b, h, t].tolist())
                    h1, h2 = bool(chosen & g["blk1"]), bool(chosen & g["blk2"])
                    hits["m1"].append(h1), hits["m2"].append(h2), hits["any"].append(h1 or h2)
                    forced_l.append(f)
                    if not f:
                        free_hits.append(h1 or h2)
                        cand = [j for j in range(Ns) if valid[j] and not forced[j]]
                        s = sc[h]
                        best = max(s[j].item() for j in nb)
                        ranks.append(1 + sum(1 for j in cand if j not in nb and s[j].item() > best))
                        tt = teacher[b, h, t]
                        tbest = max(tt[j].item() for j in nb)
                        t_ranks.append(1 + sum(1 for j in cand if j not in nb and tt[j].item() > tbest))
                        ncand.append(len(cand))
        mean = lambda v: sum(v) / max(1, len(v))  # noqa: E731
        out[where] = (f"rec m1 {mean(hits['m1']):.2f} m2 {mean(hits['m2']):.2f} "
                      f"any {mean(hits['any']):.2f} forced {mean(forced_l):.2f} "
                      f"free {mean(free_hits):.2f} (n={len(free_hits)}) rank {mean(ranks):.2f}/"
                      f"{mean(ncand):.1f} top1 {mean([r == 1 for r in ranks]):.2f} | teacher rank "
                      f"{mean(t_ranks):.2f} top1 {mean([r == 1 for r in t_ranks]):.2f}")
    return out


# ---------------------------------------------------------------- training loop
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
t0 = time.time()
i = 0
losses = []
for step in range(args.steps + 1):
    x = torch.tensor([train.document(i + b)[0] for b in range(B)])
    set_n_sel(WARM_N if step < args.warm_steps else N_SEL)
    i += B
    lr = args.lr * min(1.0, (step + 1) / 100)
    for gparam in opt.param_groups:
        gparam["lr"] = lr
    loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    losses.append(loss.item())
    last = step == args.steps or (time.time() - t0) / 60 > args.max_minutes
    if step % args.every == 0 or last:
        kls = [float(a.telemetry_stats[DISTILL]) for a in attn]  # before evaluate() overwrites them
        r = evaluate()
        tl = sum(losses[-50:]) / len(losses[-50:])
        s = (f"{args.masks} step {step} loss {tl:.3f} ans_nll {r['nll']:.3f} exact {r['exact']:.2f}"
             f" t {time.time() - t0:.0f}s")
        if has_sel:
            s += f" | oracle nll {r['o_nll']:.3f} exact {r['o_exact']:.2f}"
            s += f"\n    sel@colon {r['colon']}\n    sel@space {r['space']}"
        s += f"\n    gates(cmp/sel/win) {r['gates']}"
        if cfg.sel_distill > 0:  # this step's distillation KL, per layer
            s += "\n    distill KL " + " ".join(f"L{li} {v:.3f}" for li, v in enumerate(kls))
        log(s)
    if last:
        break
log(f"# done {time.time() - t0:.0f}s, ln10={math.log(10):.3f}")
