"""MediaFetcher: data:, file:// and http(s) URLs under a MediaPolicy (SSRF checks, size, redirects, timeouts)."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from PIL import Image

from vlserve.core.errors import InvalidInputError, MediaFetchError, MediaTooLargeError
from vlserve.media.fetch import (
    MediaFetcher,
    MediaPolicy,
    is_non_public_address,
)

SMALL = 1000  # max_bytes used where size limits are under test


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 30, 90)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()
assert len(PNG) < SMALL


REDIRECTS = {
    "/redirect": "/img.png",
    "/redirect-file": "file:///etc/passwd",
    "/redirect-data": "data:image/png;base64," + base64.b64encode(PNG).decode(),
    "/redirect-other": "http://evil.example/img.png",
    "/loop": "/loop",
}


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.0: a body without Content-Length simply runs until the connection closes.

    def log_message(self, *args):  # keep pytest output quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, length: bool = True):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except ConnectionError:  # the client gave up (timeout, size limit): expected here
            pass

    def do_GET(self):
        path = self.path
        if path in REDIRECTS:
            self._send(302, headers={"Location": REDIRECTS[path]})
        elif path.startswith("/chain/"):  # /chain/N: N redirects, then the PNG
            n = int(path.rsplit("/", 1)[1])
            self._send(302, headers={"Location": f"/chain/{n - 1}" if n > 0 else "/img.png"})
        elif path == "/img.png":
            self._send(200, PNG, {"Content-Type": "image/png"})
        elif path == "/big":
            self._send(200, b"x" * (SMALL * 4))
        elif path == "/big-nolen":
            self._send(200, b"x" * (SMALL * 4), length=False)
        elif path == "/set-cookie":
            self._send(200, PNG, {"Set-Cookie": "session=user-a; Path=/"})
        elif path == "/echo-cookie":
            self._send(200, self.headers.get("Cookie", "none").encode())
        elif path == "/slow":
            time.sleep(1.5)
            self._send(200, PNG)
        elif path == "/drip":  # each read is quick, the whole body is not
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(15):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
            except ConnectionError:
                pass
        else:
            self._send(404, b"not found")


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.block_on_close = False  # don't wait for /slow handlers at teardown
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def fetch(url: str, policy: MediaPolicy | None = None, *, fetcher_cls=MediaFetcher, transport=None):
    async def go():
        async with fetcher_cls(policy or MediaPolicy(), transport=transport) as f:
            return await f.fetch(url)

    return asyncio.run(go())


LOCAL = MediaPolicy(allow_private_media_urls=True, max_bytes=SMALL, timeout_s=0.5)


# --- http(s) against a real loopback server --------------------------------------------------------


def test_http_ok(server):
    assert fetch(f"{server}/img.png", LOCAL) == PNG
    assert fetch(f"{server}/redirect", LOCAL) == PNG  # relative Location


def test_loopback_refused_by_default(server):
    with pytest.raises(MediaFetchError, match="private, loopback, link-local or reserved") as e:
        fetch(f"{server}/img.png")
    assert "unless the server is started with --allow-private-media-urls" in str(e.value)


@pytest.mark.parametrize("host", ["[::1]", "0.0.0.0", "localhost", "0x7f.1", "127.1", "[::ffff:7f00:1]"])
def test_loopback_literals_refused(host):
    with pytest.raises(MediaFetchError, match="private"):
        fetch(f"http://{host}/img.png")


def test_redirect_chain_limit(server):
    policy = MediaPolicy(allow_private_media_urls=True, max_redirects=2)
    assert fetch(f"{server}/chain/1", policy) == PNG  # 2 redirects
    with pytest.raises(MediaFetchError, match="redirected more than 2 times"):
        fetch(f"{server}/chain/2", policy)  # 3 redirects
    with pytest.raises(MediaFetchError, match="redirected more than 5 times"):
        fetch(f"{server}/loop", LOCAL)


@pytest.mark.parametrize(
    ("path", "match"), [("/redirect-file", "redirected to a non-http"), ("/redirect-data", "redirected to an invalid")]
)
def test_redirect_to_other_scheme_refused(server, path, match):
    with pytest.raises(MediaFetchError, match=match):
        fetch(server + path, LOCAL)


def test_redirect_to_unlisted_domain_refused(server):
    policy = MediaPolicy(allow_private_media_urls=True, allowed_media_domains=("127.0.0.1",))
    assert fetch(f"{server}/img.png", policy) == PNG
    with pytest.raises(MediaFetchError, match="redirected to host 'evil.example'.*allowed media domains"):
        fetch(f"{server}/redirect-other", policy)


def test_too_large_by_content_length(server):
    with pytest.raises(MediaTooLargeError, match=r"Content-Length.*limit of 1000 bytes \(--max-media-bytes\)"):
        fetch(f"{server}/big", LOCAL)


def test_too_large_streamed(server):
    with pytest.raises(MediaTooLargeError, match=r"over the limit of 1000 bytes \(--max-media-bytes\)") as e:
        fetch(f"{server}/big-nolen", LOCAL)
    assert "Content-Length" not in str(e.value)
    assert e.value.http_status == 413


def test_404(server):
    with pytest.raises(MediaFetchError, match="HTTP 404"):
        fetch(f"{server}/missing", LOCAL)


@pytest.mark.parametrize("path", ["/slow", "/drip"])
def test_timeout(server, path):
    t0 = time.monotonic()
    with pytest.raises(MediaFetchError, match=r"timed out after 0.5s"):
        fetch(server + path, LOCAL)
    assert time.monotonic() - t0 < 1.2


def test_no_cookies_shared_between_fetches(server):
    async def go():
        async with MediaFetcher(LOCAL) as f:
            await f.fetch(f"{server}/set-cookie")
            return await f.fetch(f"{server}/echo-cookie")

    assert asyncio.run(go()) == b"none"


def test_connection_refused():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(MediaFetchError, match="could not connect"):
        fetch(f"http://127.0.0.1:{port}/img.png", LOCAL)


# --- Policy checks with a mock transport and a fake resolver: no DNS, no network -------------------

PUB = "93.184.216.34"
FAKE_DNS = {"public.example": [PUB], "images.example.com": [PUB], "cdn.images.example.com": [PUB]}
FAKE_DNS |= {"v6public.example": ["2606:4700:4700::1111"], "mixed.example": [PUB, "192.168.1.5"]}
FAKE_DNS |= {"intranet.example": ["10.0.0.1"], "metadata.example": ["169.254.169.254"]}
FAKE_DNS |= {"mapped.example": ["::ffff:127.0.0.1"]}


class FakeDNSFetcher(MediaFetcher):
    async def _resolve(self, host, port):
        if host not in FAKE_DNS:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return FAKE_DNS[host]


def _mock_handler(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/to-metadata":
        return httpx.Response(302, headers={"Location": "http://metadata.example/latest/meta-data"})
    if request.url.path == "/to-evil":
        return httpx.Response(301, headers={"Location": "https://evil.com/img.png"})
    if request.url.path == "/to-sub":
        return httpx.Response(307, headers={"Location": "https://cdn.images.example.com/img.png"})
    return httpx.Response(200, content=PNG)


MOCK = httpx.MockTransport(_mock_handler)


def fake(url: str, policy: MediaPolicy | None = None):
    return fetch(url, policy, fetcher_cls=FakeDNSFetcher, transport=MOCK)


@pytest.mark.parametrize("host", ["public.example", "v6public.example"])
def test_public_host_ok(host):
    assert fake(f"https://{host}/img.png") == PNG


@pytest.mark.parametrize("host", ["intranet.example", "metadata.example", "mapped.example", "mixed.example"])
def test_private_resolution_refused(host):
    with pytest.raises(MediaFetchError, match=f"host '{host}'.*private"):
        fake(f"https://{host}/img.png")
    # The server can opt in.
    assert fake(f"https://{host}/img.png", MediaPolicy(allow_private_media_urls=True)) == PNG


def test_redirect_to_private_host_refused():
    with pytest.raises(MediaFetchError, match="redirected to host 'metadata.example'.*private"):
        fake("https://public.example/to-metadata")


def test_domain_allow_list():
    policy = MediaPolicy(allowed_media_domains=("images.example.com", "Public.Example."))
    # Exact host and subdomains pass; names are compared case-insensitively, trailing dot ignored.
    assert fake("https://images.example.com/img.png", policy) == PNG
    assert fake("https://cdn.images.example.com/img.png", policy) == PNG
    assert fake("https://PUBLIC.example./img.png", policy) == PNG
    assert fake("https://images.example.com/to-sub", policy) == PNG  # redirect to an allowed subdomain
    for bad in ("https://evil.com/x", "https://notimages.example.com/x", "https://example.com/x"):
        with pytest.raises(MediaFetchError, match="not in the server's allowed media domains: .*"
                                                  "--allowed-media-domains"):
            fake(bad, policy)
    with pytest.raises(MediaFetchError, match="redirected to host 'evil.com'.*allowed media domains"):
        fake("https://images.example.com/to-evil", policy)


def test_unresolvable_host_and_allow_list_before_dns():
    with pytest.raises(MediaFetchError, match="could not be resolved"):
        fake("https://nonexistent.example/img.png")
    # A host outside the list is refused without being resolved (no DNS leak of arbitrary names).
    policy = MediaPolicy(allowed_media_domains=("public.example",))
    with pytest.raises(MediaFetchError, match="allowed media domains"):
        fake("https://nonexistent.example/img.png", policy)


PUBLIC_ADDRS = ["8.8.8.8", "2001:4860:4860::8888", "::ffff:8.8.8.8"]
NON_PUBLIC_ADDRS = [
    *("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.0.1", "169.254.169.254", "0.0.0.0", "224.0.0.1", "240.0.0.1"),
    "100.64.0.1",  # carrier-grade NAT space: not "private" to ipaddress, but not public either
    *("::1", "::", "fe80::1%eth0", "fc00::1", "ff02::1", "::ffff:127.0.0.1", "2002:7f00:1::"),  # last: 6to4 of 127/8
]


@pytest.mark.parametrize(("addr", "bad"), [(a, False) for a in PUBLIC_ADDRS] + [(a, True) for a in NON_PUBLIC_ADDRS])
def test_is_non_public_address(addr, bad):
    assert is_non_public_address(addr) is bad


# --- data: -----------------------------------------------------------------------------------------


def test_data_url_ok():
    b64 = base64.b64encode(PNG).decode()
    assert fetch(f"data:image/png;base64,{b64}") == PNG
    assert fetch(f"DATA:video/mp4;base64,{b64}") == PNG  # any type/subtype; content is checked at decode


def test_data_url_lenient_forms():
    b64 = base64.urlsafe_b64encode(PNG).decode().rstrip("=")
    wrapped = "\n".join(b64[i : i + 20] for i in range(0, len(b64), 20))
    assert fetch(f"data:image/png;charset=binary;base64,{wrapped}") == PNG


BAD_DATA_URLS = ["data:image/png;base64,!!!notbase64!!!", "data:image/png;base64,abcde"]  # bad alphabet, length
BAD_DATA_URLS += ["data:image/png,rawbytes", "data:;base64,aGVsbG8=", "data:image;base64,aGVsbG8="]  # bad form


@pytest.mark.parametrize("url", BAD_DATA_URLS)
def test_data_url_invalid(url):
    with pytest.raises(InvalidInputError) as e:
        fetch(url)
    assert not isinstance(e.value, MediaTooLargeError)
    assert "!!!" not in str(e.value)  # the payload is never echoed


def test_data_url_too_large():
    ok = base64.b64encode(b"x" * SMALL).decode()
    over = base64.b64encode(b"x" * (SMALL + 1)).decode()
    policy = MediaPolicy(max_bytes=SMALL)
    assert fetch(f"data:image/png;base64,{ok}", policy) == b"x" * SMALL
    with pytest.raises(MediaTooLargeError, match=r"1001 bytes, over the limit of 1000 bytes \(--max-media-bytes\)"):
        fetch(f"data:image/png;base64,{over}", policy)
    with pytest.raises(MediaTooLargeError, match=r"over the limit of 1000 bytes \(--max-video-bytes\)"):
        fetch(f"data:video/mp4;base64,{over}", MediaPolicy(max_bytes=SMALL, max_bytes_flag="--max-video-bytes"))


# --- file:// ---------------------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path: Path):
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "img.png").write_bytes(PNG)
    (allowed / "sub" / "my img.png").write_bytes(PNG)
    (allowed / "big.bin").write_bytes(b"x" * (SMALL + 1))
    (tmp_path / "secret.txt").write_text("secret")
    (allowed / "escape").symlink_to(tmp_path / "secret.txt")
    (allowed / "escape_dir").symlink_to(tmp_path)
    (allowed / "inner_link").symlink_to(allowed / "img.png")
    (tmp_path / "allowed_sibling").mkdir()  # shares the prefix 'allowed' but is outside
    (tmp_path / "allowed_sibling" / "x.png").write_bytes(PNG)
    return allowed


def _file_policy(allowed: Path) -> MediaPolicy:
    return MediaPolicy(allowed_local_media_path=allowed, max_bytes=SMALL)


def test_file_ok(media_dir):
    """The file's bytes, read by the fetcher (a path handed on could be swapped before its read)."""
    policy = _file_policy(media_dir)
    assert fetch(f"file://{media_dir}/img.png", policy) == PNG
    assert fetch(f"file://localhost{media_dir}/sub/my%20img.png", policy) == PNG
    assert fetch(f"file://{media_dir}/sub/../img.png", policy) == PNG
    assert fetch(f"file://{media_dir}/inner_link", policy) == PNG  # symlink staying inside


@pytest.mark.parametrize(
    "rel",
    ["../secret.txt", "escape", "escape_dir/secret.txt", "sub/../../secret.txt", "../allowed_sibling/x.png"]
    + ["file:///etc/passwd", "file:///"],
)
def test_file_escape_refused(media_dir, rel):
    url = rel if rel.startswith("file:") else f"file://{media_dir}/{rel}"
    with pytest.raises(MediaFetchError, match="outside the server's allowed local media path") as e:
        fetch(url, _file_policy(media_dir))
    assert str(media_dir) not in str(e.value)  # the allowed directory is never named to a client
    assert "--allowed-local-media-path" in str(e.value)


def test_file_without_allowed_dir_refused(media_dir):
    with pytest.raises(MediaFetchError) as e:
        fetch(f"file://{media_dir}/img.png")
    assert str(e.value) == ("file:// media URLs are refused: start the server with --allowed-local-media-path DIR to "
                            "allow files under DIR")
    assert e.value.http_status == 400


@pytest.mark.parametrize(("rel", "match"), [("nope.png", "not exist"), ("sub", "regular file"), ("", "regular file")])
def test_file_not_a_file(media_dir, rel, match):
    with pytest.raises(MediaFetchError, match=match):
        fetch(f"file://{media_dir}/{rel}", _file_policy(media_dir))


def test_file_too_large(media_dir):
    with pytest.raises(MediaTooLargeError, match=r"1001 bytes, over the limit of 1000 bytes \(--max-media-bytes\)"):
        fetch(f"file://{media_dir}/big.bin", _file_policy(media_dir))


@pytest.mark.parametrize("url", ["file://otherhost/etc/passwd", "file:relative/img.png"])
def test_file_bad_form(media_dir, url):
    with pytest.raises(MediaFetchError, match="local absolute path"):
        fetch(url, _file_policy(media_dir))


# --- other schemes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["ftp://example.com/img.png", "gopher://example.com/", "javascript:alert(1)"])
def test_unsupported_scheme(url):
    scheme = url.split(":")[0]
    with pytest.raises(MediaFetchError) as e:
        fetch(url)
    assert str(e.value).startswith(f"unsupported URL scheme '{scheme}' in media URL '{url}': the supported ones are "
                                   "data:, http://, https:// and file://")
    assert e.value.http_status == 400


@pytest.mark.parametrize("path, example", [
    ("/tmp/cat.jpg", "file:///tmp/cat.jpg"),
    ("/etc/passwd", "file:///etc/passwd"),
    ("cat.jpg", "file:///path/on/the/server/cat.jpg"),
    ("pics/my cat.jpg", "file:///path/on/the/server/my%20cat.jpg"),
    ("C:\\pics\\cat.jpg", "file:///path/on/the/server/cat.jpg"),  # a drive letter is no scheme
])
def test_a_plain_path_is_not_a_url_and_the_error_says_what_to_send(path, example, media_dir):
    with pytest.raises(MediaFetchError) as e:
        fetch(path)
    assert e.value.http_status == 400
    assert str(e.value) == (f"{path!r} is not a URL: send a data: URL, an http(s):// URL, or {example} with the "
                            "server started with --allowed-local-media-path set")
    # A server that allows local files: the hint is only where the file must be.
    with pytest.raises(MediaFetchError, match=r"is not a URL: .* naming a file under the server's "
                                              r"--allowed-local-media-path$"):
        fetch(path, _file_policy(media_dir))


def test_an_empty_media_url_is_refused_clearly():
    with pytest.raises(MediaFetchError, match="media URL is empty"):
        fetch("")


# --- DNS rebinding: the address checked is the address connected to ---------------------------------------
HITS: list[str] = []


class _CountingHandler(_Handler):
    def do_GET(self):
        HITS.append(self.path)
        super().do_GET()


class RebindingFetcher(MediaFetcher):
    """A resolver that answers a public address first and loopback on every later lookup."""

    lookups = 0

    async def _resolve(self, host, port):
        type(self).lookups += 1
        return [PUB] if type(self).lookups == 1 else ["127.0.0.1"]


def test_dns_rebinding_cannot_reach_a_loopback_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _CountingHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        HITS.clear()
        RebindingFetcher.lookups = 0
        # "localhost" is what the system resolver would connect to if the check and the connection differed.
        with pytest.raises(MediaFetchError, match="private, loopback"):
            fetch(f"http://localhost:{httpd.server_address[1]}/img.png", fetcher_cls=RebindingFetcher)
        assert RebindingFetcher.lookups == 2  # the early check, then the connection's own
        assert HITS == [], "the loopback server was reached"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_connection_goes_to_the_checked_address(server):
    """The connection uses our resolver's answer, never the system's: a name the system cannot resolve works."""
    class Pinned(MediaFetcher):
        async def _resolve(self, host, port):
            return ["127.0.0.1"]

    port = server.rsplit(":", 1)[1]
    assert fetch(f"http://no-such-host.invalid:{port}/img.png", LOCAL, fetcher_cls=Pinned) == PNG
