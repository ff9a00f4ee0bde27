"""torchrun's ranks as the package sees them: who this process is, how many there are, which device is its own.

A launcher (torchrun, alone or under Slurm) sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; without them the
process is alone (rank 0 of 1), nothing here starts a process group, and every helper is a no-op that returns
what one process would. Under torchrun each rank uses one device, its own. The device pool of ``Encoder.encode``
(one process, several GPUs) is the other way to use several GPUs; ``placement`` keeps the two apart: under
torchrun a request for several devices is an error, and a rank never lets ``encode`` pick every visible GPU.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: How long a rank waits in a collective. Workers wait while rank 0 loads data and scores (on a large
#: corpus, hours), so the default 10 (gloo) or 30 (nccl) minutes would stop a healthy run.
TIMEOUT = datetime.timedelta(hours=12)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_distributed() -> bool:
    """True under a launcher that started several processes (``WORLD_SIZE`` > 1)."""
    return world_size() > 1


def is_main() -> bool:
    """The one rank that scores, writes results and prints (rank 0; a lone process too)."""
    return rank() == 0


def configure_logging() -> None:
    """A command's log: INFO from the main process, warnings only from the other ranks (one log, not one per rank)."""
    logging.basicConfig(level=logging.INFO if is_main() else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def launch() -> str:
    """This process as an error message names it."""
    return f"rank {rank()} of a torchrun job (WORLD_SIZE={world_size()})"


def rank_device() -> str:
    """This rank's own device: ``cuda:LOCAL_RANK`` (``cuda:0`` when the launcher shows each rank one GPU), else CPU."""
    if not torch.cuda.is_available():
        return "cpu"
    count = torch.cuda.device_count()
    if count == 1:
        return "cuda:0"
    if local_rank() >= count:
        raise RuntimeError(f"LOCAL_RANK={local_rank()} but only {count} GPUs are visible: start at most {count} "
                           "processes per node (torchrun --nproc_per_node).")
    return f"cuda:{local_rank()}"


def parse_devices(spec: str | None) -> list[str]:
    """``--device`` as a list: ``"cuda:0,cuda:1"`` -> two devices; None -> none (automatic)."""
    return [] if spec is None else [d.strip() for d in spec.split(",") if d.strip()]


def placement(spec: str | None) -> tuple[str | None, str | list[str] | None]:
    """``(device to load the encoder on, device(s) for encode)`` for a ``--device`` value.

    One process: the device given (None: the encoder's default, and ``encode`` pools every visible GPU as
    before), or a comma-separated list: load on the first, ``encode`` pools them all. Under torchrun: this
    rank's own device for both; a list, or another rank's GPU, is an error naming it and the launch.
    """
    devices = parse_devices(spec)
    if not is_distributed():
        if len(devices) > 1:
            return devices[0], devices
        return (devices[0] if devices else None), None
    own = rank_device()
    if len(devices) > 1:
        raise ValueError(
            f"--device {spec} asks for the device pool (one process, several devices), but this is {launch()}: "
            f"under torchrun each rank encodes on its own device ({own} here). Drop --device, or run one process "
            "without torchrun to pool the devices."
        )
    if not devices or devices[0] == "cuda":
        return own, own
    if devices[0] not in ("cpu", own):
        raise ValueError(f"--device {spec}: under torchrun each rank uses its own device, {own} for {launch()}; "
                         "give --device cuda (or none) and let torchrun place the ranks.")
    return devices[0], devices[0]


def init(timeout: datetime.timedelta = TIMEOUT) -> bool:
    """Join torchrun's process group (once); False for a lone process, which needs none.

    gloo on CPU; on CUDA nccl for tensors and gloo for the Python objects the ranks exchange (so they
    never take GPU memory).
    """
    if not is_distributed():
        return False
    import torch.distributed as dist

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(rank_device())
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timeout)
        logger.debug("Joined the process group as %s (%s).", launch(), backend)
    return True


def shutdown() -> None:
    """Leave the process group, if this process joined one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def scatter(objects: list | None) -> Any:
    """Rank 0 hands rank ``i`` ``objects[i]``; every rank returns its own (others pass None)."""
    if not is_distributed():
        return objects[0]
    import torch.distributed as dist

    out: list = [None]
    dist.scatter_object_list(out, objects if is_main() else None, src=0)
    return out[0]


def gather(obj: Any) -> list | None:
    """Every rank's ``obj``, in rank order, on rank 0; None elsewhere."""
    if not is_distributed():
        return [obj]
    import torch.distributed as dist

    out = [None] * world_size() if is_main() else None
    dist.gather_object(obj, out, dst=0)
    return out


def barrier() -> None:
    """Wait until every rank is here (nothing to wait for alone)."""
    if is_distributed():
        import torch.distributed as dist

        dist.barrier()
