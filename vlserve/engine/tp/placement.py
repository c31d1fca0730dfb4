"""Where each tensor-parallel rank runs: its rank numbers, how the ranks meet, and which CPU cores it owns.

Two ways to get ranks:
- **One machine (default).** The engine core is rank 0 and starts the other ranks as child processes; they meet
  through a file store in rank 0's private folder (`file://FOLDER/store`: no other user can enter it). Their
  collectives' connections (gloo's, NCCL's bootstrap) listen on the loopback interface only: by itself gloo
  listens where the host name resolves, maybe an address other machines reach, and nothing there checks a peer.
- **Several machines: torchrun's conventions.** Every process is started by `torchrun` (or anything that sets
  `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) and they meet through
  `env://`. The process with `RANK=0` serves; the others only run their share of the model.

On CPU every rank of a machine gets its own slice of the cores (pinned) and its share of the CPU budget as torch
threads (core/cpu_budget.py: a cgroup quota smaller than the cores counts), so the ranks never compete for a core.
`--cpu-threads` (split between the ranks), else an explicit `OMP_NUM_THREADS` (per rank), sets the thread count.
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlserve.core.config import under_torchrun
from vlserve.core.cpu_budget import plan_threads
from vlserve.core.errors import InvalidInputError
from vlserve.engine.transfer_buffers import shm_dir
from vlserve.model.layers import shm_collectives
from vlserve.model.layers.parallel import TPGroup
from vlserve.model.layers.shm_collectives import ShmCollectives

logger = logging.getLogger("vlserve.tp")
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # where gloo and NCCL listen
IFF_LOOPBACK = 0x8
_given_back: dict[str, str | None] = {}  # what INTERFACE_VARS were before the group set them, for leave_group


@dataclass(frozen=True)
class Placement:
    rank: int
    size: int
    local_rank: int  # among the ranks of this machine
    local_size: int
    init_method: str  # "env://" under torchrun, else file://FOLDER/store

    @property
    def from_env(self) -> bool:
        return self.init_method == "env://"


def torchrun_placement(size: int) -> Placement | None:
    """This process's place when torchrun (or the same variables) started it; None when not."""
    if not under_torchrun():
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise InvalidInputError(f"tensor_parallel_size is {size} but WORLD_SIZE is {world}: start one process per "
                                "rank")
    rank = int(os.environ["RANK"])
    return Placement(rank, world, int(os.environ.get("LOCAL_RANK", rank)),
                     int(os.environ.get("LOCAL_WORLD_SIZE", world)), "env://")


def local_placement(size: int, folder: str) -> Placement:
    """Ranks started by rank 0 meet in its private `folder` (a port on loopback would be open to every user)."""
    return Placement(0, size, 0, size, f"file://{folder}/store")


def device_for(device: torch.device, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def join_group(place: Placement, device: torch.device, timeout_s: float, shm_path: str | None = None) -> TPGroup:
    """Joins the process group (gloo on CPU, NCCL on CUDA); blocks until every rank has joined. `shm_path`: the
    shared file of the same-machine collectives (see shm_collectives), used for CPU tensors when given."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if place.local_size == place.size:  # every rank is here: loopback, whatever the environment says
        loopback = loopback_interface()
        for name in INTERFACE_VARS:  # read when the group connects (NCCL's: at its first collective)
            if os.environ.get(name, loopback) != loopback:
                logger.info("every rank runs here: %s=%s is replaced by %s", name, os.environ[name], loopback)
            _given_back.setdefault(name, os.environ.get(name))
            os.environ[name] = loopback
    dist.init_process_group(backend, init_method=place.init_method, rank=place.rank, world_size=place.size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    local = ShmCollectives(shm_path, place.rank, place.size, timeout_s) if shm_path else None
    return TPGroup(place.rank, place.size, local=local)


def collectives_file(place: Placement, device: torch.device) -> str | None:
    """A new shared file for the same-machine collectives, or None where they do not apply (CUDA, ranks on
    several machines, not x86-64, VLSERVE_TP_SHM=0)."""
    if (device.type != "cpu" or place.local_size != place.size or not shm_collectives.supported()
            or place.size > shm_collectives.MAX_RANKS or os.environ.get("VLSERVE_TP_SHM", "1") == "0"):
        return None
    size = shm_collectives.file_size(place.size)
    folder = shm_dir()
    if folder is None or _free_bytes(folder) < 2 * size:
        logger.warning("no room for %d MiB in /dev/shm: the ranks' collectives go through gloo (slower)",
                       size // 2**20)
        return None
    fd, path = tempfile.mkstemp(prefix=f"vlserve-tp-{os.getpid()}-", dir=folder)  # named by its engine's process
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return path


def _free_bytes(folder: str) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def loopback_interface() -> str:
    """The name of this machine's loopback interface (the one flagged IFF_LOOPBACK; "lo" if none says so)."""
    try:
        for name in sorted(os.listdir("/sys/class/net")):
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read(), 16) & IFF_LOOPBACK:
                    return name
    except (OSError, ValueError):
        pass
    return "lo"


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    for name, value in _given_back.items():  # the process's own setting again (an in-process rank 0, e.g. `LLM`)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _given_back.clear()


def pin_cores(local_rank: int, local_size: int, cpu_threads: int | None = None) -> Callable[[], None]:
    """Pins this process to its slice of the machine's cores and sets torch's threads to its share of the CPU
    budget (of `cpu_threads` when given); returns the undo (an in-process rank 0, e.g. the offline `LLM`, gives
    the cores back when it shuts down)."""
    if not hasattr(os, "sched_getaffinity"):
        return lambda: None
    plan = plan_threads(cpu_threads, local_size)  # before pinning: the budget of the whole affinity mask
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    cores = sorted(before)
    per_rank = len(cores) // local_size
    if per_rank == 0:
        logger.warning("%d ranks share %d cores: not pinned", local_size, len(cores))
        return lambda: None
    mine = cores[local_rank * per_rank : (local_rank + 1) * per_rank]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(plan.torch_threads)  # <= len(mine) unless --cpu-threads or OMP_NUM_THREADS asks more
    logger.info("tensor-parallel rank (local %d of %d): cores %s, %d threads", local_rank, local_size, mine,
                torch.get_num_threads())

    def undo() -> None:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)

    return undo
