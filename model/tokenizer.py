"""The checkpoint's tokenizer, in either format users ship: ``tokenizer.json`` (HF tokenizers) or ``tiktoken.model``
(Kimi K2 / K2.5 / K2.6: byte-level BPE ranks, special tokens in ``tokenizer_config.json``). The worker detokenizes
with it (stop strings); the smg gateway reads the same files (``GetTokenizer``) and picks them in the same order:
``tokenizer.json`` first, then ``tiktoken.model``, then any ``*.tiktoken``.

A tiktoken checkpoint is read as Kimi's ``tokenization_kimi.py`` defines it: ``N`` BPE ranks (``base64(bytes)
rank`` per line), then 256 special ids ``N .. N+255`` named by ``added_tokens_decoder`` (the unnamed ones
``<|reserved_token_{id}|>``), Kimi's split pattern when the checkpoint says it is Kimi (``tokenization_kimi`` in
``tokenizer_config.json``, or ``model_type`` kimi_k2 / kimi_k25 / kimi_k3), else cl100k's.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from tokenizers import Tokenizer

NUM_RESERVED_SPECIAL = 256
KIMI_MODEL_TYPES = ("kimi_k2", "kimi_k25", "kimi_k3")
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
                  r"""\s*[\r\n]|\s+(?!\S)|\s+""")


class CheckpointTokenizer:
    """``tokenizer.json`` through HF tokenizers. ``special``: name → id of each added token it marks special (the
    chat template's markers, EOS)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


class TiktokenTokenizer:
    """A ``tiktoken.model`` checkpoint (module docstring). ``special``: name → id of every special token;
    ``skipped``: the ids ``skip_special_tokens`` drops (the named ones, as smg drops them)."""

    def __init__(self, ranks_file: Path, config: dict, kimi: bool):
        import tiktoken

        ranks = read_ranks(ranks_file)
        self.ranks = ranks  # token bytes → id (structured output's vocabulary, engine/sampling/grammar.py)
        base = len(ranks)
        named = {int(i): entry["content"] for i, entry in config.get("added_tokens_decoder", {}).items()}
        reserved = range(base, base + NUM_RESERVED_SPECIAL) if kimi else ()
        self.special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in reserved}
        self.special.update({name: i for i, name in named.items()})
        self.skipped = frozenset(named)
        self.enc = tiktoken.Encoding(ranks_file.name, pat_str=KIMI_PATTERN if kimi else CL100K_PATTERN,
                                     mergeable_ranks=ranks, special_tokens=self.special)

    def encode(self, text: str) -> list[int]:
        """Special-token text becomes its id (Kimi's ``allowed_special="all"``, as smg encodes)."""
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.skipped]
        return self.enc.decode_bytes(ids).decode("utf-8", errors="replace")


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file: one ``base64(token bytes) rank`` per line (read here: tiktoken's own loader caches
    files by path)."""
    ranks = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            except ValueError as err:
                raise ValueError(f"{path}:{n}: not 'base64-token rank' ({err})") from None
    return ranks


def is_kimi(ckpt_dir: Path, config: dict) -> bool:
    """smg's rule: ``tokenization_kimi`` named in ``tokenizer_config.json`` or a Kimi ``model_type``."""
    if "tokenization_kimi" in json.dumps(config):
        return True
    model_cfg = ckpt_dir / "config.json"
    return model_cfg.is_file() and json.loads(model_cfg.read_text()).get("model_type") in KIMI_MODEL_TYPES


def tiktoken_file(ckpt_dir: Path) -> Path | None:
    """``tiktoken.model``, else the first ``*.tiktoken``, in ``ckpt_dir`` (None: neither)."""
    found = [ckpt_dir / "tiktoken.model"] if (ckpt_dir / "tiktoken.model").is_file() else []
    return (found or sorted(ckpt_dir.glob("*.tiktoken")) or [None])[0]


def load_tokenizer(ckpt_dir: str | Path) -> CheckpointTokenizer | TiktokenTokenizer | None:
    """The checkpoint's tokenizer, or None when it ships neither format."""
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / "tokenizer.json").exists():
        return CheckpointTokenizer(Tokenizer.from_file(str(ckpt_dir / "tokenizer.json")))
    ranks = tiktoken_file(ckpt_dir)
    if ranks is None:
        return None
    config_file = ckpt_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return TiktokenTokenizer(ranks, config, is_kimi(ckpt_dir, config))
