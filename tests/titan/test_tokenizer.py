"""Tokenizers of the torchtitan integration: byte (built in), tiktoken offline, local .tiktoken, errors."""

import base64
from pathlib import Path

import pytest

from nsa_flex.titan.tokenizer import (
    TOKENIZER_CHOICES,
    ByteTokenizer,
    TokenizerError,
    build_tokenizer,
    build_tokenizer_from_name,
)

ROOT = Path(__file__).resolve().parents[2]
TIKTOKEN_CACHE = ROOT.parent / "shared" / "data" / "tiktoken_cache"
needs_cache = pytest.mark.skipif(not TIKTOKEN_CACHE.is_dir(), reason=f"no tiktoken cache at {TIKTOKEN_CACHE}")


def test_byte_tokenizer():
    tok = ByteTokenizer()
    text = "Native Sparse Attention — ünïcødé ✓"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == 256 and ids[-1] == 257 and ids[1:-1] == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.get_vocab_size() == 258 and tok.eos_id == 257 and tok.bos_id == 256
    assert tok.encode("ab") == [97, 98]


@needs_cache
def test_tiktoken_offline(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    gpt2 = build_tokenizer_from_name("gpt2")
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode("Hello world", add_bos=True, add_eos=True) == [15496, 995, 50256]  # no BOS
    assert gpt2.get_vocab_size() == 50257 and gpt2.eos_id == 50256 and gpt2.bos_id is None
    assert gpt2.decode(gpt2.encode("a <|endoftext|> b")) == "a <|endoftext|> b"  # ordinary text
    cl = build_tokenizer_from_name("cl100k_base")
    assert cl.get_vocab_size() == 100277 and cl.eos_id == 100257
    assert cl.decode(cl.encode("long context retrieval")) == "long context retrieval"


def _write_tiktoken(path: Path, n: int = 256):
    path.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(n)))


def test_local_tiktoken_file(tmp_path):
    f = tmp_path / "bytes.tiktoken"
    _write_tiktoken(f)
    tok = build_tokenizer_from_name(str(f))
    assert tok.encode("ab", add_eos=True) == [97, 98, 256]
    assert tok.get_vocab_size() == 257 and tok.eos_id == 256
    assert tok.decode([104, 105]) == "hi"


def test_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError) as e:
        build_tokenizer_from_name("llama3")
    assert "'llama3'" in str(e.value) and all(c in str(e.value) for c in TOKENIZER_CHOICES)

    missing = tmp_path / "none.tiktoken"
    with pytest.raises(TokenizerError, match="does not exist") as e:
        build_tokenizer_from_name(str(missing))
    assert str(missing) in str(e.value)

    bad = tmp_path / "bad.tiktoken"
    bad.write_text("QQ== 0\n!!notbase64!! 1\n")
    with pytest.raises(TokenizerError, match="corrupt") as e:
        build_tokenizer_from_name(str(bad))
    assert str(bad) in str(e.value) and "line 2" in str(e.value)

    gaps = tmp_path / "gaps.tiktoken"
    gaps.write_text("QQ== 0\nQg== 5\n")
    with pytest.raises(TokenizerError, match="ranks are not"):
        build_tokenizer_from_name(str(gaps))


def test_tiktoken_unavailable_offline(monkeypatch, tmp_path):
    """An encoding missing from the cache on an offline machine: a clear error, not a hang."""
    import tiktoken.load
    import tiktoken.registry

    def offline(url):
        raise ConnectionError(f"offline: {url}")

    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(TokenizerError, match="TIKTOKEN_CACHE_DIR") as e:
        build_tokenizer_from_name("r50k_base")
    assert "r50k_base" in str(e.value) and "offline" in str(e.value)


def test_build_tokenizer_reads_model_section():
    from torchtitan.config import ConfigManager

    cfg = ConfigManager().parse_args(["--job.custom_config_module", "nsa_flex.titan.job_config"])
    assert cfg.model.tokenizer == "byte"
    assert isinstance(build_tokenizer(cfg), ByteTokenizer)
