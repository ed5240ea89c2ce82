"""The sockets a process tree listens on, read from ``/proc`` (Linux): each process's socket inodes
(``/proc/PID/fd``) matched against the kernel's TCP and UDP tables (``/proc/net/{tcp,tcp6,udp,udp6}``)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

TCP_LISTEN = "0A"
UDP_UNCONNECTED = "07"


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    protocol: str
    pid: int
    command: str

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return (mapped or ip).is_loopback

    def __str__(self) -> str:
        return f"{self.protocol} {self.address}:{self.port} ({self.command}, pid {self.pid})"


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", struct.unpack(">I", raw)[0]))
    words = struct.unpack(">4I", raw)  # four host-order (little-endian) words
    return socket.inet_ntop(socket.AF_INET6, struct.pack("<4I", *words))


def _table() -> dict[int, tuple[str, int, str]]:
    """Socket inode → (address, port, protocol) of every listening TCP and bound, unconnected UDP socket."""
    out = {}
    for name, state in (("tcp", TCP_LISTEN), ("tcp6", TCP_LISTEN), ("udp", UDP_UNCONNECTED), ("udp6", UDP_UNCONNECTED)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != state:
                continue
            addr, port = fields[1].split(":")
            out[int(fields[9])] = (_address(addr), int(port, 16), name.rstrip("6"))
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def listeners(pids: list[int]) -> list[Listener]:
    """What the process trees rooted at ``pids`` listen on."""
    table, found = _table(), []
    for root in pids:
        for pid in process_tree(root):
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            for fd in fds:
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inode = int(link[8:-1])
                    if inode in table:
                        found.append(Listener(*table[inode], pid, command.strip()[:120]))
    return sorted(set(found), key=lambda x: (x.pid, x.port))


def exposed(pids: list[int]) -> list[Listener]:
    """The listeners of ``pids``' process trees that are not on loopback."""
    return [x for x in listeners(pids) if not x.loopback]
