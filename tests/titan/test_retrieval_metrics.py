"""Retrieval at validation (nsa_flex/titan/retrieval.py): which documents, the teacher-forced answer
loss / exact answers on exactly the answer's tokens, the fixed batch shape, and the errors."""

import math

import pytest
import torch
from torchtitan.config import ConfigManager

from nsa_flex.data.errors import DatasetError
from nsa_flex.data.passkey import PasskeyCorpus
from nsa_flex.titan import retrieval
from nsa_flex.titan.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
V = 260


def _docs(n, seq=160):
    return retrieval.probe_documents(PasskeyCorpus(TOK, seq + 1, split="validation"), n)


def _oracle(docs, wrong=lambda toks, ans, t: False):
    """logits_of that knows each row's document: the next token gets logit 20 at every position,
    except where ``wrong(toks, ans, t)`` (then the token after it does)."""
    by_row = {tuple(toks[:-1]): (toks, ans) for _, toks, ans in docs}
    shapes = []

    def logits_of(tokens, start):
        shapes.append((tuple(tokens.shape), start))
        out = torch.zeros(*tokens.shape, V)
        for b, row in enumerate(tokens.tolist()):
            toks, ans = by_row[tuple(row)]
            for t in range(len(toks) - 1):
                nxt = toks[t + 1] if not wrong(toks, ans, t + 1) else (toks[t + 1] + 1) % V
                out[b, t, nxt] = 20.0
        return out[:, start:]

    return logits_of, shapes


def test_exact_answers_and_loss_on_the_answer_tokens_only():
    docs = _docs(5)
    logits_of, shapes = _oracle(docs)
    m = retrieval.score(logits_of, docs, 2, "cpu")
    assert m["retrieval/passkey_exact"] == 1.0 and m["retrieval/passkey_digits"] == 1.0
    assert m["retrieval/passkey_answer_loss"] < 1e-6
    # the last batch padded: one shape for a compiled model; only the positions from the batch's
    # first answer-predicting one are asked for
    assert [shape for shape, _ in shapes] == [(2, 160)] * 3
    assert [start for _, start in shapes] == [min(ans for _, _, ans in docs[i:i + 2]) - 1 for i in (0, 2, 4)]
    assert "retrieval/multikey_exact" not in m
    # wrong everywhere but the answer: still exact; the answer's last token (".") wrong: not exact
    m = retrieval.score(_oracle(docs, lambda toks, ans, t: t < ans)[0], docs, 2, "cpu")
    assert m["retrieval/passkey_exact"] == 1.0
    m = retrieval.score(_oracle(docs, lambda toks, ans, t: t == len(toks) - 2)[0], docs, 2, "cpu")
    n_ans = len(docs[0][1]) - 1 - docs[0][2]  # " 12345." = 7 bytes
    assert n_ans == 7 and m["retrieval/passkey_exact"] == 0.0
    assert m["retrieval/passkey_digits"] == pytest.approx((n_ans - 1) / n_ans)
    assert m["retrieval/passkey_answer_loss"] == pytest.approx(20.0 / n_ans, rel=1e-3)
    # the EOS after the answer is not scored
    m = retrieval.score(_oracle(docs, lambda toks, ans, t: t == len(toks) - 1)[0], docs, 2, "cpu")
    assert m["retrieval/passkey_exact"] == 1.0
    # uniform logits: ln V per token
    m = retrieval.score(lambda x, start: torch.zeros(x.shape[0], x.shape[1] - start, V), docs, 4, "cpu")
    assert m["retrieval/passkey_answer_loss"] == pytest.approx(math.log(V)) and m["retrieval/passkey_exact"] == 0
    assert "passkey loss" in retrieval.summary(m)


def _job(*args):
    return ConfigManager().parse_args(["--job.custom_config_module", "nsa_flex.titan.job_config",
                                       "--validation.seq_len", "600", *args])


def test_documents_follow_the_training_data(tmp_path):
    corpus = retrieval.probe_corpus(_job(), TOK)  # dataset passkey
    assert isinstance(corpus, PasskeyCorpus) and corpus.split == "validation" and corpus.length == 601
    assert retrieval.probe_corpus(_job("--training.dataset", "local", "--training.dataset_path", "x.txt"), TOK) is None
    mixed = retrieval.probe_corpus(_job("--training.dataset", "local", "--training.passkey_mix", "0.2"), TOK)
    assert isinstance(mixed, PasskeyCorpus)
    from nsa_flex.data.pysource import split_of

    train, val = (next(f"p{i}" for i in range(999) if split_of(f"p{i}") == s) for s in ("train", "validation"))
    for name in (train, val):
        (tmp_path / name).mkdir()
        (tmp_path / name / "core.py").write_text(f"def f(x):\n    return x  # {name}\n" * 300)
    code = retrieval.probe_corpus(_job("--training.dataset", "pysource", "--training.dataset_path", str(tmp_path)), TOK)
    docs = retrieval.probe_documents(code, 8)
    assert {k for k, _, _ in docs} == {"passkey", "multikey"}
    texts = [TOK.decode(t) for _, t, _ in docs]
    assert all(f"# {val}\n" in x and f"# {train}\n" not in x for x in texts)  # held-out packages only


def test_retrieval_docs_range_is_checked():
    assert retrieval.check_docs(0) == 0 and retrieval.check_docs(16) == 16
    for bad in (-1, 5000, 2.5, True, "8"):
        with pytest.raises(DatasetError, match=r"validation.retrieval_docs=.*must be an integer in \[0, 1024\]"):
            retrieval.check_docs(bad)
    with pytest.raises(DatasetError, match=r"validation.retrieval_recall_docs=-1: must be an integer"):
        retrieval.check_docs(-1, "retrieval_recall_docs")


def test_exact_answers_split_by_the_needles_distance_from_the_window():
    """far_from (the model's window): documents whose needle is more than that many tokens before
    the answer count in _exact_far, the others in _exact_near; a model right only on the near ones
    (its window copies, nothing else) shows 100% near and 0% far."""
    docs = _docs(12, seq=400)
    dists = [retrieval.needle_distance(toks, ans) for _, toks, ans in docs]
    assert all(d is not None and 0 < d < 400 for d in dists)
    for _, toks, ans in docs:  # the key's first occurrence is the needle's
        d = retrieval.needle_distance(toks, ans)
        assert toks[ans - d:ans - d + 5] == toks[ans:ans + 5]
    far_from = sorted(dists)[len(dists) // 2]
    near_only = lambda toks, ans, t: t >= ans and retrieval.needle_distance(toks, ans) > far_from  # noqa: E731
    m = retrieval.score(_oracle(docs, near_only)[0], docs, 4, "cpu", far_from=far_from)
    n_far = sum(d > far_from for d in dists)
    assert 0 < n_far < len(docs)
    assert m["retrieval/passkey_exact_near"] == 1.0 and m["retrieval/passkey_exact_far"] == 0.0
    assert m["retrieval/passkey_exact"] == pytest.approx(1 - n_far / len(docs))
    assert "(near 100%, far 0%)" in retrieval.summary(m)
    assert "retrieval/passkey_exact_far" not in retrieval.score(_oracle(docs)[0], docs, 4, "cpu")


def _debug_model(masks="nsa"):
    import copy

    from nsa_flex.titan.args import nsa_flex_args
    from nsa_flex.titan.model import NSATransformer

    args = copy.deepcopy(nsa_flex_args["debugmodel"])
    args.masks = masks
    torch.manual_seed(0)
    model = NSATransformer(args)
    with torch.no_grad():
        model.init_weights()
    return model.eval()


def test_selection_recall_counts_far_unforced_needles_at_the_question():
    """selection_recall: over the documents whose needle lies beyond far_from and outside block 0,
    the share of (layer, KV group) whose picks at the position predicting the answer's first token
    hold a needle block -- what each document alone gives, read from its own picks; batches of
    RECALL_BATCH rows (the last one padded) change nothing; n caps the documents; no selecting
    layer, no metric."""
    from nsa_flex.selection import QuestionPicks

    model = _debug_model()
    cfg = model.nsa_config
    docs = _docs(11, seq=200)
    kind, toks, ans = docs[0]
    key = toks[ans:len(toks) - 2]
    docs.append((kind, toks[:2] + key + toks[2 + len(key):], ans))  # its needle's first copy in block 0
    far_from = 140  # the needles lie 91-169 tokens back
    counted = []
    for kind, toks, ans in docs:
        d = retrieval.needle_distance(toks, ans)
        needle = list(range(ans - d, ans - d + len(toks) - 2 - ans))
        if d > far_from and needle[0] // cfg.l_sel != 0:
            counted.append((toks, ans, needle))
    assert 3 <= len(counted) < len(docs) - 1  # some near, one in block 0: not counted
    assert len(counted) % retrieval.RECALL_BATCH  # a padded last batch

    def alone(toks, ans, needle):  # -> recall per selecting layer
        with torch.no_grad(), QuestionPicks(model, [ans]) as qp:
            model(torch.tensor([toks[:ans]]))
        blocks = {p // cfg.l_sel for p in needle}
        return [sum(bool(set(p[0, g].tolist()) & blocks) for g in range(p.shape[1])) / p.shape[1]
                for _, p in sorted(qp.picks.items())]

    layers = torch.tensor([alone(*c) for c in counted])  # [documents, selecting layers]
    want = layers.mean(1).tolist()
    assert 0 < sum(want) < len(want)  # neither all nor no needle picked: the test can tell
    by_layer = layers.mean(0)
    assert layers.shape[1] >= 2 and by_layer.max() > by_layer.min()  # the best layer can be told apart
    calls = []

    def forward(tokens):
        calls.append(tuple(tokens.shape))
        model(tokens)

    m = retrieval.selection_recall(model, forward, docs, far_from, 100, "cpu")
    assert m == {"retrieval/passkey_sel_recall": pytest.approx(sum(want) / len(want)),
                 "retrieval/passkey_sel_recall_best": pytest.approx(float(by_layer.max())),
                 "retrieval/passkey_sel_recall_best_layer": int(by_layer.argmax())}
    assert (f"sel recall {sum(want) / len(want):.2f} (best layer {int(by_layer.argmax())} "
            f"{float(by_layer.max()):.2f})") in retrieval.summary({**retrieval.score(_oracle(docs)[0], docs, 4, "cpu"), **m})
    assert set(calls) == {(retrieval.RECALL_BATCH, 200)}
    first_two = retrieval.selection_recall(model, model, docs, far_from, 2, "cpu")
    assert first_two["retrieval/passkey_sel_recall"] == pytest.approx(sum(want[:2]) / 2)
    assert "sel recall" in retrieval.summary({**retrieval.score(_oracle(docs)[0], docs, 4, "cpu"), **m})
    assert retrieval.selection_recall(_debug_model("full_causal"), lambda t: None, docs, far_from, 100, "cpu") == {}

    # blocks compiled as training compiles them (fullgraph): the probe runs them eagerly -- the
    # same recall, and no recompile (a wrapped select_topn fails the graphs' guards: recompiling
    # every block at every validation)
    compiles = []

    def backend(gm, inputs):
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, backend=backend, fullgraph=True))
    with torch.no_grad():
        model(torch.tensor([docs[0][1][:-1]] * retrieval.RECALL_BATCH))
    n = len(compiles)
    assert n >= 1
    assert retrieval.selection_recall(model, model, docs, far_from, 100, "cpu") == m
    assert len(compiles) == n
