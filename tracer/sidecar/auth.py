"""The shared-secret token that guards a sidecar bound beyond the loopback interface.

On 127.0.0.1 (the default) no token is needed. Binding anywhere else requires one in the environment
variable SPLITSCOPE_SIDECAR_TOKEN; senders then present it as `Authorization: Bearer <token>` (OTLP/HTTP,
OTLP/gRPC metadata) or in the Unix-socket handshake. When a token is set, every path checks it, in
constant time (hmac.compare_digest).
"""

from __future__ import annotations

import hmac
import ipaddress
import os

TOKEN_ENV = "SPLITSCOPE_SIDECAR_TOKEN"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_for(hosts: list[str], environ: dict[str, str] | None = None) -> str:
    """The token to require ("" for none). Raises ValueError when a non-loopback bind has no token."""
    token = (os.environ if environ is None else environ).get(TOKEN_ENV, "")
    exposed = [h for h in hosts if not is_loopback(h)]
    if exposed and not token:
        raise ValueError(f"binding {', '.join(exposed)} (not loopback) needs a shared secret in ${TOKEN_ENV}")
    return token


def token_ok(expected: str, presented: str | None) -> bool:
    """True when no token is required, or `presented` equals it (constant-time compare)."""
    if not expected:
        return True
    return presented is not None and hmac.compare_digest(expected.encode(), presented.encode())


def bearer_ok(expected: str, authorization_header: str | None) -> bool:
    if not expected:
        return True
    header = authorization_header or ""
    scheme, _, value = header.partition(" ")
    return scheme.lower() == "bearer" and token_ok(expected, value.strip())
