"""Receive blocks of a disaggregated language server: what an encoder service delivers for one prompt, laid out
by token index over a run of fixed-size blocks.

Per token slot a block holds an embedding row (hidden size plus any extra feature columns, e.g. deepstack),
the fill id (the prompt's token id) and the 3 M-RoPE positions; per block, a few aux integers (in a request's
first block: total tokens, rope delta, items). Only media tokens carry embedding rows: text tokens' rows are
never written or sent. A request may hold several runs of blocks (a resumed transfer adds one); token t of the
request lives in run block `t // block_tokens`.

The memory is a shared file, so the engine process reads the embedding rows in place: the transport writes
them, the engine gathers them straight into its input batch. Only the front-end allocates (one `BlockPool`,
the same allocator as the KV cache); the engine process attaches read-only in spirit.
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
AUX_FIELDS = 4
AUX_TOTAL_TOKENS, AUX_MROPE_DELTA, AUX_NUM_ITEMS = 0, 1, 2
_ALIGN = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BufferLayout(msgspec.Struct, frozen=True):
    """Everything another process needs to map the same buffers."""

    path: str  # shared-memory file ("" when the buffers are private to one process)
    num_blocks: int
    block_tokens: int
    width: int  # embedding columns per row
    dtype: str

    def sizes(self) -> dict[str, int]:
        slots = self.num_blocks * self.block_tokens
        itemsize = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        return {"embeddings": slots * self.width * itemsize, "fill_ids": slots * 8, "positions": slots * 3 * 8,
                "aux": self.num_blocks * AUX_FIELDS * 8}

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
        self.embeddings = views["embeddings"].view(DTYPES[layout.dtype]).view(-1, layout.width)  # [slots, width]
        self.fill_ids = views["fill_ids"].view(torch.int64)  # [slots]
        self.positions = views["positions"].view(torch.int64).view(-1, 3)  # [slots, 3]
        self.aux = views["aux"].view(torch.int64).view(-1, AUX_FIELDS)  # [blocks, AUX_FIELDS]
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

    def rows_finite(self, block_ids: list[int], tokens: torch.Tensor) -> bool:
        """Whether the embedding rows at run token indices `tokens` hold no NaN or inf. Reads them in place, a
        run of consecutive slots at a time (aminmax propagates NaN and allocates nothing per element)."""
        if not tokens.numel():
            return True
        slots = self.slots(block_ids, tokens)
        breaks = (torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1).tolist()
        for lo, hi in zip([0, *breaks], [*breaks, slots.numel()]):
            first = int(slots[lo])
            low, high = torch.aminmax(self.embeddings[first : first + hi - lo])
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

    def blocks_for(self, num_tokens: int) -> int:
        return max(1, -(-num_tokens // self.block_tokens))

    def allocate(self, num_tokens: int) -> list[int] | None:
        """Blocks for `num_tokens` tokens, or None while the pool is too full (ValueError: it never could be)."""
        need = self.blocks_for(num_tokens)
        if need > self.num_blocks:
            raise ValueError(f"{num_tokens} tokens need {need} blocks; the pool has {self.num_blocks}")
        if need > self.pool.num_free:
            return None
        return self.pool.allocate(need)

    def free(self, block_ids: list[int]) -> None:
        self.pool.free(block_ids)

    def check_integrity(self) -> None:
        self.pool.check_integrity()

    # ---- addressing ------------------------------------------------------------------------------------------
    def slots(self, block_ids: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """Flat slot of each token index (relative to the start of the run `block_ids`)."""
        if not block_ids or any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"bad block ids for a pool of {self.num_blocks} blocks")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= len(block_ids) * self.block_tokens):
            raise ValueError(f"token indices run past the {len(block_ids) * self.block_tokens} slots of the run")
        table = torch.tensor(block_ids, dtype=torch.int64)
        return table[tokens // self.block_tokens] * self.block_tokens + tokens % self.block_tokens

    # ---- writes (transports) ---------------------------------------------------------------------------------
    def write_tokens(self, block_ids: list[int], start: int, fill_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Fill ids [n] and positions [n, 3] of run tokens start..start+n."""
        n = fill_ids.shape[0]
        if tuple(positions.shape) != (n, 3):
            raise ValueError(f"positions must be [{n}, 3], got {tuple(positions.shape)}")
        slots = self.slots(block_ids, torch.arange(start, start + n))
        self.fill_ids.index_copy_(0, slots, fill_ids.to(torch.int64))
        self.positions.index_copy_(0, slots, positions.to(torch.int64))

    def write_rows(self, block_ids: list[int], tokens: torch.Tensor, rows: torch.Tensor) -> None:
        """Embedding rows [m, width] at run token indices `tokens` [m]."""
        if rows.dim() != 2 or rows.shape != (tokens.shape[0], self.layout.width):
            raise ValueError(f"rows must be [{tokens.shape[0]}, {self.layout.width}], got {tuple(rows.shape)}")
        self.embeddings.index_copy_(0, self.slots(block_ids, tokens), rows.to(self.embeddings.dtype))

    def write_aux(self, block_ids: list[int], values: list[int]) -> None:
        if len(values) > AUX_FIELDS:
            raise ValueError(f"at most {AUX_FIELDS} aux values")
        self.aux[block_ids[0], : len(values)] = torch.tensor(values, dtype=torch.int64)

    # ---- reads -----------------------------------------------------------------------------------------------
    def read_tokens(self, block_ids: list[int], start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of fill ids [n] and positions [n, 3]."""
        slots = self.slots(block_ids, torch.arange(start, start + n))
        return self.fill_ids.index_select(0, slots), self.positions.index_select(0, slots)

    def read_rows(self, block_ids: list[int], start: int, n: int, columns: int | None = None) -> torch.Tensor:
        """Embedding rows of run tokens start..start+n (the first `columns` columns), gathered in one copy."""
        rows = self.embeddings.index_select(0, self.slots(block_ids, torch.arange(start, start + n)))
        return rows if columns is None else rows[:, :columns]

    def read_aux(self, block_ids: list[int]) -> list[int]:
        return self.aux[block_ids[0]].tolist()


def _unlink_if_ours(path: str, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the finalizer
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
