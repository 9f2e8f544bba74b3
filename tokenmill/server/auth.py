"""API keys and tenants: who may call the server, and whose prefix cache a request may touch.

`--api-key` takes one key, or a keys file of `key tenant` lines. With tenants, the cache salt of a
request is derived from its tenant and the client's `cache_salt` is ignored, so one tenant can
never hit, or time, another tenant's cached prefix. Without tenants the client's salt is honoured.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenmill.server.errors import APIError


@dataclass(frozen=True, slots=True)
class ApiKeys:
    tenants: dict[str, str | None]  # key -> tenant; None for a single key without tenants

    @classmethod
    def parse(cls, value: str | None) -> "ApiKeys | None":
        """`value` is a keys file when such a file exists, else the one key itself."""
        if not value:
            return None
        path = Path(value)
        if not path.is_file():
            return cls({value: None})
        tenants: dict[str, str | None] = {}
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{number}: expected 'key tenant', got {line.strip()!r}")
            if parts[0] in tenants:
                raise ValueError(f"{path}:{number}: the key is listed twice")
            tenants[parts[0]] = parts[1]
        if not tenants:
            raise ValueError(f"{path} holds no 'key tenant' lines")
        return cls(tenants)

    def tenant(self, authorization: str | None) -> str | None:
        """The caller's tenant (None with a single key); a 401 APIError for a bad key."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in self.tenants:
            raise APIError(401, "invalid or missing API key; send 'Authorization: Bearer KEY'",
                           type="authentication_error", code="invalid_api_key")
        return self.tenants[key.strip()]


def cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The server, not the client, decides the salt once there are tenants."""
    return f"tenant:{tenant}" if tenant is not None else client_salt
