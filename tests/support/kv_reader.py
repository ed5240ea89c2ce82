"""A decode side to kill mid-transfer: reads a hand-off's leased blocks from the prefill worker's ranks over the
Mooncake transfer engine, again and again in batches of up to 256 regions (every region of the lease, repeated; the
TCP transport queues no more at once), so that a kill lands while bytes are on the wire.

``python -m tests.support.kv_reader``: prints ``ready`` once its transfer engine runs, takes one line of
``kv_transfer_params_json`` on stdin, prints ``reading`` after its first batch, then reads until killed."""

from __future__ import annotations

import json
import sys

import torch

from bench.gpu.hand_off import loopback_engine

BATCH_REGIONS = 256


def main() -> None:
    engine = loopback_engine()
    print("ready", flush=True)
    blob = json.loads(sys.stdin.readline())
    shard = blob["shards"][0]
    regions = [(address + block * width, width) for address, width in shard["tensors"] for block in shard["blocks"]]
    regions *= max(BATCH_REGIONS // len(regions), 1)
    buffer = torch.empty(sum(width for _, width in regions), dtype=torch.uint8)
    if engine.register_memory(buffer.data_ptr(), buffer.numel()) != 0:
        raise SystemExit("could not register the read buffer")
    local, at = [], buffer.data_ptr()
    for _, width in regions:
        local.append(at)
        at += width
    remote, lengths = [a for a, _ in regions], [w for _, w in regions]
    first = True
    while True:
        if engine.batch_transfer_sync_read(shard["session"], local, remote, lengths) != 0:
            raise SystemExit(f"reading from {shard['session']} failed")
        if first:
            print("reading", flush=True)
            first = False


if __name__ == "__main__":
    main()
