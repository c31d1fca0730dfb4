"""The playground page (GET / and /playground) in a real headless Chromium against real `vlserve serve` processes
on the tiny checkpoint: a picture and a question give the API's own greedy answer, streamed; Stop cancels the
request on the server; --api-key makes the page ask for the key, which never reaches the URL; --no-playground
(on serve, language and decode) gives 404; a strict CSP holds (no inline script, no console errors); desktop and
phone-width screenshots are kept in tests/artifacts/ (git-ignored)."""

from __future__ import annotations

import base64
import json
import re
import signal
import subprocess
import sys
import time
import wave
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.browser import chromium_or_skip, console_errors
from tests.conftest import noise_image
from tests.server_utils import HTTP, RemoteServer
from vlserve.server.playground.routes import ASSETS, PAGE_DIR

KEY = "pg-secret-key-123"
ARTIFACTS = Path(__file__).parent / "artifacts"
LONG_SCHEMA = '{"type": "string", "minLength": 16000}'  # no EOS possible for a long while: only Stop ends it
EXPECTED_CSP = {"default-src 'self'", "script-src 'self'", "style-src 'self'", "img-src 'self' data: blob:",
                "media-src 'self' data: blob:", "connect-src 'self'", "frame-ancestors 'none'", "base-uri 'none'",
                "form-action 'none'"}


@pytest.fixture(scope="module")
def servers(tiny_ckpt):
    """Two servers starting side by side: plain, and with --api-key (and a small media limit)."""
    ckpt = tiny_ckpt("qwen2_vl")
    started = {}
    try:
        started["plain"] = RemoteServer(ckpt, "--served-model-name", "pg", wait=False)
        started["keyed"] = RemoteServer(ckpt, "--served-model-name", "pg", "--max-media-bytes", "100000",
                                        api_key=KEY, wait=False)
        for server in started.values():
            server.wait_healthy()
        yield started
    finally:
        for server in started.values():  # all asked to stop first: they shut down side by side
            server.proc.send_signal(signal.SIGINT)
        for server in started.values():
            server.close()


@pytest.fixture(scope="module")
def browser():
    driver = chromium_or_skip()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    path = tmp_path_factory.mktemp("playground") / "cat picture.png"
    noise_image(56, 84, seed=7).save(path)
    return path


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


# ---- driving the page ----
def wait(driver, condition, timeout: float = 20, what: str = "the page"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(condition)
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {condition}\nconsole: {console_errors(driver)}")


def open_page(driver, url: str) -> None:
    driver.get(url)
    wait(driver, "return document.body.dataset.state === 'idle' || document.getElementById('key-dialog').open",
         what="the page to load")


def fill(driver, element_id: str, text: str) -> None:
    el = driver.find_element("id", element_id)
    el.clear()
    el.send_keys(text)


def ask(driver, question: str, max_tokens: int, files=(), schema: str = "") -> None:
    driver.find_element("id", "clear").click()
    fill(driver, "max-tokens", str(max_tokens))
    fill(driver, "temperature", "0")
    driver.execute_script("document.getElementById('schema').value = arguments[0]", schema)
    for f in files:
        driver.find_element("id", "file-input").send_keys(str(f))
    wait(driver, f"return document.querySelectorAll('#attachments li').length === {len(files)}", what="attachments")
    fill(driver, "prompt", question)
    driver.find_element("id", "send").click()


LAST_ANSWER = "return [...document.querySelectorAll('.msg.assistant')].pop()"


def answer(driver, timeout: float = 30) -> tuple[str, str]:
    """(status, text) of the last answer once it is no longer streaming."""
    wait(driver, f"const a = ({LAST_ANSWER.removeprefix('return ')}); return a && a.dataset.status !== 'streaming' "
         "&& document.body.dataset.state === 'idle'", timeout, "the answer")
    return tuple(driver.execute_script(f"const a = ({LAST_ANSWER.removeprefix('return ')}); "
                                       "return [a.dataset.status, a.querySelector('.text').textContent]"))


def text_of(driver, element_id: str) -> str:
    return driver.execute_script("return document.getElementById(arguments[0]).textContent", element_id)


# ---- tests ----
def test_picture_question_streams_the_api_answer(servers, browser, picture, tmp_path):
    server = servers["plain"]
    open_page(browser, server.url + "/playground")
    assert text_of(browser, "model") == "pg"
    ask(browser, "What is in this picture?", 12, files=[picture])
    status, text = answer(browser)
    assert status == "done", text_of(browser, "error")

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture)}},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    direct = server.client().chat.completions.create(model="pg", messages=messages, max_tokens=12, temperature=0)
    assert text == direct.choices[0].message.content and text
    usage = direct.usage
    assert text_of(browser, "stat-tokens") == f"{usage.prompt_tokens} / {usage.completion_tokens}"
    assert re.fullmatch(r"\d+ ms", text_of(browser, "stat-ttft"))
    assert re.fullmatch(r"\d+(\.\d+)?", text_of(browser, "stat-tps"))

    # The same question again: the prefix cache answers most of the prompt, and the page says so.
    ask(browser, "What is in this picture?", 12, files=[picture])
    assert answer(browser) == ("done", text)
    cached = int(browser.execute_script("return document.getElementById('stats').dataset.cached"))
    assert 0 < cached <= usage.prompt_tokens
    assert text_of(browser, "stat-prefix").startswith(f"hit: {cached} of {usage.prompt_tokens}")
    assert "whole server" in text_of(browser, "stat-encoder")

    # The snippets reproduce the request from the file on disk (no pasted base64), and give the same answer.
    curl, python = text_of(browser, "snippet-curl"), text_of(browser, "snippet-python")
    assert "base64 -w0 'cat picture.png'" in curl and len(curl) < 2000 and len(python) < 3000
    (tmp_path / picture.name).write_bytes(picture.read_bytes())
    out = subprocess.run(["bash", "-c", curl], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    streamed = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                       for line in out.stdout.splitlines()
                       if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert streamed == text, out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-c", python], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith(text + "\n"), out.stderr
    assert console_errors(browser) == []


def test_stop_cancels_the_request_on_the_server(servers, browser):
    server = servers["plain"]
    open_page(browser, server.url + "/")
    before = server.metrics()["vlserve:generation_tokens_total"]
    ask(browser, "Tell me a long story", 8000, schema=LONG_SCHEMA)
    wait(browser, f"const a = ({LAST_ANSWER.removeprefix('return ')}); return a && "
         "a.querySelector('.text').textContent.length > 20", what="streamed text")
    assert server.metrics()["vlserve:num_requests_running"] == 1
    browser.find_element("id", "stop").click()
    stopped = time.monotonic()
    # The server sees the disconnect and aborts: nothing runs any more, long before 8000 tokens could be made
    # (about 15 s here), and the page says it stopped.
    while server.metrics()["vlserve:num_requests_running"] != 0:
        assert time.monotonic() - stopped < 3, "the request still runs on the server after Stop"
        time.sleep(0.05)
    status, text = answer(browser)
    assert status == "stopped" and text
    assert text_of(browser, "stat-status") == "stopped"
    time.sleep(0.3)
    generated = server.metrics()["vlserve:generation_tokens_total"] - before
    assert 0 < generated < 4000
    assert server.metrics()["vlserve:num_requests_running"] == 0


def test_api_key_is_asked_for_and_kept_out_of_the_url(servers, browser, picture, tmp_path):
    server = servers["keyed"]
    assert HTTP.get(server.url + "/playground").status_code == 200  # the page needs no key...
    assert HTTP.get(server.url + "/v1/models").status_code == 401  # ...its data does
    open_page(browser, server.url + "/playground")
    assert browser.execute_script("return document.getElementById('key-dialog').open")
    fill(browser, "key-input", "wrong-key")
    browser.find_element("id", "key-submit").click()
    wait(browser, "return !document.getElementById('key-error').hidden", what="the refused key's message")
    assert "refused" in text_of(browser, "key-error")
    fill(browser, "key-input", KEY)
    browser.find_element("id", "key-submit").click()
    wait(browser, "return !document.getElementById('key-dialog').open && document.body.dataset.state === 'idle' "
         "&& document.getElementById('model').value === 'pg'", what="the models, with the key")

    # Over the server's --max-media-bytes: refused by the page itself, nothing sent.
    big = tmp_path / "big.png"
    noise_image(300, 300, seed=1).save(big)
    browser.find_element("id", "file-input").send_keys(str(big))
    wait(browser, "return !document.getElementById('error').hidden", what="the size refusal")
    assert "big.png is" in text_of(browser, "error") and "at most 98 KiB per image" in text_of(browser, "error")
    assert browser.execute_script("return document.querySelectorAll('#attachments li').length") == 0

    ask(browser, "Hello", 6, files=[picture])
    status, text = answer(browser)
    assert status == "done", text_of(browser, "error")
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture)}},
                                             {"type": "text", "text": "Hello"}]}]
    direct = server.client().chat.completions.create(model="pg", messages=messages, max_tokens=6, temperature=0)
    assert text == direct.choices[0].message.content

    assert KEY not in browser.current_url and "wrong-key" not in browser.current_url
    assert KEY not in browser.page_source
    assert browser.execute_script("return sessionStorage.getItem('vlserve.apiKey')") == KEY
    assert browser.execute_script("return localStorage.length") == 0 and KEY not in browser.get_cookies().__str__()
    snippets = text_of(browser, "snippet-curl") + text_of(browser, "snippet-python")
    assert "VLSERVE_API_KEY" in snippets and KEY not in snippets
    assert all("401 (Unauthorized)" in e for e in console_errors(browser))  # the wrong key's, and only those


class _Inline(HTMLParser):
    """Collects what a strict CSP would block: inline scripts, inline handlers, style attributes, <style>."""

    def __init__(self):
        super().__init__()
        self.scripts, self.problems, self._in_script = [], [], False

    def handle_starttag(self, tag, attrs):
        names = dict(attrs)
        self.problems += [f"<{tag} {a}>" for a in names if a.startswith("on") or a == "style"]
        if tag == "style":
            self.problems.append("<style>")
        if tag == "script":
            self.scripts.append(names.get("src"))
            self._in_script = True

    def handle_endtag(self, tag):
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.problems.append(f"inline script: {data[:40]!r}")


def test_headers_csp_and_inline_free_page(servers):
    plain = servers["plain"]
    for path in ("/", "/playground", "/playground/app.js", "/playground/style.css", "/playground/config.json"):
        r = HTTP.get(plain.url + path)
        assert r.status_code == 200, path
        assert set(map(str.strip, r.headers["content-security-policy"].split(";"))) >= EXPECTED_CSP, path
        assert r.headers["x-content-type-options"] == "nosniff"
    page = HTTP.get(plain.url + "/").text
    parsed = _Inline()
    parsed.feed(page)
    assert parsed.scripts == ["playground/app.js"] and parsed.problems == []
    assert HTTP.get(plain.url + "/playground/app.js").headers["content-type"].startswith("text/javascript")
    assert HTTP.get(plain.url + "/playground/routes.py").status_code == 404  # only the page's own files
    assert HTTP.get(plain.url + "/playground/config.json").json() == {
        "auth_required": False, "limits": {"max_media_bytes": 20 * 2**20, "max_video_bytes": 200 * 2**20,
                                           "max_request_bytes": 64 * 2**20,
                                           "mm_per_prompt": {"image": 8, "video": 1, "audio": 4}}}
    # Every file the page loads ships in the package (pyproject's package data) and is served.
    shipped = {p.name for p in PAGE_DIR.iterdir() if p.suffix in (".html", ".css", ".js")}
    assert shipped == set(ASSETS)
    imports = set(re.findall(r'from "\./([\w.]+)"', "".join((PAGE_DIR / n).read_text() for n in ASSETS)))
    assert imports and imports <= set(ASSETS)


@pytest.mark.parametrize("role", ["serve", "language", "decode"])
def test_no_playground_gives_404(role):
    """--no-playground, on every role that answers the OpenAI API, reaches the app: / and /playground are 404."""
    from fastapi.testclient import TestClient

    from vlserve.cli import build_parser
    from vlserve.core.options import options_from
    from vlserve.server.api_server import build_app

    args = [role, "--model", "m"] + (["--bootstrap", "127.0.0.1:1"] if role != "serve" else [])
    engine = SimpleNamespace(model_name="m", cfg=SimpleNamespace(limit_mm_per_prompt={"image": 8}))
    for flags, status in (([], 200), (["--no-playground"], 404)):
        server = options_from(build_parser().parse_args(args + flags), role).server
        client = TestClient(build_app(engine, server))
        for path in ("/", "/playground", "/playground/app.js", "/playground/config.json"):
            assert client.get(path).status_code == status, (flags, path)


def test_drop_and_the_servers_error_message(servers, browser, picture, tmp_path):
    """Files dropped on the page attach like picked ones; a part the model refuses (audio, for this vision model)
    shows the server's own error message, and the message comes back to be fixed."""
    server = servers["plain"]
    open_page(browser, server.url + "/")
    browser.find_element("id", "clear").click()
    clip = tmp_path / "beep.wav"
    with wave.open(str(clip), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(b"\0\1" * 1600)
    browser.execute_script("""
        const dt = new DataTransfer();
        for (const [name, type, b64] of arguments[0]) {
          dt.items.add(new File([Uint8Array.from(atob(b64), (c) => c.charCodeAt(0))], name, {type}));
        }
        window.dispatchEvent(new DragEvent("drop", {dataTransfer: dt, bubbles: true, cancelable: true}));
    """, [[p.name, t, base64.b64encode(p.read_bytes()).decode()] for p, t in ((picture, "image/png"),
                                                                                (clip, "audio/wav"))])
    wait(browser, "return document.querySelectorAll('#attachments li').length === 2", what="the dropped files")
    fill(browser, "prompt", "What do you hear?")
    browser.find_element("id", "send").click()
    status, _ = answer(browser)
    assert status == "error"
    error = text_of(browser, "error")
    assert error.startswith("400: ") and "not audio" in error and "input_audio" in error
    assert browser.find_element("id", "prompt").get_attribute("value") == "What do you hear?"
    assert browser.execute_script("return document.querySelectorAll('#attachments li').length") == 2
    assert all("400 (Bad Request)" in e for e in console_errors(browser))


def test_screenshots_desktop_and_phone(servers, browser, picture):
    server = servers["plain"]
    open_page(browser, server.url + "/playground")
    ask(browser, "Describe this picture.", 24, files=[picture])
    assert answer(browser)[0] == "done"
    ARTIFACTS.mkdir(exist_ok=True)
    browser.set_window_size(1280, 860)
    assert browser.save_screenshot(str(ARTIFACTS / "playground-desktop.png"))
    browser.set_window_size(390, 844)
    # Phone width: one column, nothing wider than the screen.
    width = browser.execute_script("return document.documentElement.clientWidth")
    assert browser.execute_script("return document.documentElement.scrollWidth") <= width <= 390
    composer, side = (browser.find_element("id", i).rect for i in ("composer", "side"))
    assert side["y"] >= composer["y"] + composer["height"] and side["width"] <= width  # below the chat, no overlap
    assert browser.save_screenshot(str(ARTIFACTS / "playground-phone.png"))
    browser.set_window_size(1280, 900)
    print(f"screenshots: {ARTIFACTS}/playground-desktop.png, playground-phone.png")
    assert console_errors(browser) == []
