"""The checkpoint's tokenizer (``tokenizer.json``, HF tokenizers), if it has one."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class CheckpointTokenizer:
    def __init__(self, tok: Tokenizer):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(ckpt_dir: str | Path) -> CheckpointTokenizer | None:
    path = Path(ckpt_dir) / "tokenizer.json"
    return CheckpointTokenizer(Tokenizer.from_file(str(path))) if path.exists() else None
