"""Receive blocks of a disaggregated server: the rows a peer delivers for one prompt, laid out by row index over
a run of fixed-size blocks (`block_tokens` rows each).

A row is either a media token's embedding (hidden size plus any extra feature columns, e.g. DeepStack), sent
by an encoder: a prompt takes one row per media token, item after item, and none for text
(`ProcessedPrompt.media_row` finds an item's first row); or a prompt token's KV, sent by a prefill instance: one
row per token, row t for token t. The prompt's token ids and positions travel beside the rows (small integers)
and never take room here. A request may hold several runs of blocks (a resumed transfer adds one); row r of the
request lives in block `r // block_tokens` of its runs, in order.

The memory is a shared file, so the engine process reads the rows in place: the transport writes them, the
engine gathers them straight into its input batch (media) or its KV cache (KV). One process allocates (one
`BlockPool`, the same allocator as the KV cache): the front end (media rows), or a decode engine, whose row socket
then checks peers' writes against its reservations (`grants`).

A row may be stored in `parts` pieces, each piece in its own plane of slots ([parts, slots, width / parts]): a
decode engine's KV cache is such a buffer (a token's row is its key and value of every layer; each layer's keys
and values stay one contiguous [slots, heads, head_dim] array for attention), so a peer writes KV rows straight
into the engine's KV blocks with the same transports and block runs as any other rows.
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import stat
import tempfile
import time
import weakref

import msgspec
import torch

from vlserve.core.errors import ConfigurationError
from vlserve.core.private_dirs import HALF_MADE_AGE_S
from vlserve.engine.block_pool import BlockPool
from vlserve.engine.write_grants import WriteGrants

logger = logging.getLogger("vlserve.disagg")
_ALIGN = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BufferLayout(msgspec.Struct, frozen=True):
    """Everything another process needs to map the same buffers."""

    path: str  # shared-memory file ("" when the buffers are private to one process)
    num_blocks: int
    block_tokens: int  # rows per block
    width: int  # columns per row
    dtype: str
    parts: int = 1  # planes a row is stored in (a KV cache: layers x key/value), each [slots, width / parts]

    @property
    def part_width(self) -> int:
        return self.width // self.parts

    def sizes(self) -> dict[str, int]:
        itemsize = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        return {"rows": self.num_blocks * self.block_tokens * self.width * itemsize}

    @property
    def nbytes(self) -> int:
        return sum(-(-n // _ALIGN) * _ALIGN for n in self.sizes().values())

    def offsets(self) -> dict[str, int]:
        """Byte offset of each array in the buffer (a transport that writes remote memory addresses by it)."""
        out, offset = {}, 0
        for name, size in self.sizes().items():
            out[name] = offset
            offset += -(-size // _ALIGN) * _ALIGN
        return out


TRANSFER_FILE_PREFIX = "vlserve-transfer-"


def shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def sweep_stale_files(folder: str) -> None:
    """Removes buffer files nobody owns any more (a file keeps its name while same-host encoders map it, so a
    crash can leave one behind). The owner holds an exclusive lock on its file for as long as it lives, which
    works across PID namespaces sharing the folder. A hidden file (not named yet) is made before its owner can lock
    it, so it is left alone until it is old enough that its owner must have died between the two."""
    now = time.time()
    for name in os.listdir(folder):
        if not name.removeprefix(".").startswith(TRANSFER_FILE_PREFIX):
            continue
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if name.startswith(".") and now - os.fstat(fd).st_mtime < HALF_MADE_AGE_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # locked: its owner is alive
        else:
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass
        finally:
            os.close(fd)


class BlockRows:
    """What any buffer of blocks of rows says of itself from its layout (receive buffers, a KV cache kept by
    several ranks, or a layout another process maps)."""

    layout: BufferLayout

    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def blocks_for(self, num_rows: int) -> int:
        return max(1, -(-num_rows // self.block_tokens))


class TransferBuffers(BlockRows):
    def __init__(self, layout: BufferLayout, owner: bool):
        if layout.num_blocks <= 0 or layout.block_tokens <= 0 or layout.width <= 0 or layout.dtype not in DTYPES \
                or layout.parts <= 0 or layout.width % layout.parts:
            raise ValueError(f"invalid buffer layout {layout}")
        self.layout = layout
        if layout.path:
            storage = torch.from_file(layout.path, shared=True, size=layout.nbytes, dtype=torch.uint8)
        else:
            storage = torch.zeros(layout.nbytes, dtype=torch.uint8)
        self.storage = storage  # [nbytes] uint8: the whole buffer, one region to register with a transfer engine
        offsets = layout.offsets()
        views = {name: storage[offsets[name] : offsets[name] + size] for name, size in layout.sizes().items()}
        # [parts, slots, part width]: a row's pieces, one per plane
        self.planes = views["rows"].view(DTYPES[layout.dtype]).view(layout.parts, -1, layout.part_width)
        self.pool = BlockPool(layout.num_blocks) if owner else None
        # The owner's: which blocks a peer's write may land in (engine.write_grants); None where another process
        # allocates (nothing but the layout is checked then).
        self.grants = WriteGrants() if owner else None
        self.lock_fd: int | None = None  # the owner's open file (shared buffers), locked while it lives
        self.restored = 0  # times the file was found resized by someone else and put back

    @classmethod
    def create(cls, num_blocks: int, block_tokens: int, width: int, dtype: torch.dtype,
               shared: bool = True, parts: int = 1, reserve: bool = False) -> "TransferBuffers":
        """New buffers owned (allocated) by this process; `shared`: in a file other processes can map; `reserve`:
        its memory taken now (a KV cache), so a shared-memory folder too small for it is a clear error at start
        rather than a SIGBUS when a page past what it can hold is first touched."""
        path = ""
        dtype_name = str(dtype).removeprefix("torch.")
        layout = BufferLayout("", num_blocks, block_tokens, width, dtype_name, parts)
        if shared:
            folder = shm_dir() or tempfile.gettempdir()
            sweep_stale_files(folder)
            # Made under a hidden name, locked (held while this process lives: the file is not stale), then given
            # its name: another process's sweep (a tensor-parallel rank starting beside this one) never finds it
            # unlocked.
            fd, hidden = tempfile.mkstemp(prefix=f".{TRANSFER_FILE_PREFIX}{os.getpid()}-", dir=folder)
            fcntl.flock(fd, fcntl.LOCK_EX)
            path = os.path.join(folder, os.path.basename(hidden)[1:])
            os.rename(hidden, path)  # named before the (maybe large) reservation: if this process dies in it, the
            if reserve:  # next sweep frees the file at once (a hidden one would wait out HALF_MADE_AGE_S)
                _reserve(fd, path, layout.nbytes)
        buffers = cls(msgspec.structs.replace(layout, path=path), owner=True)
        buffers.lock_fd = fd if shared else None
        if shared:  # the name goes at the latest when this process exits normally, whatever path it takes
            buffers._at_exit = weakref.finalize(buffers, _unlink_if_ours, path, os.getpid())
        return buffers

    @classmethod
    def attach(cls, layout: BufferLayout) -> "TransferBuffers":
        return cls(layout, owner=False)

    @classmethod
    def open_existing(cls, layout: BufferLayout) -> tuple["TransferBuffers", io.FileIO]:
        """Another process's shared buffers, mapped only if they are a vlserve transfer file of this user of exactly
        the layout's size in the shared-memory folder: no symlink followed, nothing created, every check on the
        very file mapped (kept open: its size can be checked again before a write). ValueError otherwise."""
        folder = os.path.realpath(shm_dir() or tempfile.gettempdir())
        name = os.path.basename(layout.path)
        if os.path.realpath(os.path.dirname(layout.path)) != folder or not name.startswith(TRANSFER_FILE_PREFIX):
            raise ValueError(f"refusing to map {layout.path!r}: not a vlserve transfer file in {folder}")
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise ValueError(f"the buffers {layout.path!r} are not on this host: the shm backend needs the sender "
                             "and the receiver on one machine") from None
        except OSError as e:
            raise ValueError(f"refusing to map {layout.path!r}: {e}") from None
        file = io.FileIO(fd, "r+", closefd=True)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise ValueError(f"refusing to map {layout.path!r}: not a regular file of this user")
            if info.st_size != layout.nbytes:
                raise ValueError(f"the buffer file {layout.path!r} has {info.st_size} bytes, its layout says "
                                 f"{layout.nbytes}")
            buffers = cls(msgspec.structs.replace(layout, path=f"/proc/self/fd/{fd}"), owner=False)
        except BaseException:
            file.close()
            raise
        buffers.layout = layout
        return buffers, file

    def unlink(self) -> None:
        """Removes the file name; every process that mapped it keeps its mapping (no leak if one crashes)."""
        if getattr(self, "_at_exit", None) is not None:
            self._at_exit.detach()
        if self.layout.path:
            unlink_name(self.layout.path)
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # the name is gone: no sweep can find the file any more
            self.lock_fd = None

    def restore_file(self) -> bool:
        """Owner: puts the shared file back to its size if something else truncated (or grew) it, so that no
        process mapping it touches memory past its end (SIGBUS) and encoders that map it by name accept it again.
        What the lost pages held is gone (they come back as zeros): True tells the caller so."""
        if self.lock_fd is None:
            return False
        size = os.fstat(self.lock_fd).st_size
        if size == self.layout.nbytes:
            return False
        logger.error("the receive buffer file %s has %d bytes instead of %d (something else resized it); "
                     "restoring its size: transfers under way fail and are retried", self.layout.path, size,
                     self.layout.nbytes)
        os.ftruncate(self.lock_fd, self.layout.nbytes)
        self.restored += 1
        return True

    def rows_finite(self, block_ids: list[int], rows: torch.Tensor) -> bool:
        """Whether the rows at run row indices `rows` hold no NaN or inf. Reads them in place, a run of
        consecutive slots at a time (aminmax propagates NaN and allocates nothing per element)."""
        return all(all_finite(self.planes[:, first : first + n])
                   for _, first, n in slot_runs(self.slots(block_ids, rows)))

    # ---- allocation (the owner) ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def allocate(self, num_rows: int) -> list[int] | None:
        """Blocks for `num_rows` rows, or None while the pool is too full (ValueError: it never could be)."""
        need = self.blocks_for(num_rows)
        if need > self.num_blocks:
            raise ValueError(f"{num_rows} rows need {need} blocks; the pool has {self.num_blocks}")
        if need > self.pool.num_free:
            return None
        return self.pool.allocate(need)

    def free(self, block_ids: list[int]) -> None:
        self.pool.free(block_ids)

    def check_integrity(self) -> None:
        self.pool.check_integrity()

    # ---- addressing ------------------------------------------------------------------------------------------
    def slots(self, block_ids: list[int], rows: torch.Tensor) -> torch.Tensor:
        """Flat slot of each row index (relative to the start of the run `block_ids`)."""
        if not block_ids or any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"bad block ids for a pool of {self.num_blocks} blocks")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= len(block_ids) * self.block_tokens):
            raise ValueError(f"row indices run past the {len(block_ids) * self.block_tokens} slots of the run")
        table = torch.tensor(block_ids, dtype=torch.int64)
        return table[rows // self.block_tokens] * self.block_tokens + rows % self.block_tokens

    # ---- rows ------------------------------------------------------------------------------------------------
    def write_rows(self, block_ids: list[int], index: torch.Tensor, rows: torch.Tensor, first_plane: int = 0) -> None:
        """Rows [m, width], or by plane [m, planes, part width] (a view of other rows: copied as it is) into planes
        first_plane.. (a layer's keys and values), at run row indices `index` [m] (the transports that copy)."""
        lay, m = self.layout, index.shape[0]
        whole = tuple(rows.shape) == (m, lay.width) and first_plane == 0
        by_plane = rows.dim() == 3 and rows.shape[0] == m and rows.shape[2] == lay.part_width \
            and rows.shape[1] > 0 and 0 <= first_plane and first_plane + rows.shape[1] <= lay.parts
        if not (whole or by_plane):
            raise ValueError(f"rows must be [{m}, {lay.width}] or [{m}, planes, {lay.part_width}] within "
                             f"{lay.parts} planes, got {tuple(rows.shape)} from plane {first_plane}")
        planes = lay.parts if whole else rows.shape[1]
        pieces = rows.to(self.planes.dtype).reshape(m, planes, -1).transpose(0, 1)
        into = self.planes[first_plane : first_plane + planes]
        # A slice copy per run of consecutive slots: near a plain memory copy, where one index_copy over the
        # planes' stride is ~3x slower (measured on 57 MB of bf16 KV rows)
        for at, first, n in slot_runs(self.slots(block_ids, index)):
            into[:, first : first + n].copy_(pieces[:, at : at + n])

    def read_rows(self, block_ids: list[int], start: int, n: int, columns: int | None = None) -> torch.Tensor:
        """Rows start..start+n of the run (the first `columns` columns), gathered in one copy. KV rows are indexed
        by token; an item's media rows start at `ProcessedPrompt.media_row`."""
        pieces = self.planes.index_select(1, self.slots(block_ids, torch.arange(start, start + n)))
        rows = pieces.transpose(0, 1).reshape(n, self.layout.width)
        return rows if columns is None else rows[:, :columns]

    @property
    def element_size(self) -> int:
        return self.planes.element_size()


def all_finite(values: torch.Tensor) -> bool:
    """No NaN or inf in `values`: one pass (aminmax propagates NaN), nothing allocated per element."""
    if not values.numel():
        return True
    low, high = torch.aminmax(values)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(index in `slots`, first slot, length) of each run of consecutive slots."""
    if not slots.numel():
        return []
    breaks = (torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    return [(lo, int(slots[lo]), hi - lo) for lo, hi in zip(starts, [*breaks, slots.numel()])]


def _reserve(fd: int, path: str, nbytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        folder = os.path.dirname(path)
        free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
        raise ConfigurationError(
            f"{nbytes / 2**30:.2f} GiB of shared buffers do not fit {folder} ({free / 2**30:.2f} GiB free: {e}); "
            "give it more room (a container's --shm-size) or use fewer KV blocks (--num-kv-blocks, "
            "--kv-cache-memory-gb)") from None


def unlink_name(path: str) -> None:
    """The file's name goes (the processes that mapped it keep their mappings); gone already is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_if_ours(path: str, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the finalizer
        unlink_name(path)
