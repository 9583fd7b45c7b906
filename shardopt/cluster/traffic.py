"""Bytes this process has sent over TCP: what a test or benchmark counts of a collective's traffic.

    before = tcp_bytes_sent()
    ...collectives...
    sent = tcp_bytes_sent() - before

Summed over the process's TCP sockets (gloo's pairs, the store's connection) from the kernel's tcp_info
(tcpi_bytes_acked: sent and acknowledged; on loopback every byte sent is acknowledged at once). Linux only.
"""
from __future__ import annotations

import os
import socket
import struct

_BYTES_ACKED = 120  # offset of tcpi_bytes_acked (u64) in Linux's struct tcp_info


def tcp_bytes_sent() -> int:
    """Bytes acknowledged on every TCP socket this process holds now (sockets closed since are not counted)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                if len(info) >= _BYTES_ACKED + 8:
                    total += struct.unpack_from("<Q", info, _BYTES_ACKED)[0]
        except OSError:
            pass
        finally:
            s.close()
    return total
