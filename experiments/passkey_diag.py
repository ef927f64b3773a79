"""Teacher-forced passkey diagnostics of a checkpoint (NOTES entry 15): separates "the model cannot
copy" from "the evaluation is wrong".

    python experiments/passkey_diag.py --config titan_configs/debug_nsa.toml --checkpoint DUMP/checkpoint \
        [--override=--nsa.masks=full_causal] --length 256 [--n 40] [--gen 20] [--filler synthetic,fineweb]

For --n unseen training-distribution documents (PasskeyCorpus of seq_len --length, the run's
dataset_seed) and for --n needle_eval passkey prompts (+ the answer) per filler, one forward each,
teacher-forced: mean NLL per token, argmax accuracy and all-tokens-right on (a) the key's second
mention inside the needle (a short copy) and (b) the answer's key tokens (the long-range copy the
eval scores); the eval prompts also per depth. Chance on a byte digit is ln 10 = 2.30 nats. With
--gen, greedy exact match through needle_eval's decode (cache and full forward) on the first
--gen prompts. Answer tokens = PasskeyCorpus's answer without "." and EOS (a lone space token, byte
tokenizer, is skipped). --import MODULE imports a module first (e.g. cpu_flavors, with
PYTHONPATH=experiments, for its extra flavors).
"""

import argparse
import importlib
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

DEPTHS = (0, 25, 50, 75, 100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--override", action="append", default=[])
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--gen", type=int, default=0)
    p.add_argument("--filler", default="synthetic", help="comma list of synthetic, fineweb")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--import", dest="imports", action="append", default=[])
    a = p.parse_args(argv)
    for m in a.imports:
        importlib.import_module(m)
    import needle_eval as ne
    from nsa_flex.generate import build_model, load_checkpoint, load_job_config
    from nsa_flex.titan.data import PASSKEY_ANSWER, PasskeyCorpus

    jc = load_job_config(a.config, a.override)
    model, tok = build_model(jc, a.device, torch.float32)
    where = load_checkpoint(model, a.checkpoint)
    model.eval()
    L = a.length
    ne.set_backend(model, ne.pick_backend(model, L + 8, "auto", a.device))
    print(f"# {where}: {model.model_args.masks}, {jc.model.flavor}, {jc.model.tokenizer}, length {L}")

    @torch.no_grad()
    def measure(docs):
        """docs: (tokens [L+1], answer_start) -> {needle2, answer: [(nll, acc, exact)]}, doc loss."""
        res, losses = {"needle2": [], "answer": []}, []
        for s0 in range(0, len(docs), a.batch_size):
            chunk = docs[s0: s0 + a.batch_size]
            x = torch.tensor([d[0][:-1] for d in chunk], device=a.device)
            y = torch.tensor([d[0][1:] for d in chunk], device=a.device)
            logits = model(x).float()
            lp = F.log_softmax(logits, -1)
            losses.append(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item())
            for b, (t, s) in enumerate(chunk):
                kt = t[s:-2]  # the answer's key tokens
                nt = tok.encode(" " + tok.decode(kt).strip())  # the key as the needle tokenizes it
                hits = [j for j in range(s - len(nt)) if t[j: j + len(nt)] == nt]
                for name, start, n in (("needle2", hits[1] if len(hits) > 1 else None, len(nt)),
                                       ("answer", s, len(kt))):
                    if start is None:
                        continue
                    pos = list(range(start - 1, start - 1 + n))
                    if tok.decode([t[start]]) == " ":
                        pos = pos[1:]
                    tgt = y[b, pos]
                    ok = logits[b, pos].argmax(-1) == tgt
                    res[name].append((-lp[b, pos, tgt].mean().item(), ok.float().mean().item(), bool(ok.all())))
        return res, sum(losses) / (len(docs) * L)

    def fmt(v):
        n = max(len(v), 1)
        return (f"nll/tok {sum(r[0] for r in v) / n:.3f}  acc {sum(r[1] for r in v) / n:.2f}  "
                f"exact {sum(r[2] for r in v)}/{len(v)}")

    corpus = PasskeyCorpus(tok, L + 1, seed=jc.training.dataset_seed, split="train")
    res, loss = measure([corpus.document(10 ** 7 + i)[:2] for i in range(a.n)])
    print(f"train-dist docs    : loss {loss:.4f} | needle 2nd mention: {fmt(res['needle2'])} | answer: {fmt(res['answer'])}")
    for fk in a.filler.split(","):
        filler = ne.Filler(ne.Filler.resolve(fk, ne.DEFAULT_FINEWEB), tok, ne.DEFAULT_FINEWEB)
        prompts = [ne.make_prompt(tok, "passkey", L, DEPTHS[i % len(DEPTHS)], i // len(DEPTHS), filler)
                   for i in range(a.n)]
        docs = [(pr["tokens"] + tok.encode(PASSKEY_ANSWER.format(key=pr["expected"])) + [tok.eos_id],
                 len(pr["tokens"])) for pr in prompts]
        res, loss = measure(docs)
        print(f"eval {fk:9s} prompts: loss {loss:.4f} | needle 2nd mention: {fmt(res['needle2'])} | answer: {fmt(res['answer'])}")
        by = {}
        for i, r in enumerate(res["answer"]):
            by.setdefault(DEPTHS[i % len(DEPTHS)], []).append(r[1])
        print("    answer acc by depth: " + "  ".join(f"{d}%: {sum(v) / len(v):.2f}" for d, v in by.items()))
        if a.gen:
            gp = prompts[: a.gen]
            for mode in ("cache", "full"):
                try:
                    gens = ne.generate_batch(model, [q["tokens"] for q in gp], max(q["answer_tokens"] for q in gp) + 2,
                                             ne.decode_mode(model, mode), tok.eos_id, a.device)
                except ne.EvalError as e:
                    print(f"    greedy {mode}: {e}")
                    continue
                sc = [ne.score(tok.decode([t for t in g if t != tok.eos_id]), q["expected"]) for g, q in zip(gens, gp)]
                print(f"    greedy {mode}: {sum(s[0] for s in sc)}/{len(sc)} exact; e.g. "
                      + ", ".join(f"{s[1]}|{q['expected']}" for s, q in list(zip(sc, gp))[:4]))


if __name__ == "__main__":
    main()
