"""Shared-secret checks for listeners bound beyond the loopback interface.

Every splitscope listener binds 127.0.0.1 by default and needs no token there. Binding anywhere else
requires a shared secret (each component names its environment variable); peers present it as
`Authorization: Bearer <token>` or in a handshake, compared in constant time (hmac.compare_digest).
"""

from __future__ import annotations

import hmac
import ipaddress


def is_loopback(host: str) -> bool:
    """True for "localhost" and any loopback address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind_token(what: str, hosts: list[str], token: str | None, env_var: str) -> None:
    """Raise ValueError when `what` would listen beyond loopback on one of `hosts` without a token
    (`token` None or empty). The one rule, and the one message, of every splitscope listener."""
    exposed = [h for h in hosts if not is_loopback(h)]
    if exposed and not token:
        raise ValueError(f"binding {what} to {', '.join(exposed)} (not loopback) needs a shared secret: set ${env_var}")


def token_ok(expected: str, presented: str | None) -> bool:
    """True when no token is required, or `presented` equals it (constant-time compare)."""
    if not expected:
        return True
    return presented is not None and hmac.compare_digest(expected.encode(), presented.encode())


def bearer_ok(expected: str, authorization_header: str | None) -> bool:
    """`token_ok` for an HTTP `Authorization: Bearer <token>` header."""
    if not expected:
        return True
    header = authorization_header or ""
    scheme, _, value = header.partition(" ")
    return scheme.lower() == "bearer" and token_ok(expected, value.strip())
