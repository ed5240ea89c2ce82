"""The expert load balancer of a running worker (``switchyard.v1.ExpertBalance``, ``rpc/expert_admin.py``)::

    python scripts/expert_balance.py --address 127.0.0.1:50051 get --out /tmp/load.json
    python scripts/expert_balance.py --address 127.0.0.1:50051 rebalance

``get`` prints the per-layer balancedness, the placement versions and what the balancer did; ``--out`` writes the
load (the balancer's last complete window, or the counts so far) as ``{"load": ...}``, a file that seeds
``eplb.placement_file`` for the next start. ``rebalance`` asks for a rebalance at the worker's next step boundary.
The worker must count the load (``eplb.enabled=true``, or ``engine.expert_load=true`` for ``get``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc

from rpc.client import Client


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", required=True, help="HOST:PORT of the worker")
    ap.add_argument("action", choices=("get", "rebalance"))
    ap.add_argument("--out", help="write the load here as an eplb.placement_file")
    args = ap.parse_args()
    with Client(args.address) as client:
        try:
            doc = client.expert_balance(rebalance=args.action == "rebalance")
        except grpc.RpcError as err:
            sys.exit(f"error: {err.code().name}: {err.details()}")
    figures = doc["expert_load"]
    print(f"balancedness per MoE layer: {' '.join(f'{b:.3f}' for b in figures['balancedness'])}; "
          f"placement versions {doc['versions']}; load: {doc['load_is']}")
    if "balancer" in figures:
        b = figures["balancer"]
        print(f"balancer: {b['rebalances']} rebalances, {b['layers_moved']} layer moves, {b['moved_bytes']} bytes")
    if args.action == "rebalance":
        print("rebalance requested: it runs at the worker's next step boundary")
    if args.out:
        Path(args.out).write_text(json.dumps({"load": doc["load"]}))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
