"""Media refusals name the option that changes them (issue #53): file:// URLs (--allowed-local-media-path), hosts
on private networks (--allow-private-media-urls) or off the domain list (--allowed-media-domains), pictures over
the pixel cap however they are refused, Pillow's own decompression-bomb guard included (--max-image-pixels: never
Pillow's text), bytes (--max-media-bytes / --max-video-bytes), frames (--max-video-frames) and media counts
(--limit-mm-per-prompt). The functions that raise first, then the OpenAI app around stand-ins for the engine with
the real media fetchers and input processor (a tiny checkpoint, no model run)."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace as NS

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image, ImageFile

from tests.conftest import noise_image
from vlserve.cli import build_parser
from vlserve.core.config import SERVE, EngineArgs
from vlserve.core.errors import InvalidInputError, MediaFetchError, MediaTooLargeError
from vlserve.core.options import options_from
from vlserve.engine.config import resolve_config
from vlserve.frontend.input_processor import InputProcessor
from vlserve.media.audio import AudioLimits, load_audio, load_video_audio
from vlserve.media.fetch import MediaFetcher, MediaPolicy
from vlserve.media.image import load_image
from vlserve.media.video import VideoOptions, load_video
from vlserve.server.api_server import build_app, local_prompt_encoder

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PILLOW_TEXT = ("decompression bomb", "DOS attack", "exceeds limit")  # Pillow's words, never a client's


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` (and holds no pixels)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


class Resolver(MediaFetcher):
    """Every host resolves to the address given (no DNS)."""

    address = "10.1.2.3"

    async def _resolve(self, host, port):
        return [self.address]


def fetch(url: str, policy: MediaPolicy | None = None, fetcher=Resolver):
    async def go():
        async with fetcher(policy or MediaPolicy()) as f:
            return await f.fetch(url)

    return asyncio.run(go())


# ---- 1. file:// -----------------------------------------------------------------------------------------------
def test_a_file_url_names_the_option_that_allows_local_files(tmp_path):
    (tmp_path / "cat.png").write_bytes(png_header(4, 4))
    with pytest.raises(MediaFetchError) as e:
        fetch(f"file://{tmp_path}/cat.png")
    assert str(e.value) == ("file:// media URLs are refused: start the server with --allowed-local-media-path DIR "
                            "to allow files under DIR")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    with pytest.raises(MediaFetchError) as e:
        fetch(f"file://{tmp_path}/cat.png", MediaPolicy(allowed_local_media_path=allowed))
    assert str(e.value) == ("file:// media URL is outside the server's allowed local media path: only files under "
                            "the DIR given to --allowed-local-media-path may be read (symlinks resolved)")
    assert str(tmp_path) not in str(e.value)


def test_offline_a_local_path_or_file_url_is_opened_as_given(tiny_processor, tmp_path):
    """The offline API (`LLM`, whose input processor this is) has no file:// policy: the caller's files are its
    own, so no refusal there names --allowed-local-media-path."""
    noise_image(32, 32, 1).save(tmp_path / "cat.png")
    for source in (f"file://{tmp_path}/cat.png", str(tmp_path / "cat.png")):
        processed = tiny_processor.process({"prompt": f"{IMG}hi", "multi_modal_data": {"image": [source]}})
        assert len(processed.mm_items) == 1


# ---- 2. hosts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("address", ["10.1.2.3", "127.0.0.1", "169.254.169.254", "fe80::1"])
def test_a_private_address_names_the_option_that_allows_it(address):
    class Private(Resolver):
        pass

    Private.address = address
    with pytest.raises(MediaFetchError) as e:
        fetch("https://intranet.example/cat.png", fetcher=Private)
    assert str(e.value) == ("media URL host 'intranet.example', which resolves to a private, loopback, link-local or "
                            "reserved address; such media URLs are refused unless the server is started with "
                            "--allow-private-media-urls")
    assert e.value.http_status == 400


def test_a_host_off_the_domain_list_names_the_option_that_lists_them():
    with pytest.raises(MediaFetchError) as e:
        fetch("https://evil.example/cat.png", MediaPolicy(allowed_media_domains=("images.example",)))
    assert str(e.value) == ("media URL host 'evil.example', which is not in the server's allowed media domains: it "
                            "fetches media only from the domains given to --allowed-media-domains (and their "
                            "subdomains)")


# ---- 3. pictures over the pixel cap: ours, and Pillow's guard in our words -----------------------------------
def test_a_huge_header_is_refused_naming_the_cap_never_in_pillows_words():
    with pytest.raises(MediaTooLargeError) as e:  # over twice Pillow's MAX_IMAGE_PIXELS: its error, in open()
        load_image(png_header(100_000, 100_000))
    assert str(e.value) == "image is 10000000000 pixels, more than the 64000000 allowed (--max-image-pixels)"
    assert e.value.http_status == 413
    with pytest.raises(MediaTooLargeError) as e:  # under Pillow's limit: our own check, with the sides
        load_image(png_header(10_000, 7_000))
    assert str(e.value) == "image is 10000x7000 = 70000000 pixels, more than the 64000000 allowed (--max-image-pixels)"


def test_pillows_warning_made_an_error_is_refused_in_our_words():
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(MediaTooLargeError) as e:  # over Pillow's MAX_IMAGE_PIXELS (not twice)
            load_image(png_header(10_000, 10_000))
    assert str(e.value) == "image is 100000000 pixels, more than the 64000000 allowed (--max-image-pixels)"


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_a_cap_above_pillows_limit_says_which_limit_refused():
    with pytest.raises(MediaTooLargeError) as e:
        load_image(png_header(30_000, 30_000), max_pixels_decoded=10**10)
    message = str(e.value)
    assert message.startswith("image is 900000000 pixels: within --max-image-pixels (10000000000) but over the ")
    assert "Pillow" in message and not any(text in message for text in PILLOW_TEXT[1:])


def test_pillows_guard_while_decoding_a_frame_or_tile(monkeypatch):
    def bomb(self):
        raise Image.DecompressionBombError("Image size (200000000 pixels) exceeds limit of 178956970 pixels, could "
                                           "be decompression bomb DOS attack.")

    monkeypatch.setattr(ImageFile.ImageFile, "load", bomb)
    buf = io.BytesIO()
    noise_image(8, 8, 1).save(buf, "PNG")
    with pytest.raises(MediaTooLargeError) as e:
        load_image(buf.getvalue())
    assert str(e.value) == ("a frame or tile of the image is 200000000 pixels, more than the 64000000 allowed "
                            "(--max-image-pixels)")


def test_video_frames_name_the_cap_and_the_frame_count():
    frames = [np.zeros((20, 30, 3), np.uint8)] * 4
    with pytest.raises(MediaTooLargeError, match=r"allowed per frame \(--max-image-pixels\)$"):
        load_video(frames, VideoOptions(), max_frame_pixels=500)
    with pytest.raises(MediaTooLargeError, match="decoded-video budget of 1000 pixels: .*--max-video-frames"):
        load_video(frames, VideoOptions(), max_frame_pixels=10_000, max_total_pixels=1000)
    with pytest.raises(InvalidInputError, match=r"max_frames 64 exceeds the server's limit of 32 \(--max-video-frames\)"):
        VideoOptions().with_overrides({"max_frames": 64}, server_max_frames=32)


# ---- other limits: bytes and counts ---------------------------------------------------------------------------
def test_byte_limits_name_their_option():
    limits = AudioLimits(max_bytes=100)
    with pytest.raises(MediaTooLargeError, match=r"the audio is 101 bytes, over the limit of 100 bytes "
                                                 r"\(--max-media-bytes\)"):
        load_audio(b"x" * 101, limits)
    with pytest.raises(MediaTooLargeError, match=r"over the limit of 100 bytes \(--max-media-bytes\)"):
        load_audio(data_url(b"x" * 101, "audio/wav"), limits)
    with pytest.raises(MediaTooLargeError, match=r"the video is 101 bytes, over the limit of 100 bytes "
                                                 r"\(--max-video-bytes\)"):
        load_video_audio(b"x" * 101, limits)
    with pytest.raises(MediaTooLargeError, match=r"over the limit of 100 bytes \(--max-video-bytes\)"):
        load_video_audio(data_url(b"x" * 101, "video/mp4"), limits)
    server = options_from(build_parser().parse_args(["serve", "--model", "m"]), SERVE).server
    assert MediaPolicy.from_args(server, "video").max_bytes_flag == "--max-video-bytes"
    assert MediaPolicy.from_args(server, "image").max_bytes_flag == "--max-media-bytes"
    assert MediaPolicy.from_args(server, "audio").max_bytes_flag == "--max-media-bytes"


def test_too_many_items_in_a_prompt_names_the_option_and_the_offline_argument(tiny_ckpt):
    cfg = resolve_config(EngineArgs(model=str(tiny_ckpt("qwen2_vl")), dtype="float32",
                                    limit_mm_per_prompt={"image": 1}), announce=False)
    proc = InputProcessor.for_model(cfg)
    img = noise_image(32, 32, 1)
    with pytest.raises(InvalidInputError) as e:
        proc.process({"prompt": f"{IMG}{IMG}hi", "multi_modal_data": {"image": [img, img]}})
    assert str(e.value) == ("2 images in one prompt; at most 1 allowed (--limit-mm-per-prompt image=1; offline, "
                            "LLM(limit_mm_per_prompt=...))")


# ---- through the OpenAI app ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_cfg(tiny_ckpt):
    return resolve_config(EngineArgs(model=str(tiny_ckpt("qwen2_vl")), dtype="float32"), announce=False)


@pytest.fixture(scope="module")
def tiny_processor(tiny_cfg) -> InputProcessor:
    return InputProcessor.for_model(tiny_cfg)


class _Engine(NS):
    """The app's engine up to preparing a prompt: the server's own prompt encoder (its media fetchers, under the
    server's options) and the tiny checkpoint's input processor; nothing generates."""

    def __init__(self, processor: InputProcessor, server, pool):
        super().__init__(model_name="m", is_healthy=True, unhealthy_reason=None, not_ready_reason=None,
                         metrics=NS(render=lambda: b""), executor=pool, tokenizer=processor.tokenizer,
                         input_processor=processor,
                         cfg=NS(limit_mm_per_prompt=processor.cfg.limit_mm_per_prompt, model_path="m",
                                max_model_len=processor.cfg.max_model_len, model=processor.cfg.model))
        self.encoder = local_prompt_encoder(server)(self)

    def check_accepting(self) -> None:
        pass

    async def prepare(self, prompt, mm_processor_kwargs=None, arrival=None, request_id="", params=None,
                      adapter=None):
        await self.encoder.encode(prompt, mm_processor_kwargs, request_id, params)
        raise AssertionError("every request of these tests is refused while its media is prepared")


@pytest.fixture
def app_client(tiny_cfg):
    """(server flags) -> a TestClient of the app built with them (its input processor with the server's media
    bounds, as `serve` makes it)."""
    made = []

    def build(*flags: str) -> TestClient:
        server = options_from(build_parser().parse_args(["serve", "--model", "m", *flags]), SERVE).server
        pool = ThreadPoolExecutor(2)
        engine = _Engine(InputProcessor.for_model(tiny_cfg, **server.media_bounds()), server, pool)
        made.append((engine, pool))
        return TestClient(build_app(engine, server))

    yield build
    for engine, pool in made:
        asyncio.run(engine.encoder.stop())
        pool.shutdown()


def ask(client: TestClient, url: str) -> tuple[int, str]:
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is this?"}]}]}
    resp = client.post("/v1/chat/completions", json=body)
    return resp.status_code, resp.json()["error"]["message"]


def test_the_server_answers_each_refusal_with_its_option(app_client, tmp_path):
    noise_image(16, 16, 1).save(tmp_path / "cat.png")
    client = app_client()
    status, message = ask(client, f"file://{tmp_path}/cat.png")
    assert (status, message) == (400, ("file:// media URLs are refused: start the server with "
                                       "--allowed-local-media-path DIR to allow files under DIR"))
    status, message = ask(client, "http://127.0.0.1:9/cat.png")
    assert status == 400 and message.endswith("unless the server is started with --allow-private-media-urls")
    status, message = ask(client, data_url(png_header(100_000, 100_000)))
    assert (status, message) == (413, ("image is 10000000000 pixels, more than the 64000000 allowed "
                                       "(--max-image-pixels)"))
    assert ask(app_client("--max-image-pixels", "4000000"), data_url(png_header(3000, 3000))) == (
        413, "image is 3000x3000 = 9000000 pixels, more than the 4000000 allowed (--max-image-pixels)")
    (tmp_path / "elsewhere").mkdir()
    assert ask(app_client("--allowed-local-media-path", str(tmp_path / "elsewhere")),
               f"file://{tmp_path}/cat.png")[1].endswith("given to --allowed-local-media-path may be read "
                                                         "(symlinks resolved)")
    status, message = ask(app_client("--allowed-media-domains", "images.example"), "https://evil.example/cat.png")
    assert status == 400 and "--allowed-media-domains" in message
    status, message = ask(app_client("--max-media-bytes", "100"), data_url(b"x" * 101))
    assert (status, message) == (413, "base64 media is 101 bytes, over the limit of 100 bytes (--max-media-bytes)")
