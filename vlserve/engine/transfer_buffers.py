"""Receive blocks of a disaggregated server: the rows a peer delivers for one prompt, laid out by row index over
a run of fixed-size blocks (`block_tokens` rows each).

A row is either a media token's embedding (hidden size plus any extra feature columns, e.g. DeepStack), sent
by an encoder: a prompt takes one row per media token, item after item, and none for text
(`ProcessedPrompt.media_row` finds an item's first row); or a prompt token's KV, sent by a prefill instance: one
row per token, row t for token t. The prompt's token ids and positions travel beside the rows (small integers)
and never take room here. A request may hold several runs of blocks (a resumed transfer adds one); row r of the
request lives in block `r // block_tokens` of its runs, in order.

The memory is a shared file, so the engine process reads the rows in place: the transport writes them, the
engine gathers them straight into its input batch (media) or its KV cache (KV). Only the front-end allocates
(one `BlockPool`, the same allocator as the KV cache); the engine process attaches read-only in spirit.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import weakref

import msgspec
import torch

from vlserve.engine.block_pool import BlockPool

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
    works across PID namespaces sharing the folder."""
    for name in os.listdir(folder):
        if not name.startswith(TRANSFER_FILE_PREFIX):
            continue
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
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


class TransferBuffers:
    def __init__(self, layout: BufferLayout, owner: bool):
        if layout.num_blocks <= 0 or layout.block_tokens <= 0 or layout.width <= 0 or layout.dtype not in DTYPES:
            raise ValueError(f"invalid buffer layout {layout}")
        self.layout = layout
        if layout.path:
            storage = torch.from_file(layout.path, shared=True, size=layout.nbytes, dtype=torch.uint8)
        else:
            storage = torch.zeros(layout.nbytes, dtype=torch.uint8)
        self.storage = storage  # [nbytes] uint8: the whole buffer, one region to register with a transfer engine
        offsets = layout.offsets()
        views = {name: storage[offsets[name] : offsets[name] + size] for name, size in layout.sizes().items()}
        self.rows = views["rows"].view(DTYPES[layout.dtype]).view(-1, layout.width)  # [slots, width]
        self.pool = BlockPool(layout.num_blocks) if owner else None
        self.lock_fd: int | None = None  # the owner's open file (shared buffers), locked while it lives
        self.restored = 0  # times the file was found resized by someone else and put back

    @classmethod
    def create(cls, num_blocks: int, block_tokens: int, width: int, dtype: torch.dtype,
               shared: bool = True) -> "TransferBuffers":
        """New buffers owned (allocated) by this process; `shared`: in a file other processes can map."""
        path = ""
        if shared:
            folder = shm_dir() or tempfile.gettempdir()
            sweep_stale_files(folder)
            fd, path = tempfile.mkstemp(prefix=f"{TRANSFER_FILE_PREFIX}{os.getpid()}-", dir=folder)
            fcntl.flock(fd, fcntl.LOCK_EX)  # held while this process lives: the file is not stale
        dtype_name = str(dtype).removeprefix("torch.")
        buffers = cls(BufferLayout(path, num_blocks, block_tokens, width, dtype_name), owner=True)
        buffers.lock_fd = fd if shared else None
        if shared:  # the name goes at the latest when this process exits normally, whatever path it takes
            buffers._at_exit = weakref.finalize(buffers, _unlink_if_ours, path, os.getpid())
        return buffers

    @classmethod
    def attach(cls, layout: BufferLayout) -> "TransferBuffers":
        return cls(layout, owner=False)

    def unlink(self) -> None:
        """Removes the file name; every process that mapped it keeps its mapping (no leak if one crashes)."""
        if getattr(self, "_at_exit", None) is not None:
            self._at_exit.detach()
        if self.layout.path:
            try:
                os.unlink(self.layout.path)
            except FileNotFoundError:
                pass
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
        if not rows.numel():
            return True
        slots = self.slots(block_ids, rows)
        breaks = (torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1).tolist()
        for lo, hi in zip([0, *breaks], [*breaks, slots.numel()]):
            first = int(slots[lo])
            low, high = torch.aminmax(self.rows[first : first + hi - lo])
            if not (torch.isfinite(low) and torch.isfinite(high)):
                return False
        return True

    # ---- allocation (the owner) ----------------------------------------------------------------------------
    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_rows: int) -> int:
        return max(1, -(-num_rows // self.block_tokens))

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
    def write_rows(self, block_ids: list[int], index: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows [m, width] at run row indices `index` [m] (the transports that copy)."""
        if rows.dim() != 2 or rows.shape != (index.shape[0], self.layout.width):
            raise ValueError(f"rows must be [{index.shape[0]}, {self.layout.width}], got {tuple(rows.shape)}")
        self.rows.index_copy_(0, self.slots(block_ids, index), rows.to(self.rows.dtype))

    def read_rows(self, block_ids: list[int], start: int, n: int, columns: int | None = None) -> torch.Tensor:
        """Rows start..start+n of the run (the first `columns` columns), gathered in one copy. KV rows are indexed
        by token; an item's media rows start at `ProcessedPrompt.media_row`."""
        rows = self.rows.index_select(0, self.slots(block_ids, torch.arange(start, start + n)))
        return rows if columns is None else rows[:, :columns]


def _unlink_if_ours(path: str, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the finalizer
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
