"""Special tokens are structure, not text (docs/sampling.md, "Special tokens").

xgrammar sees each token the tokenizer marks special (Kimi's named ``<|…|>`` tokens and ``[EOS]``, a
``tokenizer.json``'s special added tokens) as :data:`UNMATCHABLE` followed by its name: a byte no UTF-8 text holds, so
no JSON string, number, regex, EBNF rule or free text can take it, while a structural tag's ``token`` format, which
matches by id, still can. :func:`tokens_for_specials` rewrites a structural tag so that each special token it names in
a string (a tag's begin or end, a constant, a trigger) becomes such a ``token`` element; stop tokens end a completed
grammar as before (xgrammar's stop tokens).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

UNMATCHABLE = b"\xff"  # never in UTF-8: a special token's text for xgrammar starts with it


class SpecialTokenError(ValueError):
    """A structural tag names a special token where only text can stand (a separator, a mixed trigger)."""


def xgrammar_text(name: str) -> bytes:
    """What xgrammar reads as the text of the special token ``name``."""
    return UNMATCHABLE + name.encode()


def tokens_for_specials(node, specials: Mapping[str, int]):
    """``node`` (a structural tag's JSON, or a part of it) with the special tokens it names in strings as ``token``
    elements (by id); raises :class:`SpecialTokenError` where the tag's shape has no place for a token."""
    if not specials:
        return node
    pattern = re.compile("|".join(re.escape(n) for n in sorted(specials, key=len, reverse=True)))
    return _Rewrite(specials, pattern).node(node)


class _Rewrite:
    def __init__(self, specials: Mapping[str, int], pattern: re.Pattern):
        self.specials, self.pattern = specials, pattern

    def pieces(self, text: str) -> list[str | dict]:
        """``text`` split into its text runs and ``token`` elements."""
        out, at = [], 0
        for m in self.pattern.finditer(text):
            if m.start() > at:
                out.append(text[at:m.start()])
            out.append({"type": "token", "token": self.specials[m.group()]})
            at = m.end()
        return out + ([text[at:]] if at < len(text) or not out else [])

    @staticmethod
    def element(piece: str | dict) -> dict:
        return {"type": "const_string", "value": piece} if isinstance(piece, str) else piece

    def sequence(self, pieces: list) -> dict:
        return self.element(pieces[0]) if len(pieces) == 1 else {
            "type": "sequence", "elements": [self.element(p) for p in pieces]}

    def token_id(self, token):
        return self.specials.get(token, token) if isinstance(token, str) else token

    def text_only(self, strings: list[str]) -> list[str]:
        """Excluded strings: one naming a special token can never be text, so it goes."""
        return [s for s in strings if not self.pattern.search(s)]

    def node(self, node):
        if isinstance(node, list):
            return [self.node(x) for x in node]
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        if kind == "const_string":
            return self.sequence(self.pieces(node["value"]))
        if kind == "tag":
            return self.tag(node)
        if kind == "triggered_tags" and any(self.pattern.search(t) for t in node.get("triggers", [])):
            return self.token_triggered(node)
        if kind == "tags_with_separator" and self.pattern.search(node.get("separator", "")):
            raise SpecialTokenError("a tags_with_separator separator names a special token")
        out = {k: self.node(v) for k, v in node.items()}
        if kind in ("triggered_tags", "tags_with_separator"):  # their tags may leave out "type": "tag"
            out["tags"] = [self.tag(t) for t in node.get("tags", [])]
        if kind in ("token", "exclude_token", "any_tokens", "token_triggered_tags", "token_dispatch"):
            if "token" in out:
                out["token"] = self.token_id(out["token"])
            for key in ("exclude_tokens", "trigger_tokens"):
                if key in out:
                    out[key] = [self.token_id(t) for t in out[key]]
            if kind == "token_dispatch":
                out["rules"] = [[self.token_id(p), f] for p, f in out["rules"]]
        elif kind == "dispatch" and any(self.pattern.search(p) for p, _ in node.get("rules", [])):
            raise SpecialTokenError("a dispatch pattern names a special token (a token_dispatch takes it)")
        if isinstance(out.get("excludes"), list):
            out["excludes"] = self.text_only(out["excludes"])
        return out

    def tag(self, node: dict) -> dict:
        """``begin content end``: the begin's first piece and the end's last piece stay the tag's own (a string or
        a token); the pieces between move into the content."""
        begin = node["begin"]
        head = self.pieces(begin) if isinstance(begin, str) else [self.node(begin)]
        end = node["end"]
        if isinstance(end, list):
            if any(self.pattern.search(e) for e in end):
                raise SpecialTokenError("a tag's list of ends names a special token")
            tail = [end]
        else:
            tail = self.pieces(end) if isinstance(end, str) else [self.node(end)]
        inner = [*(self.element(p) for p in head[1:]), self.node(node["content"]),
                 *(self.element(p) for p in tail[:-1])]
        content = inner[0] if len(inner) == 1 else {"type": "sequence", "elements": inner}
        return {**node, "begin": head[0], "content": content, "end": tail[-1]}

    def token_triggered(self, node: dict) -> dict:
        """A ``triggered_tags`` whose triggers are special tokens: each trigger must be one, and each tag's begin
        then starts with it (xgrammar's ``token_triggered_tags``, whose free text is any token but those it
        excludes: every other special token)."""
        triggers = [self.pieces(t) for t in node["triggers"]]
        if not all(len(t) == 1 and isinstance(t[0], dict) for t in triggers):
            raise SpecialTokenError("a triggered_tags trigger mixes a special token with text")
        if self.text_only(node.get("excludes", [])):
            raise SpecialTokenError("a triggered_tags with special-token triggers excludes text")
        trigger_ids = [t[0]["token"] for t in triggers]
        return {"type": "token_triggered_tags", "trigger_tokens": trigger_ids,
                "exclude_tokens": sorted(set(self.specials.values()) - set(trigger_ids)),  # free text stays text
                "tags": [self.tag(t) for t in node["tags"]], "at_least_one": node.get("at_least_one", False),
                "stop_after_first": node.get("stop_after_first", False)}
