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
