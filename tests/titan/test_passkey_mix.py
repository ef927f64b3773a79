"""``[training] passkey_mix``: a text dataset with a fraction of its packed sequences replaced by
generated passkey documents (the ablation configs' data): which sequences, their content, the text
stream left intact, DP sharding, resume, the trainer's loader, and the errors."""

from pathlib import Path

import pytest
from torchtitan.config import ConfigManager

from nsa_flex.data.errors import DatasetError
from nsa_flex.data.packing import PackedTokenDataset
from nsa_flex.data.passkey import PasskeyCorpus
from nsa_flex.titan import retrieval
from nsa_flex.titan.data import build_dataloader
from nsa_flex.titan.tokenizer import ByteTokenizer

SEQ = 200
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
FINEWEB = SHARED / "fineweb_edu_sample_150.parquet"


class ListSource:
    """Minimal stateful document source (the interface PackedTokenDataset uses)."""

    def __init__(self, docs):
        self.docs, self.i = docs, 0

    def shard(self, rank, world):
        self.docs = self.docs[rank::world]

    def __iter__(self):
        while self.i < len(self.docs):
            self.i += 1
            yield self.docs[self.i - 1]

    def next_epoch(self):
        self.i = 0

    def restart(self):
        self.i = 0

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, sd):
        self.i = sd["i"]

    def describe(self):
        return "list"


TOK = ByteTokenizer()
DOCS = [TOK.encode(f"document {i}: " + "lorem ipsum " * (i % 23 + 3), add_bos=True, add_eos=True)
        for i in range(400)]


def _ds(mix, rank=0, world=1, seed=0):
    corpus = PasskeyCorpus(TOK, SEQ + 1, seed=seed)
    return PackedTokenDataset(ListSource(DOCS), SEQ, rank, world, passkey=corpus, passkey_mix=mix)


def _take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


def _seq(sample):
    inp, lab = sample
    return inp["input"].tolist() + lab[-1:].tolist()


def test_mix_fraction_content_and_text_stream():
    plain = [_seq(s) for s in _take(_ds(0.0), 150)]
    ds = _ds(0.3)
    mixed = [_seq(s) for s in _take(ds, 200)]
    corpus = PasskeyCorpus(TOK, SEQ + 1)
    is_pk = [ds.is_passkey(k) for k in range(200)]
    assert 0.2 < sum(is_pk) / 200 < 0.4, sum(is_pk)
    text = []
    for k, (x, pk) in enumerate(zip(mixed, is_pk)):
        if pk:
            assert x == corpus.document(k)[0]
            assert "What is the pass key? The pass key is" in TOK.decode(x)
        else:
            text.append(x)
    assert text == plain[: len(text)]  # the text stream goes on unchanged in the other sequences
    assert [_ds(0.3, seed=1).is_passkey(k) for k in range(200)] != is_pk
    assert all(_ds(1.0).is_passkey(k) for k in range(50))
    assert not any(_ds(0.0).is_passkey(k) for k in range(50))


def test_mix_dp_sharding_and_resume():
    """Rank r of 2: its k-th sequence is passkey document 2k + r when that global index is drawn
    (disjoint across ranks, the 1-rank mix interleaved), else the next sequence of its own documents."""
    one = [_seq(s) for s in _take(_ds(0.5), 60)]
    corpus = PasskeyCorpus(TOK, SEQ + 1)
    for r in (0, 1):
        ds = _ds(0.5, r, 2)
        got = [_seq(s) for s in _take(ds, 30)]
        own_text = [_seq(s) for s in _take(PackedTokenDataset(ListSource(DOCS[r::2]), SEQ), 30)]
        text = []
        for k, x in enumerate(got):
            if ds.is_passkey(2 * k + r):
                assert x == corpus.document(2 * k + r)[0] == one[2 * k + r]
            else:
                text.append(x)
        assert 5 < len(text) < 25 and text == own_text[: len(text)]
    ds = _ds(0.5)
    it = iter(ds)
    for _ in range(23):
        next(it)
    state = ds.state_dict()
    rest = [_seq(next(it)) for _ in range(15)]
    again = _ds(0.5)
    again.load_state_dict(state)
    assert [_seq(s) for s in _take(again, 15)] == rest == one[23:38]


def _job(*args):
    return ConfigManager().parse_args(["--job.custom_config_module", "nsa_flex.titan.job_config", *args])


@pytest.mark.parametrize("bad", ["1.5", "-0.1"])
def test_mix_bad_values_name_the_field(bad, tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("some text\n\nmore text\n")
    job = _job("--training.dataset", "local", "--training.dataset_path", str(f), "--training.passkey_mix", bad)
    with pytest.raises(DatasetError, match=f"training.passkey_mix={bad}"):
        build_dataloader(1, 0, TOK, job)


def test_mix_on_passkey_dataset_is_an_error():
    with pytest.raises(DatasetError, match="passkey_mix=0.5.*text dataset"):
        build_dataloader(1, 0, TOK, _job("--training.passkey_mix", "0.5"))


@pytest.mark.skipif(not FINEWEB.is_file(), reason=f"{FINEWEB} not found")
def test_trainer_loader_mixes_fineweb_and_passkey(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    job = _job("--training.dataset", "fineweb_edu", "--training.dataset_path", str(FINEWEB),
               "--training.passkey_mix", "0.5", "--training.seq_len", "256", "--training.local_batch_size", "8")
    batch, _ = next(iter(build_dataloader(1, 0, TOK, job)))
    texts = [TOK.decode(row.tolist()) for row in batch["input"]]
    n_pk = sum("What is the pass key? The pass key is" in t for t in texts)
    ds = PackedTokenDataset(None, 256, passkey=PasskeyCorpus(TOK, 257), passkey_mix=0.5)
    assert n_pk == sum(ds.is_passkey(k) for k in range(8)) and 0 < n_pk < 8


def test_passkey_filler_reaches_training_and_validation_documents():
    """``[training] passkey_filler = "words"``: the passkey dataset's documents, a text dataset's mixed-in
    documents and the validation's retrieval documents all repeat pseudo-words, not sentences; a bad
    value is one error naming the field."""
    def texts(*args):
        job = _job("--training.seq_len", "512", "--training.local_batch_size", "4", *args)
        batch, _ = next(iter(build_dataloader(1, 0, TOK, job)))
        return [TOK.decode(row.tolist()) for row in batch["input"]], job

    sentences, _ = texts()
    words, job = texts("--training.passkey_filler", "words", "--training.passkey_questions", "4")
    assert all("The pass key is:" in t for t in sentences + words)
    assert sum(" is " in t.split("The pass key")[0] for t in sentences) >= 3  # "The sky is blue. "
    assert not any(w in t for t in words for w in ("The sky", "The grass", "The river", " walked to "))
    assert retrieval.probe_corpus(job, TOK).filler == "words"
    with pytest.raises(DatasetError, match="training.passkey_filler='prose': must be one of sentences, words"):
        texts("--training.passkey_filler", "prose")


def test_loader_workers_run_in_their_own_process_group():
    """A stop signal sent to the training's process group (``timeout``, Ctrl-C) must not end the
    loader's workers: each runs in a group of its own, and still ends with the loader."""
    import os

    job = _job("--training.seq_len", "128", "--training.local_batch_size", "2",
               "--training.dataloader.num_workers", "1")
    it = iter(build_dataloader(1, 0, TOK, job))
    batch, _ = next(it)
    assert batch["input"].shape == (2, 128)
    (worker,) = it._workers
    assert os.getpgid(worker.pid) == worker.pid != os.getpgrp()
    it._shutdown_workers()
    worker.join(timeout=30)
    assert not worker.is_alive()


def test_passkey_min_gap_reaches_the_training_documents_not_the_validation():
    """``[training] passkey_min_gap``: the passkey dataset's documents (single- and multi-key corpus
    alike) put every answer that far after its key's earlier copy; validation documents ask once,
    anywhere; a gap that does not fit is one error naming both fields."""
    from nsa_flex.titan.data import build_validation_dataloader

    def batch(*args, validation=False):
        job = _job("--training.seq_len", "2048", "--training.local_batch_size", "8", "--training.passkey_questions",
                   "2", "--validation.seq_len", "2048", "--validation.local_batch_size", "8",
                   "--validation.dataset", "passkey", "--validation.steps", "1", *args)
        build = build_validation_dataloader if validation else build_dataloader
        return next(iter(build(1, 0, TOK, job)))[0]["input"].tolist()

    def gaps(rows):
        out = []
        for row in rows:
            text = TOK.decode(row)
            if "What is the pass key? The pass key is:" not in text:
                continue  # a multi-key document
            key = text.split("The pass key is: ")[1][:5]
            copies = [i for i in range(len(text)) if text.startswith(f": {key}", i)]
            out.append(min(b - a for a, b in zip(copies[1:], copies[2:])))
        return out

    assert min(gaps(batch())) < 400  # questions anywhere
    assert min(gaps(batch("--training.passkey_min_gap", "400"))) >= 400
    assert min(gaps(batch("--training.passkey_min_gap", "400", "--training.passkey_keys", "4"))) >= 400
    assert min(gaps(batch("--training.passkey_min_gap", "400", validation=True))) < 400
    with pytest.raises(DatasetError, match="training.passkey_min_gap=1000 with passkey_questions=2"):
        batch("--training.passkey_min_gap", "1000")
    # a share of the documents gapped, the others anywhere (the byte tokenizer: 400 characters)
    mixed = gaps(batch("--training.passkey_min_gap", "400", "--training.passkey_min_gap_share", "0.5"))
    assert min(mixed) < 400 <= max(mixed)


def test_preflight_names_each_bad_passkey_field_with_the_data_rule():
    """nsa-train --preflight's config check lists each out-of-range passkey field with the error the
    run's data loader would stop with (nsa_flex.data.passkey's checks), all at once."""
    from nsa_flex.titan.preflight import config_problems
    from nsa_flex.titan.train import merged_job_config

    jc = merged_job_config()()
    t = jc.training
    t.passkey_questions, t.passkey_keys, t.passkey_min_gap, t.passkey_min_gap_share = 0, 17, -1, 1.5
    probs = config_problems(jc)
    for want in ("training.passkey_questions=0: must be an integer in [1, ",
                 "training.passkey_keys=17: must be an integer in [1, ",
                 "training.passkey_min_gap=-1: must be an integer >= 0",
                 "training.passkey_min_gap_share=1.5: must be a number in [0, 1]"):
        assert any(p.startswith(want) for p in probs), (want, probs)
    t.passkey_questions, t.passkey_keys, t.passkey_min_gap, t.passkey_min_gap_share = 3, 8, 512, 0.5
    assert not any("passkey" in p for p in config_problems(jc))
