"""One webhook POST, bounded: the address it connects to, a deadline for the whole request,
no redirects.

A target's URL is the operator's, but what its host resolves to and what its server answers
are not: a receiver could trickle a header line every few seconds (a per-read timeout never
fires), answer 302 to an internal address, or its name could resolve to loopback or the
cloud's metadata address. So: the name is resolved here and every address checked (only
global unicast, unless the operator allows private ones); the connection goes to the checked
address (no second lookup between the check and the connect); a timer closes the socket at
the deadline, whatever the receiver does; and any 3xx is an answer, never followed.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse

MAX_ANSWER_BYTES = 1 << 16  # a receiver's answer body is not ours to keep


class RefusedAddress(OSError):
    """The target's host resolves to an address this service does not post to."""


def checked_address(host: str, port: int, allow_private: bool) -> tuple[str, int]:
    """The address to connect to: RefusedAddress if any address ``host`` resolves to is not
    global unicast (loopback, private, link-local, shared, reserved, multicast) unless
    ``allow_private``; OSError if it does not resolve."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{host} does not resolve")
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        ip = mapped or ip
        if not allow_private and (not ip.is_global or ip.is_multicast):
            raise RefusedAddress(f"{host} resolves to {ip}, not a public address (--webhook-allow-private)")
    return str(infos[0][4][0]), port


class _Pinned(http.client.HTTPConnection):
    """A connection to a checked address, whatever the host name resolves to later."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedTLS(_Pinned):
    def connect(self) -> None:
        super().connect()
        self.sock = ssl.create_default_context().wrap_socket(self.sock, server_hostname=self.host)


def post(url: str, body: bytes, headers: dict[str, str], deadline_s: float,
         allow_private: bool) -> str | None:
    """POST once, all of it within ``deadline_s``; None on a 2xx, else why not: ``http_4xx``,
    ``http_5xx``, ``redirect`` (3xx: not followed), ``refused_address``, ``timeout``,
    ``connection``."""
    parts = urllib.parse.urlsplit(url)
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    end = time.monotonic() + deadline_s
    try:
        address, _ = checked_address(parts.hostname or "", port, allow_private)
    except RefusedAddress:
        return "refused_address"
    except (OSError, ValueError):
        return "connection"
    conn = (_PinnedTLS if tls else _Pinned)(parts.hostname or "", port, address,
                                            max(0.01, end - time.monotonic()))
    expired = threading.Event()

    def expire() -> None:  # the whole request's deadline: a trickling receiver is cut off here
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(max(0.0, end - time.monotonic()), expire)
    timer.daemon = True
    timer.start()
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("POST", path, body=body, headers=headers)
        answer = conn.getresponse()
        answer.read(MAX_ANSWER_BYTES)
        status = answer.status
    except (OSError, http.client.HTTPException):
        return "timeout" if expired.is_set() else "connection"
    finally:
        timer.cancel()
        conn.close()
    if expired.is_set():
        return "timeout"
    if 200 <= status < 300:
        return None
    return "redirect" if 300 <= status < 400 else f"http_{status // 100}xx"
