"""The hostile probe's media findings (issue 43 §3): every bound on a picture is checked from its header before it
is decoded (server and router paths, both families); large base64 payloads, data URLs, chat bodies and pictures
are worked on in bounded slices off the event loop (a worker that held the GIL for a whole 60 MB payload stalled
/health as surely as work on the loop); malformed WAV headers and absurd samples are a 400, never a 500 or NaN."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import struct
import threading
import types
import zlib

import blake3
import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from tests.conftest import noise_image
from tests.test_llava_processor import OV, make_processor, prompt
from vlserve.core.config import EngineArgs
from vlserve.core.errors import InvalidInputError, MediaTooLargeError
from vlserve.engine.config import resolve_config
from vlserve.frontend.input_processor import InputProcessor
from vlserve.media import data_url
from vlserve.media.audio import MAX_SAMPLE_MAGNITUDE, AudioLimits, load_audio
from vlserve.media.hashing import hash_image
from vlserve.media.image import ImageBounds, check_header_size, load_image
from vlserve.media.video import VideoOptions, load_video
from vlserve.server.errors import error_from_exception

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"


# ---- pictures: every bound from the header ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    """LLaVA-OneVision's tiny checkpoint as tests/test_llava_processor.py's `make_processor` takes it."""
    from transformers import AutoTokenizer

    from vlserve.model.hf_config import load_model_config

    folder = tiny_ckpt("llava_onevision")
    return {OV: (folder, load_model_config(folder), AutoTokenizer.from_pretrained(folder))}


def png_of_size(width: int, height: int) -> bytes:
    """A valid grey PNG of that size, all black: a tiny file however many pixels it holds (the probe's was 233 KB
    for 1 x 60,000,000). Built row by row, so the test never holds its pixels either."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z, parts, row = zlib.compressobj(9), [], b"\0" * (width + 1)  # filter byte, then the row
    for _ in range(height):
        for i in range(0, len(row), 1 << 20):
            parts.append(z.compress(row[i:i + (1 << 20)]))
    parts.append(z.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def long_thin_png() -> bytes:
    data = png_of_size(60_000_000, 1)
    assert len(data) < 300_000
    return data


class Decoded(Exception):
    """Raised by the test's stand-in for Pillow's decoder: a picture was decoded."""


@pytest.fixture
def no_decoding(monkeypatch):
    """Any pixel decode fails the test (Image.open reads the header only; load() decodes)."""
    def load(self):
        raise Decoded(f"a {self.width}x{self.height} picture was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)


def qwen_processor(ckpt, **engine_args) -> InputProcessor:
    cfg = resolve_config(EngineArgs(model=str(ckpt), dtype="float32", **engine_args), announce=False)
    return InputProcessor.for_model(cfg)


def data_url_of(data: bytes, subtype: str = "png") -> str:
    return f"data:image/{subtype};base64," + base64.b64encode(data).decode()


def test_qwen_refuses_a_long_thin_picture_from_its_header(tiny_ckpt, long_thin_png, no_decoding):
    """1 x 60,000,000 pixels, under --max-image-pixels (64 M): smart_resize's aspect-ratio bound (200) refuses it
    before a pixel is decoded, on the server's path and on the router's (`layout`), as bytes or as a data URL."""
    proc = qwen_processor(tiny_ckpt("qwen2_vl"))
    for src in (long_thin_png, data_url_of(long_thin_png)):
        for run in (proc.process, proc.layout):
            with pytest.raises(InvalidInputError, match=r"60000000x1 pixels, an aspect ratio of 60000000.0; this "
                                                        r"model takes at most 200") as e:
                run({"prompt": f"{IMG}hi", "multi_modal_data": {"image": [src]}})
            assert error_from_exception(e.value)[1] == 400


def test_qwen_refuses_too_many_tokens_from_the_header(tiny_ckpt, no_decoding):
    proc = qwen_processor(tiny_ckpt("qwen2_vl"), max_num_encoder_input_tokens=64)
    with pytest.raises(InvalidInputError, match=r"embedding tokens, more than the 64 one item may take"):
        proc.process({"prompt": f"{IMG}hi", "multi_modal_data": {"image": [png_of_size(600, 500)]}})


def test_qwen_refuses_a_long_thin_video_frame_before_resizing(tiny_ckpt):
    proc = qwen_processor(tiny_ckpt("qwen2_vl"))
    frames = np.zeros((4, 2, 600, 3), np.uint8)
    with pytest.raises(InvalidInputError, match=r"a video frame is 600x2 pixels, an aspect ratio of 300.0"):
        proc.process({"prompt": "<|vision_start|><|video_pad|><|vision_end|>hi",
                      "multi_modal_data": {"video": [frames]}})
    with pytest.raises(InvalidInputError, match=r"a video frame is 600x2 pixels"):
        load_video(list(frames), VideoOptions(), ImageBounds(max_aspect_ratio=200))


def test_llava_refuses_a_side_over_its_bound_from_the_header(tiny, long_thin_png, no_decoding):
    """LLaVA-OneVision: the probe's picture took the front end to 3.7 GB and 24.6 s before the engine's grid check
    (sides up to 2**20) refused it; that bound is now the processor's, checked from the header."""
    proc = make_processor(tiny, OV)
    for run in (proc.process, proc.layout):
        with pytest.raises(MediaTooLargeError, match=r"60000000x1 pixels; this model takes at most 1048576 pixels "
                                                     r"a side"):
            run(prompt(proc, "<image>", [long_thin_png]))


def test_llava_refuses_tokens_and_canvas_from_the_header(tiny, no_decoding):
    proc = make_processor(tiny, OV, limit=100)
    with pytest.raises(InvalidInputError, match=r"500x400 picture would take \d+ embedding tokens, more than the 100"):
        proc.process(prompt(proc, "<image>", [png_of_size(500, 400)]))
    proc = make_processor(tiny, OV, max_pixels=12_000)  # a 100x100 picture goes to the 112x112 pinpoint
    with pytest.raises(MediaTooLargeError, match=r"resized to 112x112 = 12544 pixels"):
        proc.process(prompt(proc, "<image>", [png_of_size(100, 100)]))


def test_pictures_within_the_bounds_still_decode(tiny_ckpt, tiny):
    """The bounds cost nothing to a picture within them: the same grid and hash as before."""
    proc = qwen_processor(tiny_ckpt("qwen2_vl"))
    buf = io.BytesIO()
    noise_image(300, 2, 1).save(buf, "PNG")  # an aspect ratio of 150: within 200
    item = proc.process({"prompt": f"{IMG}hi", "multi_modal_data": {"image": [buf.getvalue()]}}).mm_items[0]
    assert item.pixel_values is not None and item.num_tokens > 0
    llava = make_processor(tiny, OV)
    assert llava.process(prompt(llava, "<image>", [png_of_size(3000, 1)])).mm_items[0].layout[1:] == (1, 3000)


def test_a_family_check_refuses_only_what_fails_both_ways_round():
    """EXIF may turn a picture a quarter after decoding: a family's size check refuses from the header only what
    it would refuse either way round (the decoded picture is checked again)."""
    seen = []

    def wide_only(width: int, height: int) -> None:
        seen.append((width, height))
        if width < height:
            raise InvalidInputError("too tall")

    check_header_size(10, 40, "RGB", ImageBounds(), wide_only)  # fits turned: left to the decoded check
    assert seen == [(10, 40), (40, 10)]

    def never(width: int, height: int) -> None:
        raise InvalidInputError(f"no {width}x{height}")

    with pytest.raises(InvalidInputError, match="no 10x40"):
        check_header_size(10, 40, "RGB", ImageBounds(), never)
    with pytest.raises(MediaTooLargeError, match="pixels a side"):
        check_header_size(10, 41, "RGB", ImageBounds(max_side=40), None)
    with pytest.raises(InvalidInputError, match="aspect ratio of 4.1"):
        check_header_size(10, 41, "RGB", ImageBounds(max_aspect_ratio=4), None)
    with pytest.raises(MediaTooLargeError, match="--max-image-pixels"):
        check_header_size(100, 100, "RGB", ImageBounds(max_pixels=9_999), None)


def test_an_exif_turned_picture_is_checked_as_turned():
    img = Image.new("RGB", (40, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: shown 10 wide, 40 tall
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif.tobytes())
    assert load_image(buf.getvalue()).size == (10, 40)
    with pytest.raises(InvalidInputError, match="no"):
        load_image(buf.getvalue(), check=lambda w, h: (_ for _ in ()).throw(InvalidInputError("no")))


# ---- large payloads: bounded slices, off the event loop -------------------------------------------------------
SLICE = 1 << 20  # the most characters (or bytes) one C call may take: ~ms with the GIL held


def test_base64_is_decoded_a_slice_at_a_time(monkeypatch):
    """The probe's 62 MB picture body held /health for 3.8 s although it was decoded on a worker thread: one regex
    pass and one b64decode over the whole payload held the GIL for seconds. Every step now takes a bounded slice."""
    sizes = []
    real = binascii.a2b_base64

    def spy(data, *args, **kwargs):
        sizes.append(len(data))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(binascii, "a2b_base64", spy)
    raw = np.random.default_rng(0).integers(0, 256, 5_000_003, dtype=np.uint8).tobytes()
    text = base64.b64encode(raw).decode()
    mime = "\r\n".join(text[i:i + 76] for i in range(0, len(text), 76))  # whitespace is tolerated
    url_safe = base64.urlsafe_b64encode(raw).decode().rstrip("=")  # and the url-safe alphabet, unpadded
    assert data_url.decode_data_url("data:image/png;base64," + mime) == raw
    assert data_url.decode_base64(url_safe) == raw
    assert sizes and max(sizes) <= SLICE
    with pytest.raises(MediaTooLargeError, match="5000003 bytes, over the limit of 5000002"):
        data_url.decode_base64(text, max_bytes=5_000_002)


@pytest.mark.parametrize("bad,message", [("QQ==QQ==", "padding"), ("QU=D", "padding"), ("Q", "1 more than"),
                                         ("QUJD\u00e9", "non-ASCII"), ("QU*D", "base64"), ("====", "padding")])
def test_bad_base64_is_refused(bad, message):
    with pytest.raises(InvalidInputError, match=message):
        data_url.decode_base64(bad)


def test_a_data_url_header_is_bounded():
    """Only the header is matched against the data URL pattern: megabytes of 'parameters' are refused, not
    scanned (with backtracking) on every request."""
    with pytest.raises(InvalidInputError, match=r"header \(what comes before the comma\) must be at most 1024"):
        data_url.decode_data_url("data:image/png;name=" + "x" * 2000 + ";base64,QUJD")
    with pytest.raises(InvalidInputError, match="header"):
        data_url.decode_data_url("data:image/png;name=" + "x" * 3_000_000)
    assert data_url.decode_data_url("data:image/png;name=cat.png;base64,QUJD") == b"ABC"


def test_pictures_are_hashed_a_band_at_a_time(monkeypatch):
    """The content hash is of the picture's bytes, but no whole copy of a big picture is made for it."""
    img = noise_image(1500, 1000, 3)
    whole = img.tobytes()
    sizes = []
    real = Image.Image.tobytes

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        sizes.append(len(out))
        return out

    monkeypatch.setattr(Image.Image, "tobytes", spy)
    h = blake3.blake3(b"image|RGB|1500x1000|{}")
    h.update(whole)
    assert hash_image(img, {}) == h.hexdigest(length=16)
    assert max(sizes) <= SLICE + 1500 * 3


def test_a_data_url_cache_key_is_the_hash_of_its_text():
    from vlserve.model.families.processor import MediaItemCache

    url = data_url_of(bytes(range(256)) * 20_000)
    h = blake3.blake3(b'image|[null]|')
    h.update(url.encode())
    assert MediaItemCache.key("image", url, [None]) == h.digest()


def test_chat_messages_are_parsed_off_the_event_loop(monkeypatch):
    """Parsing a chat touches every byte of its text and media (an input_audio part is checked and rebuilt as a
    data URL): a worker's job, like rendering its template, never the event loop's."""
    import vlserve.server.serving_chat as module
    from vlserve.frontend.chat import parse_chat_messages

    threads = []

    def parse(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            threads.append("event loop")
        except RuntimeError:
            threads.append(threading.current_thread().name)
        return parse_chat_messages(*args, **kwargs)

    monkeypatch.setattr(module, "parse_chat_messages", parse)
    monkeypatch.setattr(module, "render_chat", lambda tokenizer, messages, *rest: "rendered")
    prepared = []

    async def prepare(prompt, *rest):
        prepared.append(prompt)
        return "prepared"

    from concurrent.futures import ThreadPoolExecutor

    from vlserve.server.protocol import ChatCompletionRequest

    with ThreadPoolExecutor(1, thread_name_prefix="media") as pool:
        engine = types.SimpleNamespace(
            executor=pool, tokenizer=None, prepare=prepare,
            cfg=types.SimpleNamespace(model=types.SimpleNamespace(modalities=("image",)), max_model_len=100,
                                      limit_mm_per_prompt={"image": 1}),
            input_processor=types.SimpleNamespace(max_prompt_chars=10_000))
        serving = module.OpenAIServingChat(engine, types.SimpleNamespace(trust_request_chat_template=False), "m")
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
            {"type": "text", "text": "hi"}]}]})
        assert asyncio.run(serving._prepare(body, 0.0, "r", None)) == "prepared"
    assert threads and threads[0].startswith("media")
    assert prepared == [{"prompt": "rendered", "multi_modal_data": {"image": ["data:image/png;base64,QUJD"]}}]


def test_a_big_body_is_parsed_as_read(monkeypatch):
    """The body is parsed from the buffer it was read into: no whole copy of it is made on the event loop."""
    import vlserve.server.serving as module

    seen = []
    monkeypatch.setattr(module, "parse_body", lambda body, model: seen.append(body) or types.SimpleNamespace(
        check_fields=lambda server: None))
    chunks = [b"x" * 65536] * 8

    class Raw:
        def __init__(self):
            self.headers = {"content-length": str(65536 * 8)}

        async def stream(self):
            for c in chunks:
                yield c

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        serving = module.OpenAIServing(types.SimpleNamespace(executor=pool),
                                       types.SimpleNamespace(max_request_bytes=1 << 30, body_read_timeout=60.0), "m")
        asyncio.run(serving.parse(Raw(), None))
    assert isinstance(seen[0], bytearray) and len(seen[0]) == 65536 * 8


# ---- audio: malformed WAV headers and absurd samples ------------------------------------------------------------
GUID_TAIL = bytes.fromhex("000000001000800000aa00389b71")  # KSDATAFORMAT_SUBTYPE_* after the format tag


def wav(tag: int = 1, channels: int = 1, rate: int = 16000, bits: int = 16, data: bytes = b"\0\0" * 1600,
        extension: bytes | None = None, align: int | None = None, before: bytes = b"") -> bytes:
    """A RIFF/WAVE file with exactly this `fmt ` chunk (`extension`: cbSize and what follows; `align`: the
    block align, else the one the samples take), after the chunks `before`."""
    width = max(bits, 8) // 8
    align = channels * width if align is None else align
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * channels * width, align, bits)
    if extension is not None:
        fmt += struct.pack("<H", len(extension)) + extension
    chunks = before + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def extensible(subformat: int, valid_bits: int = 16, mask: int = 4) -> bytes:
    return struct.pack("<HIH", valid_bits, mask, subformat) + GUID_TAIL


MALFORMED = {
    "unknown format tag": (wav(tag=0x1234), r"encoding this server cannot decode \(WAV format 0x1234\)"),
    "0 bits per sample": (wav(bits=0), "PCM samples of 0 bits"),
    "40 bits per sample": (wav(bits=40, data=bytes(5 * 1600)), "PCM samples of 40 bits"),
    "16-bit float": (wav(tag=3, bits=16), "IEEE float samples of 16 bits"),
    "garbage extensible header": (wav(tag=0xFFFE, extension=b"\xff" * 22), "sub-format ff+ is not an audio"),
    "short extensible header": (wav(tag=0xFFFE, extension=b"\x01\x02"), "needs a 40-byte 'fmt ' chunk"),
    "extensible without extension": (wav(tag=0xFFFE), "needs a 40-byte 'fmt ' chunk"),
    "extensible of an unknown format": (wav(tag=0xFFFE, extension=extensible(0x1234)), "WAV format 0x1234"),
    "extensible of 0-bit PCM": (wav(tag=0xFFFE, bits=0, extension=extensible(1, 0)), "PCM samples of 0 bits"),
    "more valid bits than bits": (wav(tag=0xFFFE, extension=extensible(1, 24)), "24 valid bits in samples of 16"),
    "no channels": (wav(channels=0), "0 channels"),
    "a rate of 0": (wav(rate=0), "sample rate of 0 Hz"),
    "a block align of 0": (wav(align=0), "a block align of 0 bytes"),
    # ffmpeg reads 24-bit stereo in blocks of the header's size: a wrong one decodes other samples than the file's
    "a block align the samples do not fill": (
        wav(channels=2, bits=24, data=bytes(6 * 800), align=5),
        r"a block align of 5 bytes \(PCM samples of 24 bits in 2 channels take 6\)"),
    "a compressed encoding's block align of 0": (wav(tag=0x11, bits=4, align=0), "a block align of 0 bytes"),
    "a block align of 0 after 64 KiB of other chunks": (wav(align=0, before=b"LIST" + struct.pack("<I", 70000)
                                                            + bytes(70000)), "a block align of 0 bytes"),
    "more chunks before the samples than any file has": (wav(before=b"JUNK\0\0\0\0" * 5000),
                                                          "more than 1024 chunks before the samples"),
    "a short fmt chunk": (b"RIFF\x24\0\0\0WAVEfmt \x04\0\0\0\x01\0\x01\0data\x00\0\0\0", "'fmt ' chunk of 4 bytes"),
    "a file ending in its fmt chunk": (b"RIFF\x40\0\0\0WAVEfmt \x28\0\0\0\xfe\xff\x01\0\x80\x3e\0\0",
                                       "the file ends inside its 'fmt ' chunk"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_wav_header_is_a_400(name):
    data, message = MALFORMED[name]
    with pytest.raises(InvalidInputError, match=message) as e:
        load_audio(data, AudioLimits())
    assert error_from_exception(e.value)[1] == 400
    with pytest.raises(InvalidInputError, match=message):  # as a data URL (input_audio), and as WAV declared
        load_audio("data:audio/wav;base64," + base64.b64encode(data).decode(), AudioLimits(), fmt="wav")


def test_well_formed_wav_headers_still_decode():
    floats = np.linspace(-1.5, 1.5, 1600, dtype=np.float32)  # a float file may go past full scale
    for data in (wav(), wav(bits=24, data=bytes(3 * 1600)), wav(bits=8, data=b"\x80" * 1600),
                 wav(tag=3, bits=32, data=floats.tobytes()), wav(tag=7, bits=8, data=b"\xff" * 1600),
                 wav(tag=0xFFFE, extension=extensible(1)),
                 wav(tag=0xFFFE, bits=32, extension=extensible(3, 32), data=floats.tobytes())):
        assert len(load_audio(data, AudioLimits()).waveform) == 1600
    assert load_audio(wav(tag=3, bits=32, data=floats.tobytes()), AudioLimits()).waveform.max() == 1.5


@pytest.mark.parametrize("value", [1e18, 3e38, -1e11])
def test_absurd_float_samples_are_refused_with_the_bound(value):
    """A float32 WAV of finite samples >= 1e18 gave NaN features (and NaN logits): refused, naming the bound."""
    samples = np.zeros(1600, np.float32)
    samples[800] = value
    with pytest.raises(InvalidInputError, match=re.escape(f"magnitude {abs(value):.3g}; samples must lie within "
                                                          "+-1e+10 (full scale is 1)")):
        load_audio(wav(tag=3, bits=32, data=samples.tobytes()), AudioLimits())
    with pytest.raises(InvalidInputError, match="samples must lie within"):
        load_audio((samples, 16000), AudioLimits())
    doubles = np.zeros(1600, np.float64)
    doubles[3] = 1e200  # past float32's range
    with pytest.raises(InvalidInputError, match=r"NaN or infinite samples \(or samples past float32's range\)"):
        load_audio(wav(tag=3, bits=64, data=doubles.tobytes()), AudioLimits())
    near = np.full(1600, MAX_SAMPLE_MAGNITUDE, np.float32)  # the bound itself is taken
    assert load_audio((near, 16000), AudioLimits()).waveform.max() == np.float32(MAX_SAMPLE_MAGNITUDE)


@pytest.mark.parametrize("arch", ["qwen2_audio", "qwen2_5_omni"])
def test_both_audio_models_answer_400_for_malformed_or_absurd_audio(tiny_ckpt, arch):
    proc = qwen_processor(tiny_ckpt(arch))
    clips = [data for data, _ in MALFORMED.values()]
    clips.append(wav(tag=3, bits=32, data=np.full(1600, 1e18, np.float32).tobytes()))
    for clip in clips:
        with pytest.raises(InvalidInputError) as e:
            proc.process({"prompt": f"{AUDIO}hi", "multi_modal_data": {"audio": [clip]}})
        assert error_from_exception(e.value)[1] == 400
    features = proc.process({"prompt": f"{AUDIO}hi", "multi_modal_data": {"audio": [wav()]}}).mm_items[0]
    assert torch.isfinite(features.audio_features).all()
