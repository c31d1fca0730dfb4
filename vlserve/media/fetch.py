"""Turn the `url` of an `image_url` / `video_url` content part into bytes or a local path, safely.

Supported: `data:<type>/<subtype>;base64,...`, `file://` (only inside an allowed directory) and
`http(s)://` (size-limited, redirects followed by hand so every hop is checked against the policy).
Remote URLs are refused by default when their host resolves to a non-public address, so a request
cannot make the server probe its own network (SSRF: cloud metadata at 169.254.169.254, localhost
admin ports, ...).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import socket
import stat
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import httpcore
import httpx

from vlserve.core.beneath import open_beneath, resolve_beneath
from vlserve.core.errors import InvalidInputError, MediaFetchError, MediaTooLargeError
from vlserve.media.data_url import decode_data_url

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):")
_WINDOWS_PATH = re.compile(r"^[a-zA-Z]:[\\/]")  # C:\cat.jpg, D:/x.png: a path, not scheme "c"
_CHUNK = 64 * 1024

# file:// refusals name the option that allows local files. The allowed directory itself is never named: a client
# learns nothing of the server's file system from a refusal.
FILE_REFUSED = ("file:// media URLs are refused: start the server with --allowed-local-media-path DIR to allow "
                "files under DIR")
FILE_OUTSIDE = ("file:// media URL is outside the server's allowed local media path: only files under the DIR "
                "given to --allowed-local-media-path may be read (symlinks resolved)")


@dataclass(frozen=True)
class MediaPolicy:
    """What media URLs a request may name. The defaults are safe for a server open to untrusted users."""

    allowed_local_media_path: Path | None = None  # file:// only inside this dir; None refuses file://
    allowed_media_domains: tuple[str, ...] = ()  # empty: any domain; else the host or a parent must be listed
    allow_private_media_urls: bool = False  # allow hosts resolving to private/loopback/link-local/... IPs
    max_bytes: int = 20 * 2**20  # per media item: http bodies, decoded data URLs, local files
    max_bytes_flag: str = "--max-media-bytes"  # the server option that sets max_bytes, named in errors
    timeout_s: float = 10.0  # the whole fetch, redirects included
    max_redirects: int = 5

    @classmethod
    def from_args(cls, server, kind: str = "image") -> "MediaPolicy":
        """The policy a server's options (`core.config.ServerArgs`) set for one media kind."""
        return cls(allowed_local_media_path=server.allowed_local_media_path,
                   allowed_media_domains=tuple(server.allowed_media_domains),
                   allow_private_media_urls=server.allow_private_media_urls,
                   max_bytes=server.max_video_bytes if kind == "video" else server.max_media_bytes,
                   max_bytes_flag="--max-video-bytes" if kind == "video" else "--max-media-bytes",
                   timeout_s=server.media_fetch_timeout)


def _short(url: str, limit: int = 200) -> str:
    # URLs end up in error JSON: keep them readable and bounded.
    return url if len(url) <= limit else url[:limit] + "..."


def _normalize_domain(domain: str) -> str:
    domain = domain.strip().strip(".").lower()
    try:
        return domain.encode("idna").decode("ascii")  # compare in the same ASCII form httpx sends
    except UnicodeError:
        return domain


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_non_public_address(addr: str) -> bool:
    """True for any address a public media URL has no business resolving to."""
    ip = ipaddress.ip_address(addr.split("%", 1)[0])  # drop an IPv6 zone id (fe80::1%eth0)
    if isinstance(ip, ipaddress.IPv6Address):
        # IPv4 carried inside IPv6 reaches the IPv4 host: judge the embedded address.
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is not None:
            return is_non_public_address(str(embedded))
    return (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_reserved
        or ip.is_multicast
        or ip.is_unspecified
        or not ip.is_global  # also catches shared space 100.64.0.0/10 and similar
    )


class CheckedAddressBackend(httpcore.AsyncNetworkBackend):
    """Resolves a host itself, checks every address against the policy and connects to a checked one.

    The address checked is the address connected to: a DNS server that answers differently on a second lookup
    (DNS rebinding) cannot slip a private address in between. TLS keeps the URL's host name for SNI and
    certificate checks, and the Host header stays the URL's (httpcore takes both from the URL, not from here).
    """

    def __init__(self, fetcher: "MediaFetcher", inner: httpcore.AsyncNetworkBackend | None = None):
        self.fetcher = fetcher
        self.inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options=None) -> httpcore.AsyncNetworkStream:
        last: Exception | None = None
        for address in await self.fetcher.checked_addresses(host, port, "media URL"):
            try:
                return await self.inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                last = e
        raise last or httpcore.ConnectError(f"no address to connect to for {host}")

    async def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options=None):
        raise httpcore.ConnectError("media URLs never reach unix sockets")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def checked_transport(fetcher: "MediaFetcher") -> httpx.AsyncHTTPTransport:
    transport = httpx.AsyncHTTPTransport(trust_env=False)  # no proxy from the environment
    transport._pool = httpcore.AsyncConnectionPool(ssl_context=httpx.create_ssl_context(), max_connections=100,
                                                   max_keepalive_connections=20, keepalive_expiry=5.0,
                                                   network_backend=CheckedAddressBackend(fetcher))
    return transport


class MediaFetcher:
    """Fetches media URLs under a `MediaPolicy`. One per server; call `aclose` on shutdown."""

    def __init__(self, policy: MediaPolicy, transport: httpx.AsyncBaseTransport | None = None):
        self.policy = policy
        self._domains = tuple(_normalize_domain(d) for d in policy.allowed_media_domains if d.strip("."))
        self._local_root = (
            os.path.realpath(policy.allowed_local_media_path) if policy.allowed_local_media_path is not None else None
        )
        self._client = httpx.AsyncClient(
            follow_redirects=False,  # we follow them ourselves, checking every hop
            # One client serves all users: keep no cookies, so none set for one request reach another.
            cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
            transport=transport or checked_transport(self),
            timeout=httpx.Timeout(policy.timeout_s),
            trust_env=False,
            # Media is already compressed; asking for identity avoids decompression bombs.
            headers={"User-Agent": "vlserve", "Accept-Encoding": "identity"},
        )

    async def __aenter__(self) -> MediaFetcher:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def fetch(self, url: str) -> bytes:
        """The media's bytes (a file: URL's read here, once: a path handed on could be swapped before its read)."""
        if not isinstance(url, str):
            raise InvalidInputError("media URL must be a string")
        m = _SCHEME.match(url)
        scheme = m.group(1).lower() if m else ""
        if scheme == "data":  # decoding grows with the payload: off the event loop
            return await asyncio.get_running_loop().run_in_executor(None, decode_data_url, url,
                                                                    self.policy.max_bytes, None,
                                                                    self.policy.max_bytes_flag)
        if scheme == "file":  # read off the event loop: it grows with the file
            return await asyncio.get_running_loop().run_in_executor(None, self._local_file, url)
        if scheme in ("http", "https"):
            try:
                return await asyncio.wait_for(self._fetch_http(url), self.policy.timeout_s)
            except asyncio.TimeoutError:
                raise MediaFetchError(
                    f"fetching media URL {_short(url)!r} timed out after {self.policy.timeout_s:g}s"
                ) from None
        if not scheme or _WINDOWS_PATH.match(url):
            raise MediaFetchError(self._not_a_url(url))
        raise MediaFetchError(
            f"unsupported URL scheme {scheme!r} in media URL {_short(url, 80)!r}: the supported ones are data:, "
            "http://, https:// and file:// (file:// only on a server started with --allowed-local-media-path)"
        )

    def _not_a_url(self, url: str) -> str:
        """The error for a plain path (or anything else without a scheme) sent where a URL belongs."""
        if not url.strip():
            return "media URL is empty: send a data: URL, an http(s):// URL or a file:// URL"
        if url.startswith("/"):
            example = "file://" + quote(url)
        else:  # relative, or a Windows path: a file:// URL names an absolute path on the server
            example = "file:///path/on/the/server/" + quote(re.split(r"[\\/]", url)[-1])
        where = ("naming a file under the server's --allowed-local-media-path" if self._local_root is not None
                 else "with the server started with --allowed-local-media-path set")
        return (f"{_short(url, 120)!r} is not a URL: send a data: URL, an http(s):// URL, or "
                f"{_short(example, 160)} {where}")

    # -- file: ---------------------------------------------------------------------------------

    def _local_file(self, url: str) -> bytes:
        if self._local_root is None:
            raise MediaFetchError(FILE_REFUSED)
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaFetchError("file:// media URL must name a local absolute path (file:///path/to/file)")
        path = unquote(parts.path)
        if not path.startswith("/") or "\x00" in path:
            raise MediaFetchError("file:// media URL must name a local absolute path (file:///path/to/file)")
        # Resolved once (symlinks and '..' cannot lead out of the allowed directory), contained before existence is
        # checked (nothing is revealed about files outside), then opened from the directory down without following
        # a symlink, so a folder swapped after the check cannot redirect the read (vlserve.core.beneath).
        unreadable = "file:// media URL names a file that does not exist or cannot be read"
        try:
            found = resolve_beneath(path, (self._local_root,))
        except (OSError, ValueError):
            raise MediaFetchError(unreadable) from None
        if found is None:
            raise MediaFetchError(FILE_OUTSIDE)
        try:
            fd = open_beneath(found[1], found[0])
        except (OSError, ValueError):
            raise MediaFetchError(unreadable) from None
        limit = self.policy.max_bytes
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise MediaFetchError("file:// media URL does not name a regular file")
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(fd).st_size
            if size <= limit:
                try:
                    data = f.read(limit + 1)  # bounded whatever stat said
                except OSError:
                    raise MediaFetchError(unreadable) from None
                size = len(data)
        if size > limit:
            raise MediaTooLargeError(f"local media file is {size} bytes, over the limit of {limit} bytes "
                                     f"({self.policy.max_bytes_flag})")
        return data

    # -- http(s): ------------------------------------------------------------------------------

    async def _resolve(self, host: str, port: int) -> list[str]:
        """Addresses `host` resolves to. Overridable (tests, custom resolvers)."""
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return [info[4][0] for info in infos]

    async def _check_url(self, url: httpx.URL, redirected: bool) -> None:
        """Refuse a URL (the first one or a redirect target) that the policy does not allow."""
        what = "media URL redirected to" if redirected else "media URL"
        if url.scheme not in ("http", "https"):
            raise MediaFetchError(f"{what} a non-http(s) URL ({url.scheme or 'no'} scheme); refused")
        host = url.raw_host.decode("ascii").lower().rstrip(".")
        if not host:
            raise MediaFetchError(f"{'media URL redirected to a URL' if redirected else 'media URL has'} no host")
        if self._domains:
            ip_literal = _is_ip_literal(host)
            allowed = any(host == d or (not ip_literal and host.endswith("." + d)) for d in self._domains)
            if not allowed:
                raise MediaFetchError(f"{what} host {host!r}, which is not in the server's allowed media domains: "
                                      "it fetches media only from the domains given to --allowed-media-domains "
                                      "(and their subdomains)")
        # Early, for a clear error; the connection itself checks again what it connects to (CheckedAddressBackend).
        await self.checked_addresses(host, url.port or (443 if url.scheme == "https" else 80), what)

    async def checked_addresses(self, host: str, port: int, what: str) -> list[str]:
        """The addresses of `host`, all allowed by the policy (refused if any is not)."""
        try:
            addrs = await self._resolve(host, port)
        except (OSError, UnicodeError) as e:
            raise MediaFetchError(f"{what} host {host!r}, which could not be resolved ({e})") from None
        if not addrs:
            raise MediaFetchError(f"{what} host {host!r}, which could not be resolved")
        # One bad address is enough: the connection could use any of them.
        if not self.policy.allow_private_media_urls and any(is_non_public_address(a) for a in addrs):
            raise MediaFetchError(
                f"{what} host {host!r}, which resolves to a private, loopback, link-local or reserved address; "
                "such media URLs are refused unless the server is started with --allow-private-media-urls"
            )
        return addrs

    async def _fetch_http(self, url: str) -> bytes:
        try:
            current = httpx.URL(url)
        except (httpx.InvalidURL, TypeError, ValueError) as e:
            raise MediaFetchError(f"invalid media URL: {e}") from None
        limit = self.policy.max_bytes
        try:
            for hop in range(self.policy.max_redirects + 1):
                await self._check_url(current, redirected=hop > 0)
                async with self._client.stream("GET", current) as resp:
                    if resp.is_redirect:
                        try:
                            current = current.join(resp.headers["location"])
                        except (httpx.InvalidURL, TypeError, ValueError) as e:
                            raise MediaFetchError(f"media URL redirected to an invalid URL: {e}") from None
                        continue
                    if not resp.is_success:
                        reason = f" {resp.reason_phrase}" if resp.reason_phrase else ""
                        raise MediaFetchError(
                            f"fetching media URL {_short(url)!r} failed: HTTP {resp.status_code}{reason}"
                        )
                    declared = resp.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > limit:
                        raise MediaTooLargeError(
                            f"media at {_short(url)!r} is {declared} bytes (Content-Length), "
                            f"over the limit of {limit} bytes ({self.policy.max_bytes_flag})"
                        )
                    body = bytearray()
                    async for chunk in resp.aiter_bytes(_CHUNK):
                        body += chunk
                        if len(body) > limit:  # stop downloading at once; never trust Content-Length alone
                            raise MediaTooLargeError(
                                f"media at {_short(url)!r} is over the limit of {limit} bytes "
                                f"({self.policy.max_bytes_flag})"
                            )
                    return bytes(body)
        except httpx.InvalidURL as e:
            # httpx pre-builds the next request of a redirect even when not following it, so a bad
            # Location (e.g. a data: URL) surfaces here rather than at our own join() above.
            raise MediaFetchError(
                f"media URL {_short(url)!r} redirected to an invalid or unsupported URL: {e}"
            ) from None
        except httpx.TimeoutException:
            raise MediaFetchError(
                f"fetching media URL {_short(url)!r} timed out after {self.policy.timeout_s:g}s"
            ) from None
        except httpx.HTTPError as e:
            kind = "could not connect to" if isinstance(e, httpx.ConnectError) else "error while fetching"
            raise MediaFetchError(f"{kind} media URL {_short(url)!r}: {str(e) or type(e).__name__}") from None
        raise MediaFetchError(f"media URL {_short(url)!r} redirected more than {self.policy.max_redirects} times")
