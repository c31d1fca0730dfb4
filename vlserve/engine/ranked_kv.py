"""A KV cache at several ranks of one machine, seen as one buffer of whole rows (a decode engine's, which peers
write into; a prefill engine's, which its writer thread reads from).

Each rank keeps its own key/value heads in its own shared file (`ModelShard._kv_in_shared_file`: a token's row
there holds that rank's heads of every layer). Rank 0's engine process maps every rank's file, so peers' writes
land in each rank's KV blocks with no receive blocks and no copy at admission: the transports register every
rank's file and write each rank its heads of a row (`shard_rows`; disagg.transports.base `Transport.register`).
The block ids are the same at every rank (one scheduler), and so are the grants that let a peer write them.
A prefill engine's writer thread reads each rank's heads of a finished prompt straight out of its file
(`read_slots`) while the prompt's blocks are kept for it: no gather at rank 0, nothing read on the engine's thread.

A whole row is every key/value head of every layer with a KV cache, as a prefill instance sends it
(kv_handoff.kv_to_rows); rank r's part of it is heads [first_r, first_r + count_r) of each (layer, key/value)
plane. When heads are fewer than ranks some ranks keep a copy of the same head: each copy is written, and a
row read back takes each head from the first rank that keeps it.
"""

from __future__ import annotations

import torch

from vlserve.engine.transfer_buffers import BlockRows, BufferLayout, TransferBuffers, slot_runs, unlink_name


def shard_rows(rows: torch.Tensor, parts: int, num_heads: int, first: int, count: int) -> torch.Tensor:
    """Heads [first, first + count) of each of the `parts` planes of whole rows [m, parts * num_heads * head_dim],
    as a view [m, parts, count * head_dim] of them, nothing copied (a buffer's `write_rows` copies it in as it
    is; `.reshape(m, -1)` makes rows of their own)."""
    m, width = rows.shape
    if width % (parts * num_heads) or not (0 <= first and count > 0 and first + count <= num_heads):
        raise ValueError(f"heads {first}..{first + count} of {num_heads} do not split rows of width {width} in "
                         f"{parts} planes")
    head_dim = width // (parts * num_heads)
    return rows.view(m, parts, num_heads, head_dim)[:, :, first : first + count].flatten(2)


def heads_cover(heads: list[tuple[int, int]], num_heads: int) -> bool:
    """The ranks' (first, count) heads hold every one of `num_heads` (copies allowed), none past the last."""
    covered = 0
    for first, count in sorted(heads):
        if count <= 0 or first < 0 or first > covered or first + count > num_heads:
            return False
        covered = max(covered, first + count)
    return covered == num_heads


class RankedKV(BlockRows):
    def __init__(self, shards: list[TransferBuffers], heads: list[tuple[int, int]], num_heads: int,
                 files: list | None = None):
        """`shards[r]`: rank r's KV file (rank 0's own, the others mapped here: `files` keeps them open), holding
        heads `heads[r]` = (first, count) of the model's `num_heads` key/value heads."""
        if len(shards) != len(heads) or not heads or not heads_cover(heads, num_heads):
            raise ValueError(f"the ranks' KV files hold heads {heads}, not each of {num_heads} heads")
        own = shards[0].layout
        self.head_dim = own.part_width // heads[0][1]
        for s, (first, count) in zip(shards, heads):
            lay = s.layout
            if (lay.num_blocks, lay.block_tokens, lay.parts, lay.dtype) != (own.num_blocks, own.block_tokens,
                                                                            own.parts, own.dtype) \
                    or lay.part_width != count * self.head_dim:
                raise ValueError(f"rank KV files do not make one KV cache: {lay} beside {own}")
        self.shards, self.heads, self.num_heads, self._files = shards, heads, num_heads, files or []
        self.grants = shards[0].grants  # rank 0 gives the blocks out (its scheduler): one set for every rank
        for s in shards[1:]:
            s.grants = self.grants
        # The whole rows' layout (no file of its own): what the front end and the peers size a transfer by.
        self.layout = BufferLayout("", own.num_blocks, own.block_tokens, own.parts * num_heads * self.head_dim,
                                   own.dtype, own.parts)
        # For reading whole rows back: the rank each head is taken from (its first copy).
        self._source: list[tuple[int, int, int]] = []  # (rank, first head, count) covering 0..num_heads once
        covered = 0
        for first, count, rank in sorted((f, c, r) for r, (f, c) in enumerate(heads)):
            if first + count > covered:
                start = max(first, covered)
                self._source.append((rank, start, first + count - start))
                covered = first + count

    @classmethod
    def attach(cls, own: TransferBuffers, layouts: list[BufferLayout], heads: list[tuple[int, int]],
               num_heads: int) -> "RankedKV":
        """Rank 0's view: its own file and the other ranks' (`layouts`, rank 1 on), mapped here only if each is
        the vlserve transfer file its rank announced (nothing created, no symlink followed)."""
        opened = [TransferBuffers.open_existing(lay) for lay in layouts]
        return cls([own, *(b for b, _ in opened)], heads, num_heads, [f for _, f in opened])

    # ---- what the engine and the transports ask of a receive buffer ------------------------------------------
    @property
    def element_size(self) -> int:
        return self.shards[0].element_size

    def rank_rows(self, rows: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s heads of whole rows (a view, by plane: `shard_rows`)."""
        first, count = self.heads[rank]
        return shard_rows(rows, self.layout.parts, self.num_heads, first, count)

    def write_rows(self, block_ids: list[int], index: torch.Tensor, rows: torch.Tensor) -> None:
        """Whole rows [m, width] at run row indices `index`: each rank's heads into its file."""
        for rank, shard in enumerate(self.shards):
            shard.write_rows(block_ids, index, self.rank_rows(rows, rank))

    def read_rows(self, block_ids: list[int], start: int, n: int) -> torch.Tensor:
        """Whole rows start..start+n of the run, each head from the first rank that keeps it."""
        parts, dim = self.layout.parts, self.head_dim
        out = torch.empty(n, parts, self.num_heads, dim, dtype=self.shards[0].planes.dtype)
        for rank, first, count in self._source:
            have_first, have = self.heads[rank]
            got = self.shards[rank].read_rows(block_ids, start, n).view(n, parts, have, dim)
            out[:, :, first : first + count] = got[:, :, first - have_first : first - have_first + count]
        return out.view(n, self.layout.width)

    def read_slots(self, slots: torch.Tensor, out: torch.Tensor | None = None, planes: range | None = None
                   ) -> torch.Tensor:
        """Whole rows [len(slots), width] of the KV cache at flat `slots`, straight out of every rank's file (a
        prefill engine's writer thread, off the engine's thread: no collective, no rank but this one involved),
        into `out` when given. A slice copy per run of slots and rank. `planes` (a layer's keys and values): those
        planes only, as [len(slots), len(planes), heads x head size]."""
        dim, m = self.head_dim, slots.numel()
        planes = range(self.layout.parts) if planes is None else planes
        if out is not None and len(planes) != self.layout.parts:
            raise ValueError("rows of some planes are read into memory of their own, not into `out`")
        parts = len(planes)
        width = parts * self.num_heads * dim
        rows = out if out is not None else torch.empty(m, width, dtype=self.shards[0].planes.dtype)
        heads = rows.view(m, parts, self.num_heads, dim)
        for at, first_slot, n in slot_runs(slots):
            for rank, first, count in self._source:
                have_first, have = self.heads[rank]
                plane = self.shards[rank].planes[planes.start : planes.stop, first_slot : first_slot + n]
                plane = plane.view(parts, n, have, dim)
                heads[at : at + n, :, first : first + count].copy_(
                    plane[:, :, first - have_first : first - have_first + count].transpose(0, 1))
        return rows if planes == range(self.layout.parts) else rows.view(m, parts, -1)

    def rows_finite(self, block_ids: list[int], rows: torch.Tensor) -> bool:
        return all(shard.rows_finite(block_ids, rows) for shard in self.shards)

    def unlink(self) -> None:
        """Every rank's file name goes (the ranks and whoever mapped them keep their mappings): for files no peer
        opens by name (a prefill's; a decode engine's but over shm)."""
        self.shards[0].unlink()
        for shard in self.shards[1:]:
            unlink_name(shard.layout.path)
