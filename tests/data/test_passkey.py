"""The passkey corpus (nsa_flex/data/passkey.py): exact lengths, the answer span, the needle as a
plain copy for BPE tokenizers, depths, extra questions, the synthetic filler, and its errors."""

from pathlib import Path

import pytest

from nsa_flex.data.errors import DatasetError
from nsa_flex.data.passkey import (PASSKEY_NEEDLE, PASSKEY_QUESTION, PasskeyCorpus, passkey_document,
                                   synthetic_filler)
from nsa_flex.titan.tokenizer import ByteTokenizer, build_tokenizer_from_name

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
TIKTOKEN_CACHE = SHARED / "tiktoken_cache"
needs_shared = pytest.mark.skipif(not TIKTOKEN_CACHE.is_dir(), reason=f"tiktoken cache not found at {SHARED}")


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))


@pytest.mark.parametrize("seq_len", [128, 256, 1000, 8192])
def test_passkey_documents_exact_length_and_answer(seq_len):
    tok = ByteTokenizer()
    for i in range(5):
        toks, ans, key = passkey_document(tok, seq_len, i, seed=3)
        assert len(toks) == seq_len + 1
        assert toks[0] == tok.bos_id and toks[-1] == tok.eos_id
        text = tok.decode(toks)
        assert text.count(f"The pass key is: {key}. Remember it. The pass key is: {key}.") == 1
        assert text.count(":") == 3  # the cue: two needle mentions and the question
        assert text.endswith(f"What is the pass key? The pass key is: {key}.")
        assert tok.decode(toks[ans:-1]) == f" {key}."  # the space before the key is the answer's
        assert 10000 <= key <= 99999
        # deterministic
        assert passkey_document(tok, seq_len, i, seed=3) == (toks, ans, key)


@needs_shared
@pytest.mark.parametrize("name", ["byte", "gpt2", "cl100k_base"])
def test_passkey_answer_tokens_copy_the_needle(name, offline):
    """The answer's key tokens occur verbatim (same ids) in the needle, for byte and BPE tokenizers:
    retrieval is a plain copy. (With the question ending in "is " and the answer "12345." encoded
    alone, gpt2 gave "12","345" after a lone " " while the needle had " 12","345" -- never a copy.)"""
    tok = build_tokenizer_from_name(name)
    for seq_len in (256, 2048):
        for i in range(200):
            toks, ans, key = passkey_document(tok, seq_len, i)
            key_toks = toks[ans:-2]  # the answer without "." and EOS
            assert tok.decode(key_toks) == f" {key}"
            hits = [j for j in range(ans - len(key_toks)) if toks[j:j + len(key_toks)] == key_toks]
            assert len(hits) >= 2, (name, seq_len, i, key)  # both needle mentions


def test_passkey_depth_covers_both_ends():
    """Depth 0 puts the needle right after the head, depth 1 (the evaluation's 100%) right before
    the question, and a training draw just below 1 reaches that insertion point too (it never did
    with int(depth * n_fill): no training document had the needle next to the question)."""
    tok = ByteTokenizer()
    c = PasskeyCorpus(tok, 257)
    needle_q = PASSKEY_NEEDLE.format(key=12345) + PASSKEY_QUESTION
    assert needle_q in tok.decode(c.build(12345, 1.0)[0])
    assert c.build(12345, 1 - 1e-9) == c.build(12345, 1.0)
    assert needle_q not in tok.decode(c.build(12345, 0.5)[0])
    assert tok.decode(c.build(12345, 0.0)[0][1:]).startswith(PASSKEY_NEEDLE.format(key=12345))


def test_passkey_varies_with_index_seed_and_split():
    tok = ByteTokenizer()
    keys = [passkey_document(tok, 512, i)[2] for i in range(20)]
    assert len(set(keys)) > 15
    assert passkey_document(tok, 512, 0, seed=1) != passkey_document(tok, 512, 0, seed=2)
    assert passkey_document(tok, 512, 0, split="train") != passkey_document(tok, 512, 0, split="validation")
    # the needle's depth varies
    depths = {tok.decode(passkey_document(tok, 2048, i)[0]).index("The pass key is") for i in range(10)}
    assert len(depths) > 5


@pytest.mark.parametrize("seq_len", [256, 300, 512, 2048])
def test_passkey_questions_asks_q_times_after_the_needle(seq_len):
    """passkey_questions=q: the same document but q question+answer pairs (q-1 at random points after
    the needle, the last at the end), exact length, deterministic; q=1 is the plain document."""
    tok = ByteTokenizer()
    for i in range(20):  # at 256 / 300 the intro is dropped (it was, with extra questions, a wrong length)
        toks, ans, key = passkey_document(tok, seq_len, i, questions=2 if seq_len < 512 else 4)
        assert len(toks) == seq_len + 1 and toks[-1] == tok.eos_id
        text = tok.decode(toks)
        qa = PASSKEY_QUESTION + f" {key}."
        assert text.count(qa) == (2 if seq_len < 512 else 4) and text.endswith(qa)
        assert text.index(qa) > text.index(f"The pass key is: {key}. Remember it.")
        assert tok.decode(toks[ans:-1]) == f" {key}."
        assert passkey_document(tok, seq_len, i, questions=2 if seq_len < 512 else 4) == (toks, ans, key)
        one = passkey_document(tok, seq_len, i)
        assert one[2] == key and tok.decode(one[0]).count(qa) == 1
    # the extra questions sit at different distances from the needle
    gaps = {tok.decode(passkey_document(tok, seq_len, i, questions=2)[0]).index(PASSKEY_QUESTION)
            for i in range(10)}
    assert len(gaps) > 5


def test_synthetic_filler_is_a_repeated_passage_per_document():
    """The filler of a document repeats one passage of random sentences (period 3..100 sentences),
    different per document (seed) and deterministic; so most filler tokens are copies of earlier ones."""
    tok = ByteTokenizer()
    periods = set()
    for i in range(30):
        f = synthetic_filler(tok, 4000, f"train:0:{i}")
        assert len(f) >= 4000 and f == synthetic_filler(tok, 4000, f"train:0:{i}")
        text = tok.decode(f)
        period = next(p for p in range(20, len(text)) if text[p:p + 200] == text[:200])
        assert text[:len(text) - period] == text[period:]  # periodic
        periods.add(period)
    assert len(periods) > 20 and min(periods) < 300 and max(periods) > 1500
    docs = [tok.decode(passkey_document(tok, 1024, i)[0]) for i in range(5)]
    assert len({d[200:300] for d in docs}) == 5  # each document its own passage


def test_words_filler_is_periodic_and_only_copying_predicts_it():
    """``filler="words"``: a repeated passage of random pseudo-words, per document; unlike the
    sentences, almost no word recurs inside one passage (each repeat is predictable only by
    copying), and nothing holds the cue ":"."""
    tok = ByteTokenizer()
    periods = set()
    for i in range(30):
        f = synthetic_filler(tok, 6000, f"train:0:{i}", "words")
        assert f == synthetic_filler(tok, 6000, f"train:0:{i}", "words") != synthetic_filler(tok, 6000, f"train:0:{i}")
        text = tok.decode(f)
        assert ":" not in text and ".." not in text
        period = next(p for p in range(20, len(text)) if text[p:p + 100] == text[:100])
        assert text[:len(text) - period] == text[period:]
        words = text[:period].replace(".", "").split()
        assert len(set(words)) >= 0.8 * len(words)  # sentences repeat their 22-word lists instead
        periods.add(period)
    assert len(periods) > 20 and min(periods) < 200 and max(periods) > 1000
    corpus = PasskeyCorpus(tok, 1025, questions=4, filler="words")
    docs = [tok.decode(corpus.document(i)[0]) for i in range(3)]
    assert all("The grass" not in d and d.count("The pass key is:") == 2 + 4 for d in docs)


@pytest.mark.parametrize("bad", ["Words", "", None, "fineweb"])
def test_unknown_passkey_filler_names_the_field(bad):
    with pytest.raises(DatasetError, match=r"training.passkey_filler=.*must be one of sentences, words"):
        PasskeyCorpus(ByteTokenizer(), 513, filler=bad)


@pytest.mark.parametrize("bad", [0, 17, 2.0, True, "4"])
def test_passkey_questions_out_of_range_errors(bad):
    with pytest.raises(DatasetError, match=r"training.passkey_questions=.*must be an integer in \[1, 16\]"):
        passkey_document(ByteTokenizer(), 512, 0, questions=bad)
    with pytest.raises(DatasetError, match=r"passkey_questions=8 \(needs seq_len >= \d+"):
        passkey_document(ByteTokenizer(), 256, 0, questions=8)


def test_passkey_too_short_sequence_errors():
    with pytest.raises(DatasetError, match=r"seq_len=32 is too short.*needs seq_len >= \d+"):
        passkey_document(ByteTokenizer(), 32, 0)


@needs_shared
def test_passkey_with_gpt2_any_length(offline):
    tok = build_tokenizer_from_name("gpt2")
    for seq_len in (200, 4096, 32768):
        toks, ans, key = passkey_document(tok, seq_len, 7)
        assert len(toks) == seq_len + 1 and toks[-1] == tok.eos_id
        assert tok.decode(toks[ans:-1]) == f" {key}."  # the space before the key is the answer's


def repeat_distances(f: list[int]) -> int:
    """The period of a repeated passage of tokens (the copy distance of every repeat), past its
    first word (which has no leading space, so its repeats tokenize differently)."""
    return next(p for p in range(1, len(f)) if f[8 + p:p + 48] == f[8:48])


@needs_shared
def test_far_words_repeat_beyond_the_window_words_mostly_inside(offline):
    """``filler="far_words"``: the passage spans 16 .. n / 2 tokens, so about half of the copy
    distances of a 2048-token document exceed a 512-token window (the branches beyond the window
    must learn the copy); ``words`` keeps ~95% inside it. gpt2, as the curriculum."""
    tok = build_tokenizer_from_name("gpt2")
    dist = {k: [repeat_distances(synthetic_filler(tok, 2048, f"train:0:{i}", k)) for i in range(200)]
            for k in ("words", "far_words")}
    far = lambda k: sum(p > 512 for p in dist[k]) / len(dist[k])  # noqa: E731
    assert far("words") < 0.15 and far("far_words") > 0.35
    assert max(dist["far_words"]) <= 1024 + 64 and min(dist["far_words"]) < 200
    corpus = PasskeyCorpus(tok, 2048, questions=8, filler="far_words")
    doc = tok.decode(corpus.document(0)[0])
    assert doc.count("The pass key is:") == 2 + 8


def _key_copies(toks: list[int], key_toks: list[int]) -> list[int]:
    """Where each copy of the key's tokens starts (the needle's two, then each answer)."""
    n = len(key_toks)
    return [i for i in range(len(toks) - n + 1) if toks[i:i + n] == key_toks]


@pytest.mark.parametrize("seq_len,questions,gap", [(2048, 3, 512), (4096, 4, 700), (1000, 1, 700), (2048, 1, 0)])
def test_min_gap_puts_every_answer_that_far_after_its_key(seq_len, questions, gap):
    """passkey_min_gap: each answer starts >= gap tokens after the copy of its key before it (the
    needle's second mention, or the previous answer); the layouts vary; gap 0 is the plain corpus."""
    tok = ByteTokenizer()
    corpus = PasskeyCorpus(tok, seq_len + 1, seed=5, questions=questions, min_gap=gap)
    plain = PasskeyCorpus(tok, seq_len + 1, seed=5, questions=questions)
    firsts = set()
    for i in range(30):
        toks, ans, key = corpus.document(i)
        assert len(toks) == seq_len + 1 and tok.decode(toks[ans:-1]) == f" {key}." and toks[-1] == tok.eos_id
        copies = _key_copies(toks, tok.encode(f" {key}"))
        needle, answers = copies[:2], copies[2:]
        assert len(answers) == questions and answers[-1] == ans
        assert min(b - a for a, b in zip([needle[1]] + answers, answers)) >= gap
        firsts.add(answers[0] - needle[1])
        assert corpus.document(i) == (toks, ans, key)
        if gap == 0:
            assert plain.document(i) == (toks, ans, key)
    assert len(firsts) > 10  # not one fixed layout


def test_min_gap_share_gaps_that_share_of_the_documents_and_leaves_the_rest_anywhere():
    """passkey_min_gap_share: about that share of the documents keep every answer >= min_gap after
    its key, the others put answers anywhere (some nearer); share 1 is the gapped corpus document
    for document, share 0 the plain one; a share outside [0, 1] is one error naming the field."""
    tok = ByteTokenizer()
    args = dict(seed=3, questions=3, min_gap=400)
    half = PasskeyCorpus(tok, 2049, min_gap_share=0.5, **args)
    smallest = []
    for i in range(200):
        toks, ans, key = half.document(i)
        copies = _key_copies(toks, tok.encode(f" {key}"))
        assert len(copies) == 2 + 3 and copies[-1] == ans
        smallest.append(min(b - a for a, b in zip(copies[1:], copies[2:])))
    gapped = sum(g >= 400 for g in smallest)
    assert 70 <= gapped <= 130, gapped  # ~100 gapped, plus the few ungapped that land that far apart
    assert min(smallest) < 200
    everyone, plain = PasskeyCorpus(tok, 2049, **args), PasskeyCorpus(tok, 2049, seed=3, questions=3)
    ones, zeros = (PasskeyCorpus(tok, 2049, min_gap_share=s, **args) for s in (1.0, 0.0))
    for i in range(20):
        assert ones.document(i) == everyone.document(i) and zeros.document(i) == plain.document(i)
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(DatasetError, match=r"training.passkey_min_gap_share=.*must be a number in \[0, 1\]"):
            PasskeyCorpus(tok, 2049, min_gap_share=bad, **args)


def test_min_gap_that_does_not_fit_names_the_fields_and_the_length_it_needs():
    tok = ByteTokenizer()
    with pytest.raises(DatasetError, match=r"training.passkey_min_gap=512 with passkey_questions=8: 8 gaps of "
                                           r"512 tokens do not fit seq_len=2048 \(needs seq_len >= \d+"):
        PasskeyCorpus(tok, 2049, questions=8, min_gap=512)
    for bad in (-1, 1.5, True, "512"):
        with pytest.raises(DatasetError, match="training.passkey_min_gap=.*must be an integer >= 0"):
            PasskeyCorpus(tok, 2049, min_gap=bad)
    need = int(str(pytest.raises(DatasetError, PasskeyCorpus, tok, 2049, questions=8, min_gap=512).value)
               .split("needs seq_len >= ")[1].split(",")[0])
    PasskeyCorpus(tok, need + 1, questions=8, min_gap=512).document(0)  # the length it names fits
