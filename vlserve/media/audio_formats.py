"""Audio containers: recognised from their first bytes (so only that demuxer ever opens them: ffmpeg never probes
its way into a playlist or concat format that would open other files or URLs), the `input_audio.format` names that
may hold each, and checks that a file was cut short."""

from __future__ import annotations

from vlserve.core.errors import InvalidInputError

# Containers vlserve decodes, by what their first bytes show: name -> ffmpeg demuxer.
DEMUXERS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "ogg": "ogg", "mp4": "mov", "matroska": "matroska",
            "aiff": "aiff", "aac": "aac", "avi": "avi"}
# `input_audio.format` values and the containers each may hold.
FORMATS: dict[str, frozenset[str]] = {
    "wav": frozenset({"wav"}), "wave": frozenset({"wav"}),
    "mp3": frozenset({"mp3"}), "mpeg": frozenset({"mp3"}), "mpga": frozenset({"mp3"}),
    "flac": frozenset({"flac"}),
    "ogg": frozenset({"ogg"}), "oga": frozenset({"ogg"}), "opus": frozenset({"ogg", "matroska"}),
    "webm": frozenset({"matroska"}), "mka": frozenset({"matroska"}),
    "m4a": frozenset({"mp4"}), "mp4": frozenset({"mp4"}), "aac": frozenset({"aac", "mp4"}),
    "aiff": frozenset({"aiff"}), "aif": frozenset({"aiff"}),
}
SNIFF_BYTES = 12  # what `sniff_audio_format` needs (16 base64 characters)


def sniff_audio_format(head: bytes) -> str | None:
    """The container named by a file's first bytes (`SNIFF_BYTES` suffice), among `DEMUXERS`; None if none."""
    if len(head) >= 12 and head[:4] in (b"RIFF", b"RF64", b"BW64") and head[8:12] == b"WAVE":
        return "wav"
    if len(head) >= 12 and head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"  # a video's sound track
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if len(head) >= 12 and head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return "aiff"
    if len(head) >= 8 and head[4:8] == b"ftyp":
        return "mp4"
    if head[:3] == b"ID3":
        return "mp3"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        layer = (head[1] >> 1) & 3
        if layer == 0 and head[1] & 0xF0 == 0xF0:
            return "aac"  # ADTS: MPEG-2/4 AAC frames
        if layer:
            return "mp3"  # MPEG audio layer I, II or III frames
    return None


def check_audio_format(declared: str, head: bytes, where: str = "input_audio") -> str:
    """`declared` (an `input_audio.format`) must name a supported format that the bytes are. Returns the sniffed
    container."""
    if not isinstance(declared, str) or declared.lower() not in FORMATS:
        raise InvalidInputError(f"{where}.format {str(declared)[:32]!r} is not supported; use one of "
                                f"{', '.join(sorted(FORMATS))}")
    found = sniff_audio_format(head)
    if found is None:
        raise InvalidInputError(f"{where}: the data is not audio in a supported container "
                                f"({', '.join(sorted(DEMUXERS))})")
    if found not in FORMATS[declared.lower()]:
        raise InvalidInputError(f"{where}.format is {declared!r} but the data is {found}")
    return found


def wav_cut_short(head: bytes, size: int) -> bool:
    """A RIFF/WAVE file whose data chunk claims more bytes than the file holds (a streamed WAV says 0 or
    0xFFFFFFFF: not judged)."""
    pos = 12
    while pos + 8 <= len(head):
        chunk, length = head[pos:pos + 4], int.from_bytes(head[pos + 4:pos + 8], "little")
        if chunk == b"data":
            return length not in (0, 0xFFFFFFFF) and length > size - (pos + 8)
        pos += 8 + length + (length & 1)
    return False


def ogg_cut_short(data: bytes) -> bool:
    """An Ogg file whose last page runs past the end of the file (ffmpeg would drop that page silently and its
    duration, read from the last whole page, would agree). Pages are walked by their headers; where the walk
    meets something that is not a page, ffmpeg judges the rest."""
    pos = 0
    while pos + 27 <= len(data):
        if data[pos:pos + 4] != b"OggS":
            return False
        segments = data[pos + 26]
        if pos + 27 + segments > len(data):
            return True
        pos += 27 + segments + sum(data[pos + 27:pos + 27 + segments])
    return pos != len(data)


# WAV `fmt ` chunks. Uncompressed encodings are checked field by field (their bits per sample decide how the bytes
# are read: a wrong one decodes noise or nothing); any other format tag is left to ffmpeg, which refuses what it
# has no decoder for.
WAVE_FORMAT_EXTENSIBLE = 0xFFFE
# format tag -> (name, bits per sample it may state)
WAVE_UNCOMPRESSED: dict[int, tuple[str, frozenset[int]]] = {
    0x0001: ("PCM", frozenset(range(1, 33))),  # stored in whole bytes (12 bits in 2): what ffmpeg reads
    0x0003: ("IEEE float", frozenset({32, 64})),
    0x0006: ("A-law", frozenset({8})),
    0x0007: ("mu-law", frozenset({8})),
}
# {XXXXXXXX-0000-0010-8000-00AA00389B71}: an extensible header's sub-format, a format tag in its first bytes
_SUBFORMAT_TAIL = bytes.fromhex("000000001000800000aa00389b71")
_RIFF_HEADER = 12
MAX_WAV_CHUNKS = 1024  # chunks before the samples (fmt, fact, LIST, bext, JUNK...: a real file has a handful)


def check_wav_header(data: bytes | memoryview, what: str = "the audio") -> int | None:
    """The WAV format tag (an extensible header's sub-format) of a RIFF/WAVE file (whole, or its first bytes),
    its `fmt ` chunk checked: InvalidInputError for a malformed one. None when the chunk is not among `data`'s
    chunks (ffmpeg then judges the file). Only chunk headers are read: a chunk of megabytes is stepped over."""
    pos = _RIFF_HEADER
    for _ in range(MAX_WAV_CHUNKS):
        if pos + 8 > len(data):
            return None
        chunk, length = data[pos:pos + 4], int.from_bytes(data[pos + 4:pos + 8], "little")
        if chunk == b"data":
            raise InvalidInputError(f"{what}: its WAV header is malformed: no 'fmt ' chunk before the samples")
        if chunk == b"fmt ":
            return _check_fmt(data[pos + 8:pos + 8 + length], length, what)
        pos += 8 + length + (length & 1)
    raise InvalidInputError(f"{what}: its WAV header is malformed: more than {MAX_WAV_CHUNKS} chunks before the "
                            "samples")


def _check_fmt(fmt: bytes, length: int, what: str) -> int:
    bad = f"{what}: its WAV header is malformed:"
    if length < 16:
        raise InvalidInputError(f"{bad} a 'fmt ' chunk of {length} bytes (16 at least)")
    if len(fmt) < min(length, 40):
        raise InvalidInputError(f"{bad} the file ends inside its 'fmt ' chunk")
    tag, channels, rate = int.from_bytes(fmt[0:2], "little"), int.from_bytes(fmt[2:4], "little"), \
        int.from_bytes(fmt[4:8], "little")
    align, bits = int.from_bytes(fmt[12:14], "little"), int.from_bytes(fmt[14:16], "little")
    if channels == 0:
        raise InvalidInputError(f"{bad} 0 channels")
    if rate == 0:
        raise InvalidInputError(f"{bad} a sample rate of 0 Hz")
    if align == 0:  # the bytes of one sample frame: what ffmpeg cuts packets by (0 decodes other samples)
        raise InvalidInputError(f"{bad} a block align of 0 bytes")
    if tag == WAVE_FORMAT_EXTENSIBLE:
        extra = int.from_bytes(fmt[16:18], "little") if len(fmt) >= 18 else 0
        if length < 40 or len(fmt) < 40 or extra < 22:
            raise InvalidInputError(f"{bad} an extensible format (0xFFFE) needs a 40-byte 'fmt ' chunk with 22 "
                                    f"bytes of extension; this one has {length} with {extra}")
        valid, subformat = int.from_bytes(fmt[18:20], "little"), fmt[24:40]
        if subformat[2:] != _SUBFORMAT_TAIL:
            raise InvalidInputError(f"{bad} its extensible sub-format {subformat.hex()} is not an audio encoding "
                                    "this server decodes")
        tag = int.from_bytes(subformat[:2], "little")
        if tag == WAVE_FORMAT_EXTENSIBLE:
            raise InvalidInputError(f"{bad} an extensible sub-format cannot itself be extensible")
        if tag in WAVE_UNCOMPRESSED and valid > bits:
            raise InvalidInputError(f"{bad} {valid} valid bits in samples of {bits} bits")
    if tag in WAVE_UNCOMPRESSED:
        name, allowed = WAVE_UNCOMPRESSED[tag]
        if bits not in allowed:
            accepted = (f"{min(allowed)} to {max(allowed)}" if len(allowed) > 2
                        else " or ".join(map(str, sorted(allowed))))
            raise InvalidInputError(f"{bad} {name} samples of {bits} bits ({name} samples have {accepted} bits)")
        frame = channels * -(-bits // 8)  # a frame of uncompressed samples: each in whole bytes
        if align != frame:
            raise InvalidInputError(f"{bad} a block align of {align} bytes ({name} samples of {bits} bits in "
                                    f"{channels} channels take {frame})")
    return tag


def wav_format_name(tag: int) -> str:
    """How an error names a WAV format tag."""
    known = WAVE_UNCOMPRESSED.get(tag)
    return f"WAV format 0x{tag:04X}" + (f" ({known[0]})" if known else "")
