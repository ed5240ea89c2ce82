"""One INFO line per Generate call when it ends — id, gRPC status, finish reason, prompt and output tokens, time —
so a server log answers "what happened to request X" (rejections carry their reason)."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("rpc.requests")


class RequestLog:
    """Filled in as a Generate call goes; :meth:`end` writes its line once. An end without a status is a client
    cancel or a deadline (gRPC cancels the handler): ``CANCELLED``."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.start = time.monotonic()
        self.status: str | None = None
        self.reason = ""
        self.finish: str | None = None
        self.prompt_tokens = 0
        self.output_tokens = 0

    def reject(self, status: str, reason: str) -> None:
        self.status, self.reason = status, reason

    def complete(self, finish_reason: str | None, output_tokens: int) -> None:
        self.status, self.finish, self.output_tokens = "OK", finish_reason, output_tokens

    def end(self) -> None:
        status = self.status or "CANCELLED"
        line = (f"request {self.request_id} {status}: prompt {self.prompt_tokens} tokens, output {self.output_tokens} "
                f"tokens, {time.monotonic() - self.start:.3f} s")
        if self.finish:
            line += f", finish {self.finish}"
        if self.reason:
            line += f" — {self.reason}"
        log.info(line)
