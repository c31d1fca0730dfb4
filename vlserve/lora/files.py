"""An adapter folder's two files, each opened once and read once within a bound: what is hashed is what is parsed
and served (a file swapped between a check and a read cannot slip in). The safetensors header is parsed here
from the bytes read, with bounds, so tensors come out of those same bytes.

Opening: the folder is opened once and both files are opened inside it (never from two folders). The folders an
operator names (`--lora-modules`, the offline API) are opened as given, symlinks and all, with errors that say what
is wrong. A runtime load (`roots`: the `--lora-dir` folders) resolves the path once, refuses anything outside the
roots, then walks down from the root one folder at a time without following a symlink (vlserve.core.beneath), so a
swap after the check cannot redirect it, and opens no file through a symlink; every refusal of such a path is one
`FolderRefused`, whose message the caller replaces with a single one (a client must not learn which folders exist).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

import torch
from blake3 import blake3

from vlserve.core.beneath import DIR_FLAGS, FILE_FLAGS, open_beneath, resolve_beneath
from vlserve.core.errors import InvalidInputError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 8 << 20  # an adapter's header is KBs (a few MB for thousands of tensors); safetensors allows 100
MAX_DIMS = 8
CHUNK = 1 << 20
# LoRA weights are floating point: the safetensors dtypes taken, and their torch types
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class FolderRefused(InvalidInputError):
    """The folder cannot be read as an adapter (missing, not a folder, a file missing or not a regular file, no
    permission, outside the allowed folders): a runtime load answers one message for all of them."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offsets in the whole file
    end: int


@dataclass(frozen=True)
class AdapterFiles:
    folder: str  # the folder read (its real path for a runtime load)
    config: dict
    tensors: dict[str, TensorEntry]  # the safetensors header, checked
    digest: str  # of the config and the weights, as read
    peaks: dict[str, float]  # each tensor's largest |entry| (nan when it holds a non-finite one), as read
    data: bytearray | None = None  # the whole weights file, when asked to keep it
    root: str | None = None  # the --lora-dir folder a runtime load found it in

    def tensor(self, key: str) -> torch.Tensor:
        """A tensor of the kept bytes (a view: copy it before `data` goes)."""
        e = self.tensors[key]
        numel = (e.end - e.start) // FLOAT_DTYPES[e.dtype].itemsize
        return torch.frombuffer(self.data, dtype=FLOAT_DTYPES[e.dtype], count=numel, offset=e.start).reshape(e.shape)


def read_files(name: str, folder, max_bytes: int, keep: bool = False, roots: tuple[str, ...] | None = None,
               check: Callable[[dict, dict[str, TensorEntry]], None] | None = None) -> AdapterFiles:
    """Both files of the adapter in `folder`, checked for size and format (the tensors' meaning is
    vlserve.lora.adapter's). `keep`: also the weights file's bytes (the engine parses its tensors from them).
    `roots`: the folders a runtime load may read from, --lora-dir (None: any, as the operator named it).
    `check(config, tensors)`: runs before the tensors' bytes are read (a refusal there costs no read of them)."""
    real, root, config_fd, weights_fd = _open_both(name, str(folder), roots)
    with os.fdopen(config_fd, "rb") as config_file, os.fdopen(weights_fd, "rb") as weights_file:
        try:
            raw = config_file.read(MAX_CONFIG_BYTES + 1)  # whatever stat says (a /proc file says 0)
            if len(raw) > MAX_CONFIG_BYTES:
                raise InvalidInputError(f"LoRA adapter {name!r}: {CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
            config = parse_json(raw, f"LoRA adapter {name!r}: {CONFIG_FILE}")
            if not isinstance(config, dict):
                raise InvalidInputError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
            h = blake3(raw)
            h.update(b"\0")
            tensors, data, peaks = _read_weights(name, weights_file, max_bytes, keep, h,
                                                 None if check is None else lambda tensors: check(config, tensors))
        except OSError as e:  # opened, but the read failed (EIO, ...)
            raise InvalidInputError(f"LoRA adapter {name!r}: its files could not be read ({e.strerror or e})") \
                from None
    h.update(b"\0")
    return AdapterFiles(real, config, tensors, h.hexdigest()[:16], peaks, data, root)


def parse_json(raw: bytes, what: str):
    try:
        return json.loads(raw)
    except RecursionError:  # nesting deeper than the interpreter's stack: refused, never a crash or a 500
        raise InvalidInputError(f"{what} nests too deeply to be an adapter's") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidInputError(f"{what} is not valid JSON ({e})") from None


def _read_weights(name: str, f, max_bytes: int, keep: bool, h, check
                  ) -> tuple[dict[str, TensorEntry], bytearray | None, dict[str, float]]:
    bad = f"LoRA adapter {name!r}: {WEIGHTS_FILE} is not a readable safetensors file"
    size = os.fstat(f.fileno()).st_size
    if size > max_bytes:
        raise InvalidInputError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is {size} bytes, more than this model's "
                                f"own weights ({max_bytes}): not an adapter of it")
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 2 or n > min(size - 8, MAX_HEADER_BYTES):
        raise InvalidInputError(f"{bad} (its header length does not fit the file, or is over {MAX_HEADER_BYTES} "
                                "bytes)")
    header = f.read(n)
    if len(header) != n:
        raise InvalidInputError(f"{bad} (it changed while it was read)")
    tensors = _header(name, parse_json(header, f"LoRA adapter {name!r}: {WEIGHTS_FILE}'s header"), 8 + n, size)
    if check is not None:
        check(tensors)
    data = bytearray(size) if keep else None
    if keep:
        data[:8], data[8:8 + n] = head, header
    h.update(head)
    h.update(header)
    buf = None if keep else bytearray(CHUNK)
    peaks = {}
    # The tensors tile the data (checked): read in file order, one tensor after another, each in pieces of whole
    # entries, so each piece is hashed and measured as it passes (kept whole only when asked to).
    for key, e in sorted(tensors.items(), key=lambda kv: kv[1].start):
        dtype, peak, at = FLOAT_DTYPES[e.dtype], 0.0, e.start
        while at < e.end:
            view = memoryview(data)[at:e.end] if keep else memoryview(buf)[: min(CHUNK, e.end - at)]
            if f.readinto(view) != len(view):
                raise InvalidInputError(f"{bad} (it changed while it was read)")
            h.update(view)
            values = torch.frombuffer(view, dtype=dtype)
            if values.numel() and peak == peak:  # once nan (a non-finite entry), the rest is only hashed
                piece = values.abs().max().item()  # nan if any entry is
                if not piece <= peak:
                    peak = piece
            at += len(view)
        peaks[key] = peak
    if f.read(1):
        raise InvalidInputError(f"{bad} (it changed while it was read)")
    return tensors, data, peaks


def _header(name: str, header, data_start: int, size: int) -> dict[str, TensorEntry]:
    """The header's tensor entries, each a float tensor whose bytes lie inside the file and match its shape."""
    if not isinstance(header, dict):
        raise InvalidInputError(f"LoRA adapter {name!r}: {WEIGHTS_FILE}'s header is not a JSON object")
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        what = f"LoRA adapter {name!r}: tensor {key[:200]!r} of {WEIGHTS_FILE}"
        if not isinstance(entry, dict):
            raise InvalidInputError(f"{what} has no dtype, shape and data_offsets")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in FLOAT_DTYPES:
            raise InvalidInputError(f"{what} has dtype {str(dtype)[:20]!r}: LoRA weights are one of "
                                    f"{', '.join(FLOAT_DTYPES)}")
        if not _ints(shape) or len(shape) > MAX_DIMS or not _ints(offsets) or len(offsets) != 2:
            raise InvalidInputError(f"{what} has a bad shape or data_offsets")
        start, end = data_start + offsets[0], data_start + offsets[1]
        numel = 1
        for dim in shape:
            numel *= dim
        if not data_start <= start <= end <= size or numel * FLOAT_DTYPES[dtype].itemsize != end - start:
            raise InvalidInputError(f"{what}: its data_offsets do not fit its shape or the file")
        out[key] = TensorEntry(dtype, tuple(shape), start, end)
    at = data_start  # as safetensors: the tensors tile the data, no gap, no overlap, nothing after the last
    for start, end in sorted((e.start, e.end) for e in out.values()):
        if start != at:
            at = -1
            break
        at = end
    if at != size:
        raise InvalidInputError(f"LoRA adapter {name!r}: the tensors of {WEIGHTS_FILE} do not fill its data exactly "
                                "(a gap, an overlap or bytes after the last tensor)")
    return out


def _ints(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


# ---- opening ----------------------------------------------------------------------------------------------------
def _open_both(name: str, folder: str, roots: tuple[str, ...] | None) -> tuple[str, str | None, int, int]:
    """(the folder read, the root it lies in, its config's descriptor, its weights'): the folder opened once."""
    root = None
    if roots is not None:
        try:  # resolved once; what is opened below is never resolved again
            found = resolve_beneath(folder, tuple(os.path.realpath(r) for r in roots))
        except (OSError, ValueError) as e:  # e.g. a NUL in it
            raise FolderRefused(f"LoRA adapter {name!r}: {folder[:200]!r} cannot be resolved ({e})") from None
        if found is None:
            raise FolderRefused(f"LoRA adapter {name!r}: {folder} is outside --lora-dir")
        folder, root = found
        try:
            dir_fd = open_beneath(root, folder, DIR_FLAGS)
        except OSError as e:
            raise FolderRefused(f"LoRA adapter {name!r}: {folder} could not be entered ({e.strerror or e})") from None
    else:
        try:
            dir_fd = os.open(folder, DIR_FLAGS & ~os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError, ValueError):
            raise FolderRefused(f"LoRA adapter {name!r}: {folder} is not a folder") from None
        except OSError as e:
            raise FolderRefused(f"LoRA adapter {name!r}: {folder} could not be opened ({e.strerror or e})") from None
    try:
        config_fd = _open_file(name, CONFIG_FILE, dir_fd, nofollow=root is not None)
        try:
            return folder, root, config_fd, _open_file(name, WEIGHTS_FILE, dir_fd, nofollow=root is not None)
        except BaseException:
            os.close(config_fd)
            raise
    finally:
        os.close(dir_fd)


def _open_file(name: str, file: str, dir_fd: int, nofollow: bool = False) -> int:
    """A regular file of the folder `dir_fd` opened for reading (a symlink refused if `nofollow`)."""
    expected = (f"LoRA adapter {name!r}: expected {CONFIG_FILE} and {WEIGHTS_FILE} in the folder (PEFT's "
                "save_pretrained layout)")
    try:
        fd = os.open(file, FILE_FLAGS | (os.O_NOFOLLOW if nofollow else 0), dir_fd=dir_fd)
    except FileNotFoundError:
        raise FolderRefused(expected) from None
    except OSError as e:
        raise FolderRefused(f"LoRA adapter {name!r}: {file} could not be opened ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FolderRefused(expected)
    return fd
