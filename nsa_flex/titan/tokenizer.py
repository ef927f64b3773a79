"""Tokenizers for nsa_flex training: a built-in byte-level tokenizer and tiktoken encodings.

Selected by ``[model] tokenizer``:
  * ``byte`` (default, no files): UTF-8 bytes 0..255, BOS=256, EOS=257, vocab 258.
  * ``gpt2`` / ``r50k_base`` / ``cl100k_base``: tiktoken encodings. Offline through tiktoken's own cache:
    ``TIKTOKEN_CACHE_DIR`` must point at a pre-filled cache; when unset, it defaults to
    ``../shared/data/tiktoken_cache`` (next to the project root or the working directory) if that exists.
  * a path to a ``.tiktoken`` BPE file (base64 token + rank per line); split pattern of cl100k_base,
    ``<|endoftext|>`` appended as the one special token.

tiktoken tokenizers follow the GPT-2 convention: documents are separated by ``<|endoftext|>`` only
(``eos_id``); they have no BOS (``bos_id is None``; ``add_bos`` is ignored).
"""

import base64
import os

from torchtitan.components.tokenizer import BaseTokenizer

from nsa_flex.errors import UserError

TIKTOKEN_ENCODINGS = ("gpt2", "r50k_base", "cl100k_base")
TOKENIZER_CHOICES = ("byte",) + TIKTOKEN_ENCODINGS + ("<path>.tiktoken",)

# split pattern of cl100k_base (used for local .tiktoken files)
_CL100K_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)


class TokenizerError(UserError, ValueError):
    """Unknown tokenizer name, missing or corrupt tokenizer file, encoding not available offline."""


class ByteTokenizer(BaseTokenizer):
    """UTF-8 byte-level tokenizer: ids 0..255 are bytes, 256 = BOS, 257 = EOS. Needs no files."""

    name = "byte"

    def __init__(self):
        super().__init__()
        self.bos_id = 256
        self.eos_id = 257

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False, **kwargs) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids, **kwargs) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return 258


class TiktokenTokenizer(BaseTokenizer):
    """A tiktoken ``Encoding``; EOS = ``<|endoftext|>``, no BOS."""

    def __init__(self, encoding, name: str):
        super().__init__()
        self.encoding = encoding
        self.name = name
        self.bos_id = None
        self.eos_id = encoding.eot_token

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False, **kwargs) -> list[int]:
        # special tokens inside the text are encoded as ordinary text, never as control tokens
        ids = self.encoding.encode_ordinary(text)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids, **kwargs) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def get_vocab_size(self) -> int:
        return self.encoding.n_vocab


def _load_tiktoken_file(path: str):
    import tiktoken

    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer file {path!r} does not exist (choices: {list(TOKENIZER_CHOICES)})")
    ranks: dict[bytes, int] = {}
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f.read().splitlines(), 1):
                if not line.strip():
                    continue
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except Exception as e:
        raise TokenizerError(
            f"corrupt tiktoken file {path!r}: line {lineno} is not '<base64 token> <rank>' ({e})"
        ) from e
    if not ranks:
        raise TokenizerError(f"corrupt tiktoken file {path!r}: no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"corrupt tiktoken file {path!r}: ranks are not 0..{len(ranks) - 1}")
    try:
        enc = tiktoken.Encoding(
            name=os.path.basename(path),
            pat_str=_CL100K_PAT,
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": len(ranks)},
        )
    except Exception as e:
        raise TokenizerError(f"corrupt tiktoken file {path!r}: {e}") from e
    return TiktokenTokenizer(enc, name=path)


def default_tiktoken_cache() -> str | None:
    """The project's pre-filled offline tiktoken cache, if one exists: ``shared/data/tiktoken_cache``
    beside (``../shared``) or inside (``./shared``) the project root or the working directory."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for base in (root, os.getcwd()):
        for parent in (os.path.dirname(base), base):
            cache = os.path.join(parent, "shared", "data", "tiktoken_cache")
            if os.path.isdir(cache):
                return cache
    return None


def build_tokenizer_from_name(name: str) -> BaseTokenizer:
    """Build a tokenizer from its ``[model] tokenizer`` name (see module docstring)."""
    if name == "byte":
        return ByteTokenizer()
    if name in TIKTOKEN_ENCODINGS:
        import tiktoken

        if "TIKTOKEN_CACHE_DIR" not in os.environ and default_tiktoken_cache():
            # tiktoken reads its cache location from this variable only
            os.environ["TIKTOKEN_CACHE_DIR"] = default_tiktoken_cache()

        try:
            enc = tiktoken.get_encoding(name)
        except Exception as e:
            cache = os.environ.get("TIKTOKEN_CACHE_DIR")
            raise TokenizerError(
                f"tiktoken encoding {name!r} could not be loaded (TIKTOKEN_CACHE_DIR={cache!r}). "
                "Offline machines need a pre-filled tiktoken cache, e.g. "
                f"TIKTOKEN_CACHE_DIR=../shared/data/tiktoken_cache. Cause: {type(e).__name__}: {e}"
            ) from e
        return TiktokenTokenizer(enc, name=name)
    if name.endswith(".tiktoken") or os.sep in name:
        return _load_tiktoken_file(name)
    raise TokenizerError(f"unknown tokenizer {name!r}; choices: {list(TOKENIZER_CHOICES)}")


def build_tokenizer(job_config) -> BaseTokenizer:
    """TrainSpec.build_tokenizer_fn: the tokenizer named by ``[model] tokenizer`` (default byte)."""
    return build_tokenizer_from_name(getattr(job_config.model, "tokenizer", "byte"))


def padded_vocab(job_config, multiple: int) -> tuple[int, int | None]:
    """(the tokenizer's vocab size padded up to a multiple of ``multiple``, its EOS id or None):
    the embedding and output sizes of every nsa_flex model."""
    tok = build_tokenizer(job_config)
    m = max(1, multiple)
    return -(-tok.get_vocab_size() // m) * m, tok.eos_id
