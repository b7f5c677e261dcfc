"""The shared-secret token that guards a sidecar bound beyond the loopback interface.

On 127.0.0.1 (the default) no token is needed. Binding anywhere else requires one in the environment
variable SPLITSCOPE_SIDECAR_TOKEN; senders then present it as `Authorization: Bearer <token>` (OTLP/HTTP,
OTLP/gRPC metadata) or in the Unix-socket handshake. When a token is set, every path checks it, in
constant time (hmac.compare_digest).
"""

from __future__ import annotations

import os

from tracer.auth import check_bind_token

TOKEN_ENV = "SPLITSCOPE_SIDECAR_TOKEN"


def token_for(hosts: list[str], environ: dict[str, str] | None = None) -> str:
    """The token to require ("" for none). Raises ValueError when a non-loopback bind has no token."""
    token = (os.environ if environ is None else environ).get(TOKEN_ENV, "")
    check_bind_token("the sidecar", hosts, token, TOKEN_ENV)
    return token
