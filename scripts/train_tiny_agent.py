"""Trains ``model=tiny_kimi_agent``: a Kimi-format agent model (Kimi K2's tokenizer format, tool-call and thought
tokens, a Kimi-style chat template) and its DFlash drafter, on synthetic agent conversations.

The stages are ``scripts/train_tiny.py``'s (target on packed sequences, self-distilled drafter); what differs is the
data and the tokenizer:

1. data: seeded conversations (``bench/agent_tools.py``): tool definitions, a user ask naming a tool's purpose (or
   its name) and its argument values, the assistant's call section (one call, or two), the tool's result, a short
   answer; or small talk answered without a call; three in four with a thought (``<think>…</think>``), the others
   without (``<think></think>``, what the template renders with ``chat_template_kwargs: {"thinking": false}``).
   Rendered by the checkpoint's own chat template (jinja2, ``tojson`` = ``json.dumps``: what smg 1.13 renders,
   checked with a recording worker).
2. tokenizer: ``tiktoken.model`` of the 256 bytes plus BPE merges learnt on the rendered text (special-token text
   removed), then Kimi's named special ids past the ranks plus ``<think>``/``</think>``; the drafter's mask is an
   unnamed reserved id (never generated, never allowed by a grammar).
3. target + drafter: as in ``train_tiny.py``, an 8192-token context.
4. evaluation on conversations whose tools training never saw (``bench.agent_tools.HELDOUT_NAMES``): HF greedy from
   the assistant's generation prompt, thinking on and off: the share of turns ended unforced (``<|im_end|>`` within
   the budget), of turns with a call section that parses, names a listed tool and whose arguments validate.

Run from the repo root (about 25 minutes on 2 cores)::

    .venv/bin/python scripts/train_tiny_agent.py --out model/zoo/tiny_kimi_agent
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_tiny as tt  # noqa: E402

from bench.agent_tools import HELDOUT_NAMES, TRAIN_NAMES, conversation, render  # noqa: E402
from model.tiny_tiktoken import AGENT_TEMPLATE, SPECIALS, THINK_SPECIALS, learn_merges, write_tiktoken_tokenizer  # noqa: E402,I001
from model.tokenizer import load_tokenizer  # noqa: E402
from spec_decode.dflash import DFlashDrafter  # noqa: E402

log = logging.getLogger("train_tiny_agent")

AGENT_SPECIALS = {**SPECIALS, **THINK_SPECIALS}
MASK_OFFSET = 200  # an unnamed reserved special id past the ranks: the drafter's mask
SPECIAL_TEXT = re.compile("|".join(re.escape(s) for s in AGENT_SPECIALS.values()))
SECTION = re.compile(r"<\|tool_calls_section_begin\|>(.*?)<\|tool_calls_section_end\|>", re.S)
CALL = re.compile(r"<\|tool_call_begin\|>functions\.([\w-]+):(\d+)<\|tool_call_argument_begin\|>(.*?)"
                  r"<\|tool_call_end\|>", re.S)


def corpus(n: int, seed: int, names: tuple[str, ...]) -> list[tuple[list[dict], list[dict], bool]]:
    """``n`` conversations ``(tools, messages, thinking)``; thinking on for three in four. Both prompts end in
    ``<think>`` (thinking off renders ``<think></think>``), so the share decides what follows it greedily: a
    thought, as a thinking model's turn opens."""
    rng = random.Random(seed)
    return [(*conversation(rng, names, i % 4 != 3), i % 4 != 3) for i in range(n)]


def parse_calls(text: str) -> list[tuple[str, str]] | None:
    """``[(name, arguments)]`` of the first call section in ``text`` (special tokens kept), or None without one."""
    section = SECTION.search(text)
    return None if section is None else [(m.group(1), m.group(3)) for m in CALL.finditer(section.group(1))]


def valid_calls(calls: list[tuple[str, str]] | None, tools: list[dict]) -> bool:
    """At least one call, each naming a listed tool with arguments valid under its schema."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if not calls:
        return False
    for name, args in calls:
        if name not in schemas:
            return False
        try:
            jsonschema.validate(json.loads(args), schemas[name])
        except (ValueError, jsonschema.ValidationError):
            return False
    return True


@torch.no_grad()
def evaluate_turns(target, tok, convs, new_tokens: int, end_id: int) -> dict:
    """HF greedy from each conversation's first assistant prompt: the share ended by ``<|im_end|>`` unforced, the
    share with valid calls among the conversations whose reference called a tool, small talk answered without one."""
    ended = called = wanted = talk_plain = talk = 0
    for tools, messages, thinking in convs:
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = tok.encode(render(messages[:first], tools, True, thinking))
        out = target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=end_id, pad_token_id=end_id)[0, len(prompt):].tolist()
        ended += end_id in out
        text = tok.decode(out)
        calls = parse_calls(text)
        if messages[first].get("tool_calls"):
            wanted += 1
            called += valid_calls(calls, tools)
        else:
            talk += 1
            talk_plain += calls is None
    return {"turns": len(convs), "ended_unforced": round(ended / len(convs), 3),
            "valid_calls_when_wanted": round(called / max(wanted, 1), 3), "calls_wanted": wanted,
            "small_talk_without_call": round(talk_plain / max(talk, 1), 3), "small_talk": talk}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=6000)
    ap.add_argument("--merges", type=int, default=768)
    ap.add_argument("--target-steps", type=int, default=500)
    ap.add_argument("--target-minutes", type=float, default=12)
    ap.add_argument("--drafter-steps", type=int, default=300)
    ap.add_argument("--drafter-minutes", type=float, default=6)
    ap.add_argument("--eval-turns", type=int, default=48)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    command = "python scripts/train_tiny_agent.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    (out / "target").mkdir(parents=True, exist_ok=True)
    t_start, times = time.time(), {}

    # 1-2. data and tokenizer
    convs = corpus(args.conversations, args.seed, TRAIN_NAMES)
    texts = [render(m, t, thinking=th) for t, m, th in convs]
    merge_text = SPECIAL_TEXT.sub(" ", "".join(texts[:400])).encode()
    tokens = [bytes([b]) for b in range(256)] + learn_merges(merge_text, args.merges)
    base = len(tokens)
    end_id, eos_id, pad_id, mask_id = base + 2, base + 1, base + 255, base + MASK_OFFSET
    write_tiktoken_tokenizer(out / "target", tokens, AGENT_SPECIALS, AGENT_TEMPLATE)
    tok = load_tokenizer(out / "target")
    ids: list[int] = []
    for text in texts:
        ids += tok.encode(text) + [eos_id]
    stream = torch.tensor(ids)
    times["data_tokenizer_s"] = round(time.time() - t_start, 1)
    log.info("%d conversations, %d tokens (%.0f per conversation), vocab %d, %.0fs", len(texts), len(stream),
             len(stream) / len(texts), base + 256, times["data_tokenizer_s"])

    # 3. target
    shape = tt.TargetShape(max_position_embeddings=8192)
    cfg = tt.target_config(shape, base + 256, eos_id, pad_id)
    target = tt.build_target(cfg, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    sched = tt.Schedule(steps=args.target_steps, budget_s=60 * args.target_minutes, lr=3e-3, warmup=40)
    seq_len, batch = 1024, 2
    tres = tt.train_target(target, lambda _s: tt.random_chunks(stream, batch, seq_len, gen), sched, 2e-3)
    times["target_train_s"] = tres["seconds"]
    target.save_pretrained(out / "target")
    (out / "target" / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id, end_id]}))
    target.eval().requires_grad_(False)

    held = corpus(args.eval_turns, args.seed + 100, HELDOUT_NAMES)
    held_ids = torch.tensor([t for tl, m, th in held for t in tok.encode(render(m, tl, thinking=th)) + [eos_id]])
    held_loss = tt.heldout_loss(target, tt.fixed_chunks(held_ids, 16, seq_len))
    turns = evaluate_turns(target, tok, held, 200, end_id)
    log.info("target: %d steps, held-out loss %.4f; turns %s", tres["steps"], held_loss, turns)

    # drafter: self-distillation pool + KL training, as train_tiny
    pool = tt.build_pool(target, stream, 96, 384, (64, 256), 32, torch.Generator().manual_seed(args.seed + 5), 150)
    dshape = tt.DrafterShape()
    torch.manual_seed(args.seed + 2)
    drafter = DFlashDrafter(tt.drafter_config(dshape, cfg, mask_id))
    dsched = tt.Schedule(steps=args.drafter_steps, budget_s=60 * args.drafter_minutes, lr=2e-3, weight_decay=0.01)
    dres = tt.train_drafter(drafter, target, tt.mixed_sampler(pool, stream, 2, 2, torch.Generator().manual_seed(
        args.seed + 3)), dsched, 64, 7.0, args.seed + 4)
    drafter.save(out / "drafter")
    greedy = [(row.tolist(), int(lo)) for row, lo in zip(pool["ids"][:16], pool["prefix_len"][:16], strict=True)]
    agree = tt.drafter_agreement(drafter.eval(), target, greedy, stride=4)
    times["total_s"] = round(time.time() - t_start, 1)
    doc = {"command": command, "torch": torch.__version__, "threads": args.threads, "args": vars(args),
           "target_shape": asdict(shape), "drafter_shape": asdict(dshape),
           "tokenizer": {"ranks": base, "vocab_size": base + 256, "eos_id": eos_id, "im_end_id": end_id,
                         "mask_id": mask_id, "pad_id": pad_id},
           "data": {"conversations": len(texts), "train_tokens": len(stream)},
           "target": {"params": tt.count_params(target), "steps": tres["steps"], "stopped_by": tres["stopped_by"],
                      "first_loss": round(tres["losses"][0], 4),
                      "final_train_loss_last20": round(sum(tres["losses"][-20:]) / 20, 4),
                      "heldout_tools_loss": round(held_loss, 4), "heldout_tools_ppl": round(math.exp(held_loss), 3),
                      "curve": tres["curve"]},
           "heldout_turns": turns,
           "drafter": {"steps": dres["steps"], "stopped_by": dres["stopped_by"], "greedy_agreement": agree,
                       "curve": dres["curve"]},
           "times": times}
    (out / "training_log.json").write_text(json.dumps(doc, indent=1))
    log.info("done in %.0fs: %s", times["total_s"], turns)


if __name__ == "__main__":
    main()
