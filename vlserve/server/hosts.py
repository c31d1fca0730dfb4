"""The names an HTTP server answers to (`--allowed-hosts`), and redirects that never repeat the Host header.
Shared by the OpenAI server (every role that answers the API) and the router.

DNS rebinding: a page at http://evil.example:8000 makes its own name resolve to 127.0.0.1 (or a LAN address); the
browser then sends that page's requests to this server as same-origin, `Host: evil.example:8000`, and lets the page
read the answers: the playground and, without --api-key, /v1. A server that answers only the names it is really
reached by closes that. Which names, by the address it listens on (`--host`):
- a loopback address (the default, 127.0.0.1): loopback names and addresses only (localhost, *.localhost,
  127.0.0.0/8, ::1);
- any other address or a wildcard (0.0.0.0, ::): those, any IP address (a request naming an address was sent to
  that address: no page can rebind it), this machine's host name, --host itself and the advertised host;
- and whatever `--allowed-hosts` adds: NAME, .DOMAIN (the domain and its subdomains), an IP address; `*` any.
Behind a proxy, an ingress or a Kubernetes Service name, pass the names clients use. Anything else gets 400
before any route runs. A request without a Host header (HTTP/1.0; never a browser's) is answered.

Trailing-slash redirects (/playground/ -> /playground) are relative: Starlette's name the request's Host, which
would send a client to whatever host it was told it was talking to.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import quote

from fastapi import FastAPI
from starlette.responses import RedirectResponse
from starlette.routing import Match, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from vlserve.core.errors import InvalidInputError
from vlserve.server.errors import error_response, log_client_error, one_line

WILDCARDS = ("", "0.0.0.0", "::")
_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*")


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _is_loopback_name(name: str) -> bool:
    return name == "localhost" or name.endswith(".localhost")  # RFC 6761: browsers resolve these to loopback


def host_name(header: str) -> str | None:
    """The host of a Host header (`name`, `name:port`, `[v6]:port`), lower case, no trailing dot; None when it is
    not one."""
    value = header.strip().lower()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        port_ok = not rest or (rest[:1] == ":" and (rest[1:].isdigit() or not rest[1:]))  # "host:" is allowed
        if not bracket or not port_ok or not isinstance(_ip(name), ipaddress.IPv6Address):
            return None
        return str(_ip(name))
    name, colon, port = value.partition(":")
    if colon and port and not port.isdigit():
        return None  # a bare IPv6 address, or junk
    name = name.rstrip(".")
    if _ip(name) is not None:
        return str(_ip(name))
    return name if _NAME.fullmatch(name) else None


class HostPolicy:
    """Which Host headers are answered: see the module docstring."""

    def __init__(self, bind_host: str, allowed: tuple[str, ...] = (), also: tuple[str | None, ...] = ()):
        self.any = False
        self.names: set[str] = set()
        self.domains: list[str] = []  # ".example.com": it and its subdomains
        bind = bind_host.strip().strip("[]").lower()
        bind_ip = _ip(bind)
        self.loopback_only = _is_loopback_name(bind) or (bind_ip is not None and bind_ip.is_loopback)
        if not self.loopback_only:
            machine = socket.gethostname().lower().rstrip(".")
            for name in (machine, machine.split(".")[0], *([] if bind in WILDCARDS else [bind]), *also):
                if name:
                    self.names.add(host_name(name) or name)
        for entry in allowed:
            self._add(entry)

    @classmethod
    def of(cls, server, advertised: str | None = None) -> HostPolicy:
        """The policy of ServerArgs `server` (its --host and --allowed-hosts), plus the advertised host."""
        return cls(server.host, tuple(server.allowed_hosts), (advertised,))

    def _add(self, entry: str) -> None:
        text = entry.strip().lower().rstrip(".")
        if text == "*":
            self.any = True
            return
        ip = _ip(text.strip("[]")) if text.startswith("[") == text.endswith("]") else None
        if ip is not None:
            self.names.add(str(ip))
        elif text.startswith(".") and _NAME.fullmatch(text[1:]):
            self.domains.append(text)
        elif _NAME.fullmatch(text):
            self.names.add(text)
        else:
            raise InvalidInputError(f"--allowed-hosts takes host names, .domains (a domain and its subdomains), IP "
                                    f"addresses or *, without a scheme or port; got {entry!r}")

    def allows(self, header: str | None) -> bool:
        if self.any or header is None:
            return True
        name = host_name(header)
        if name is None:
            return False
        if name in self.names or any(name == d[1:] or name.endswith(d) for d in self.domains):
            return True
        ip = _ip(name)
        if ip is not None:
            mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is 127.0.0.1
            return ip.is_loopback or (mapped is not None and mapped.is_loopback) or not self.loopback_only
        return _is_loopback_name(name)


class HostCheck:
    """ASGI middleware: 400 for a request whose Host header the policy refuses, before any route runs."""

    def __init__(self, app: ASGIApp, policy: HostPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not self.policy.any:
            hosts = [v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"host"]
            if len(hosts) > 1 or not self.policy.allows(hosts[0] if hosts else None):
                message = (f"invalid Host header {one_line(hosts[0] if hosts else '', 100)!r}: not a name this "
                           "server answers to (--allowed-hosts)")
                log_client_error(f"{scope.get('method', 'WS')} {scope.get('path', '')}", 400, message)
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await error_response(message, 400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def relative_slash_redirects(app: FastAPI) -> None:
    """/path/ -> /path (and /path -> /path/) where only the other one is a route, as Starlette does, but with a
    relative Location: the request's Host is never repeated back."""
    router: Router = app.router
    router.redirect_slashes = False
    not_found = router.default

    async def default(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in ("", "/"):
            other = path.rstrip("/") if path.endswith("/") else path + "/"
            # "//evil.example" would be a protocol-relative URL: another host
            if other.startswith("/") and not other.startswith("//") and any(
                    route.matches({**scope, "path": other})[0] is not Match.NONE for route in router.routes):
                location = quote(other, safe="/:@!$&'()*+,;=-._~")
                if scope.get("query_string"):
                    location += "?" + scope["query_string"].decode("latin-1")
                await RedirectResponse(location)(scope, receive, send)
                return
        await not_found(scope, receive, send)

    router.default = default
