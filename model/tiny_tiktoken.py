"""A tiny Kimi-style tiktoken checkpoint (the tests and ``scripts/bench_structured.py`` write it): a random
DeepSeek-V3 model (HF ``save_pretrained``) whose vocab is a ``tiktoken.model`` of the 256 bytes plus BPE merges learnt
here from ``tiny_tiktoken_corpus.txt`` (a frozen copy of an earlier README's first 20,000 bytes: the random model's
answers follow the vocabulary, and tests that read them should not move when the README does), then Kimi's 256
special ids named in ``tokenizer_config.json`` (``added_tokens_decoder``, ``auto_map`` naming ``tokenization_kimi``
as Kimi's checkpoints do) and a chat template; no ``tokenizer.json``."""

from __future__ import annotations

import base64
import collections
import json
from pathlib import Path

from model.tiny import write_tiny

CORPUS = Path(__file__).resolve().parent / "tiny_tiktoken_corpus.txt"
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 10: "<|im_system|>",
            11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
            14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>", 254: "[UNK]",
            255: "[PAD]"}  # offsets past the BPE ranks, as in Kimi K2
THINK_SPECIALS = {22: "<think>", 23: "</think>"}  # the thought pair, single tokens as in Kimi K2-Thinking
AGENT_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if m.reasoning_content is defined and m.reasoning_content -%}<think>{{ m.reasoning_content }}</think>"
    "{%- else -%}<think></think>{%- endif -%}{%- if m.content -%}{{ m.content }}{%- endif -%}"
    "{%- if m.tool_calls is defined and m.tool_calls -%}<|tool_calls_section_begin|>{%- for c in m['tool_calls'] -%}"
    "<|tool_call_begin|>{{ c['id'] }}<|tool_call_argument_begin|>"
    "{%- if c['function']['arguments'] is string -%}{{ c['function']['arguments'] }}"
    "{%- else -%}{{ c['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m['tool_call_id'] }}\n"
    "{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}{%- endif -%}")
TEMPLATE = ("{%- for m in messages -%}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
            "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


def learn_merges(text: bytes, count: int) -> list[bytes]:
    """``count`` byte-pair merges, most frequent pair first, over the words of ``text`` (a small BPE trainer)."""
    words = collections.Counter(tuple(bytes([b]) for b in w) for w in text.split(b" ") if w)
    merges = []
    for _ in range(count):
        pairs = collections.Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        merges.append(a + b)
        merged = collections.Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


def write_tiktoken_checkpoint(out_dir: str | Path, merges: int = 240) -> Path:
    """The random test checkpoint at ``out_dir``; returns it."""
    out = Path(out_dir)
    tokens = [bytes([b]) for b in range(256)] + learn_merges(CORPUS.read_bytes(), merges)
    base = len(tokens)
    write_tiny("tiny_deepseek", out, vocab_size=base + 256, bos_token_id=base, eos_token_id=base + 1)
    write_tiktoken_tokenizer(out, tokens, SPECIALS, TEMPLATE)
    return out


def write_tiktoken_tokenizer(out_dir: str | Path, tokens: list[bytes], specials: dict[int, str], template: str
                             ) -> None:
    """Kimi's tokenizer files in ``out_dir``: ``tiktoken.model`` (``tokens`` by rank), ``tokenizer_config.json``
    (``specials`` named at their offsets past the ranks, ``template``) and ``generation_config.json`` (stops:
    ``[EOS]`` and ``<|im_end|>``, as Kimi's)."""
    out, base = Path(out_dir), len(tokens)
    (out / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    named = {str(base + k): {"content": v, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                             "single_word": False} for k, v in specials.items()}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": named, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
        "unk_token": "[UNK]", "chat_template": template, "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [base + 1, base + 2]}))
