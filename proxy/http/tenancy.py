"""Whose request it is, as the store sees it: its tenant and its client.

The tenant is what the store keeps things under: the tag of the API key the request matched
(proxy/http/auth.py), or "" on a server without keys, whose clients are all one tenant (an address is
no identity, and one client could use many). Retention is fair between tenants, and an
``item_reference`` reaches only its own tenant's items.

The client is whose turn a store operation waits for in the daemon's queue: the tenant where
there are keys, else the client's address (there, a fair turn is all it decides).
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request


@dataclass(frozen=True, slots=True)
class Who:
    tenant: str = ""
    client: str = ""


ANYONE = Who()


def who(request: Request) -> Who:
    tenant = request.scope.get("state", {}).get("tenant")
    if tenant is not None:
        return Who(tenant, tenant)
    return Who("", request.client.host if request.client is not None else "")
