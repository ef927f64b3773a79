"""Generated multi-key retrieval documents (``[training] passkey_keys``, nsa_flex/data/retrieval.py):
the answers' copy distances that make the selection learn (the sliding window learns the near
ones alone), the questions' names, the documents' shape and the field's errors."""

import random
import re
from collections import Counter

import pytest

from nsa_flex.data.errors import DatasetError
from nsa_flex.data.passkey import PasskeyCorpus, check_keys, cue_id
from nsa_flex.data.retrieval import RetrievalCorpus, extra_names, synthetic_retrieval
from nsa_flex.data.sources import build_source
from nsa_flex.titan.tokenizer import ByteTokenizer, build_tokenizer_from_name

from .test_passkey import needs_shared, offline  # noqa: F401  (a fixture)


def answer_distances(tok, toks: list[int]) -> list[int]:
    """For every answer of a document (each statement of a key after its needle's two), the tokens
    back to the nearest earlier statement of the same key: the copy the model must make."""
    cue, seen, out = cue_id(tok), {}, []
    for i, t in enumerate(toks):
        if t != cue:
            continue
        m = re.match(r" (\d{5})\.", tok.decode(toks[i + 1:i + 6]))
        if m is None:
            continue
        at = seen.setdefault(m.group(1), [])
        if len(at) >= 2:
            out.append(i - at[-1])
        at.append(i)
    return out


@needs_shared
def test_multikey_documents_ask_far_where_single_key_answers_copy_nearby(offline):  # noqa: F811
    """Single-key documents with 8 questions (the short phase's old recipe): ~3% of the answers lie
    more than 512 tokens after an earlier copy of the key (entry 76 of experiments/NOTES.md: NSA
    learned those in its window only). With 4 keys and 4 questions, half the documents multi-key:
    far answers are many times more common, per document and per answer."""
    tok = build_tokenizer_from_name("gpt2")
    docs = 120

    def far(corpus):
        d = [x for g in range(docs) for x in answer_distances(tok, corpus.document(g)[0])]
        return sum(x > 512 for x in d) / docs, sum(x > 512 for x in d) / len(d)

    per_doc_1, share_1 = far(PasskeyCorpus(tok, 2049, questions=8, filler="far_words"))
    per_doc_4, share_4 = far(synthetic_retrieval(tok, 2049, questions=4, filler="far_words", keys=4))
    assert share_1 < 0.06 and per_doc_1 < 0.4
    assert share_4 > 0.3 and per_doc_4 > 4 * per_doc_1


def test_extra_questions_name_each_other_person_once_first():
    rng = random.Random(0)
    for n_keys, n in ((4, 3), (4, 7), (8, 7), (2, 3), (1, 2)):
        names = extra_names(rng, n_keys, n)
        assert len(names) == n
        first = names[:n_keys - 1]
        if n_keys > 1:
            assert 0 not in names and len(set(first)) == len(first)
            assert set(first) == set(range(1, n_keys)) or n < n_keys - 1
        counts = Counter(names)
        assert max(counts.values()) - min(counts.values()) <= 1  # cycles through the names


@pytest.mark.parametrize("keys", [1, 4])
def test_generated_documents_exact_length_with_both_kinds(keys):
    tok = ByteTokenizer()
    corpus = synthetic_retrieval(tok, 4097, seed=2, questions=3, filler="far_words", keys=keys)
    assert isinstance(corpus, PasskeyCorpus if keys == 1 else RetrievalCorpus)
    kinds = Counter()
    for g in range(12):
        toks, ans, key = corpus.document(g)
        assert len(toks) == 4097 and toks[-1] == tok.eos_id
        assert tok.decode(toks[ans:-1]) == f" {key}."
        assert corpus.document(g) == (toks, ans, key)  # deterministic
        kinds[getattr(corpus, "kind", lambda g: "passkey")(g)] += 1
        if keys == 4 and kinds and corpus.kind(g) == "multikey":
            assert len(re.findall(r"The pass key of \w+ is: \d{5}\. Remember", tok.decode(toks))) == 4
    assert set(kinds) == ({"passkey"} if keys == 1 else {"passkey", "multikey"})


def test_passkey_dataset_takes_the_keys():
    tok = ByteTokenizer()
    src = build_source("passkey", None, tok, 2048, passkey_questions=2, passkey_filler="far_words",
                       passkey_keys=3)
    assert isinstance(src.corpus, RetrievalCorpus) and src.corpus.n_keys == 3
    assert src.corpus.synthetic == "far_words" and src.corpus.questions == 2
    assert len(next(iter(src))) == 2049


@pytest.mark.parametrize("bad", [0, 17, 2.0, True, "4"])
def test_passkey_keys_out_of_range_names_the_field(bad):
    with pytest.raises(DatasetError, match=r"training.passkey_keys=.*must be an integer in \[1, 16\]"):
        check_keys(bad)


def test_unknown_synthetic_filler_is_refused():
    with pytest.raises(DatasetError, match="passkey_filler"):
        RetrievalCorpus(ByteTokenizer(), 2049, None, 0, n_keys=2, synthetic="prose")


def test_retrieval_corpus_needs_a_filler():
    with pytest.raises(DatasetError, match="need a filler"):
        RetrievalCorpus(ByteTokenizer(), 2049, None, 0, n_keys=2)
