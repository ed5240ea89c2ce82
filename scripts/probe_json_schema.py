"""``response_format: json_schema`` on the agent model at a user's sampling settings, the way issue 54 found it broken:
a schema with free strings (``city``, ``note``), thinking off through smg ``--tool-call-parser kimik2`` (no reasoning
parser), ``temperature`` with ``top_p`` 0.95, one seed per request; counts the answers that are not JSON valid under
the schema, and says how each of those finished::

    python scripts/probe_json_schema.py --temperature 1 --seeds 24 [--worker-repo /path/to/other/checkout]

``--worker-repo`` runs another checkout's worker (the code before a change; the same model and gateway).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import Gateway, Server  # noqa: E402

TARGET = ROOT / "model" / "zoo" / "tiny_kimi_agent" / "target"
ASK = [{"role": "user", "content": "Plan a trip: city, days and a note, as JSON."}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                           "note": {"type": "string"}},
          "required": ["city", "days", "note"], "additionalProperties": False}


def main() -> None:
    import jsonschema
    from openai import OpenAI

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--worker-repo", default=str(ROOT))
    args = ap.parse_args()
    tmp, bad, finishes = Path(tempfile.mkdtemp(prefix="probe_json_schema_")), [], {}
    server = Server(["parallel=single", "model=tiny_kimi_agent", "server.served_model_name=kimi",
                     "engine.max_model_len=4096", "server.reasoning_parser=kimi", f"model.path={TARGET}"],
                    tmp / "worker.log", timeout_s=300, repo=Path(args.worker_repo).resolve())
    try:
        gw = Gateway(tmp, "smg", [server], "round_robin", TARGET, options=("--tool-call-parser", "kimik2"))
        oa = OpenAI(base_url=f"{gw.url}/v1", api_key="none", max_retries=0, timeout=600)
        try:
            for seed in range(args.seeds):
                c = oa.chat.completions.create(
                    model="kimi", messages=ASK,
                    max_tokens=args.max_tokens, temperature=args.temperature, top_p=0.95, seed=seed,
                    response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}},
                    extra_body={"chat_template_kwargs": {"thinking": False}}).choices[0]
                finishes[c.finish_reason] = finishes.get(c.finish_reason, 0) + 1
                try:
                    jsonschema.validate(json.loads(c.message.content or ""), SCHEMA)
                except (ValueError, jsonschema.ValidationError):
                    bad.append({"seed": seed, "finish_reason": c.finish_reason, "content": c.message.content})
        finally:
            gw.stop()
    finally:
        server.stop()
    print(json.dumps({"worker_repo": str(Path(args.worker_repo).resolve()), "temperature": args.temperature,
                      "top_p": 0.95, "seeds": args.seeds, "invalid": len(bad),
                      "invalid_finishing_stop": sum(b["finish_reason"] == "stop" for b in bad),
                      "finish_reasons": finishes, "examples": bad[:3]}, indent=1))


if __name__ == "__main__":
    main()
