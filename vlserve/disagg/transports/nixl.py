"""NIXL (NVIDIA's transfer library; UCX underneath, e.g. `UCX_TLS=tcp` without RDMA): the receiver
registers its receive buffers with a NIXL agent and sends the agent's metadata with each request; the sender
adds that agent once and writes each chunk with one WRITE transfer of many descriptors, then sends the header
alone over the control connection."""

from __future__ import annotations

import threading
import time
import uuid

import msgspec
import torch

from vlserve.disagg.messages import TransferTarget
from vlserve.disagg.transports.base import Transport, write_timeout_s
from vlserve.disagg.transports.remote_write import StagedWrites
from vlserve.engine.transfer_buffers import TransferBuffers

PUMP_PERIOD_S = 0.0005


def nixl_api():
    """NIXL's Python API module, or ImportError saying what to install."""
    try:
        import nixl_cu12._api as api
    except ImportError:
        try:
            import nixl._api as api
        except ImportError as e:
            raise ImportError(f"--transfer-backend nixl needs NIXL (pip install nixl-cu12): {e}") from None
    return api


class NixlTransport(Transport):
    name = "nixl"
    writes_planes = True  # (staged plane by plane: a rank's heads go into the staging buffer as they are)
    writes_layers = True

    def __init__(self, host: str = "127.0.0.1", secret: str | None = None):
        super().__init__(host, secret)
        self.write_timeout = write_timeout_s()  # below the receiver's quarantine of a failed transfer's blocks
        api = nixl_api()
        self.agent_name = f"vlserve-{uuid.uuid4().hex}"
        # NIXL's own progress thread spins a whole core even when idle; a sender progresses its transfer while it
        # waits for it, a receiver in `_pump`.
        self.agent = api.nixl_agent(self.agent_name, api.nixl_agent_config(enable_prog_thread=False,
                                                                           backends=["UCX"]))
        self._pumping = threading.Event()
        self._registered: list[tuple[torch.Tensor, object]] = []  # (region, its descriptors), kept alive
        self._peers: dict[str, str] = {}  # receiver agent name -> the name NIXL gave it here
        self.staged = StagedWrites(self._register, self._unregister)

    def _register(self, region: torch.Tensor) -> None:
        descs = self.agent.get_reg_descs([(region.data_ptr(), region.numel(), 0, "")], "DRAM")
        if self.agent.register_memory(descs) is None:
            raise RuntimeError("NIXL could not register memory")
        self._registered.append((region, descs))

    def _unregister(self, region: torch.Tensor) -> None:
        for entry in [e for e in self._registered if e[0] is region]:
            self.agent.deregister_memory(entry[1])
            self._registered.remove(entry)

    def target(self, buffers: TransferBuffers) -> TransferTarget:
        self._register(buffers.storage)
        if not self._pumping.is_set():
            self._pumping.set()
            threading.Thread(target=self._pump, name="vlserve-nixl-progress", daemon=True).start()
        return TransferTarget(self.name, buffers.layout, self.agent_name, buffers.storage.data_ptr(),
                              self.agent.get_agent_metadata())

    def register(self, buffers) -> TransferTarget:
        target = super().register(buffers)
        # (called once per transport: a sender keeps the metadata it first got for this agent)
        if target.shards:  # the agent's metadata names the regions registered so far: the last names every rank's
            meta = self.agent.get_agent_metadata()
            target.shards = [msgspec.structs.replace(rank, agent_metadata=meta) for rank in target.shards]
        return target

    def _pump(self) -> None:
        """Receiver side: over TCP, incoming writes land only while our UCX worker is progressed (~4 % of a core
        at this period, measured)."""
        while self._pumping.is_set():
            self.agent.get_new_notifs()
            time.sleep(PUMP_PERIOD_S)

    def write_rows(self, target: TransferTarget, block_ids: list[int], rows: torch.Tensor, first_row: int = 0,
                   first_plane: int = 0) -> int:
        with self.staged.lock:
            src, dst, lengths = self.staged.plan(block_ids, rows, target, first_row, first_plane)
            if not lengths:
                return 0
            peer = self._peers.get(target.session)
            if peer is None:
                peer = self._peers[target.session] = self.agent.add_remote_agent(target.agent_metadata)
            local = self.agent.get_xfer_descs([(s, n, 0) for s, n in zip(src, lengths)], "DRAM")
            remote = self.agent.get_xfer_descs([(d, n, 0) for d, n in zip(dst, lengths)], "DRAM")
            handle = self.agent.initialize_xfer("WRITE", local, remote, peer)
            try:
                state, deadline = self.agent.transfer(handle), time.monotonic() + self.write_timeout
                while state not in ("DONE", "ERR"):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"a NIXL write to {target.session} took over {self.write_timeout:.1f} s")
                    time.sleep(0.0001)
                    state = self.agent.check_xfer_state(handle)
                if state == "ERR":
                    raise RuntimeError(f"the NIXL write to {target.session} failed")
            finally:
                self.agent.release_xfer_handle(handle)
            return sum(lengths)

    def close(self) -> None:
        self._pumping.clear()
        for _, descs in self._registered:
            self.agent.deregister_memory(descs)
        self._registered.clear()
