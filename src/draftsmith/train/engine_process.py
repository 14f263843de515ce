"""The vLLM engine process of online training, as the trainer sees it: where it runs (the GPUs or CPU cores it gets,
disjoint from the trainer's: `TrainerCores` keeps the trainer off the engine's cores until the run closes), the spool
both sides open, and `EngineProcess`, the process rank 0's supervisor (train/engine_supervisor.py) starts (`python -m
draftsmith.extract.vllm.feed SPOOL`, restarted when it dies without a new chunk, up to ENGINE_RESTARTS times). With
--remote-engines an operator starts it on another node (`draftsmith feed`) and none of this runs but
`open_trainer_side`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch

from draftsmith.config import TrainConfig
from draftsmith.core import processes
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.spool_address import DirectoryAddress, LocalMooncake, parse_spool
from draftsmith.core.vllm_launch import THREADS_BIND_VAR, cpu_thread_binding
from draftsmith.extract.spool import Spool, TrainerSide, mooncake
from draftsmith.extract.spool.mooncake import MooncakeMaster
from draftsmith.train import distributed

ENGINE_MODULE = "draftsmith.extract.vllm.feed"
ENGINE_RESTARTS = 3


def engine_cpus(cfg: TrainConfig) -> list[int] | None:
    """On a CPU, the cores the engines run on: those --engine-devices names, by default the first half of the cores
    this process may use (None on one core: they share it); this process (the trainer) keeps the others. Sharing
    every core oversubscribes them: on 2 cores the split trains 1.26x faster (docs/benchmarks.md)."""
    allowed = sorted(os.sched_getaffinity(0))
    if not cfg.engine_devices:
        return allowed[: len(allowed) // 2] or None
    engines = sorted(set(cfg.engine_devices))
    outside = [c for c in engines if c not in allowed]
    rest = [c for c in allowed if c not in engines]
    if outside or not rest:
        raise DraftsmithError(
            f"--engine-devices {','.join(map(str, engines))}: on a CPU these are cores, and "
            f"{f'core(s) {outside} are not among' if outside else 'they take every one of'} the "
            f"cores this process may use ({','.join(map(str, allowed))}); leave the trainer at "
            "least one"
        )
    return engines


def engine_devices(cfg: TrainConfig, info: distributed.DistInfo) -> list[int] | None:
    """The GPUs the engines run on (None on a CPU), disjoint from the trainer's."""
    if info.device.type != "cuda":
        return None
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [int(x) for x in env.split(",") if x.strip()] if env else list(range(torch.cuda.device_count()))
    trainer = visible[: distributed.local_world_size()]
    engines = list(cfg.engine_devices) if cfg.engine_devices else [d for d in visible if d not in trainer]
    need = cfg.engine_tensor_parallel_size * cfg.engine_data_parallel_size
    if set(engines) & set(trainer):
        raise DraftsmithError(
            f"--engine-devices {','.join(map(str, engines))}: GPU(s) "
            f"{sorted(set(engines) & set(trainer))} also train; give the engines other GPUs"
        )
    if len(engines) < need:
        raise DraftsmithError(
            f"--engine vllm: the engines need {need} GPU(s) (tensor x data parallel size), "
            f"{len(engines)} left besides the trainer's {trainer}; pass --engine-devices or train "
            "on fewer GPUs"
        )
    return engines[:need]


def open_trainer_side(cfg: TrainConfig, bound: int, master_log: Path) -> tuple[TrainerSide, MooncakeMaster | None]:
    """The spool --spool names (and the Mooncake master draftsmith started for it, or None), connected."""
    where = parse_spool(cfg.spool if cfg.spool is not None else Path(cfg.output) / "spool")
    if isinstance(where, DirectoryAddress):
        return Spool(where.path, bound), None
    master = None
    if isinstance(where, LocalMooncake):
        if cfg.remote_engines:
            raise DraftsmithError(
                "--spool mooncake --remote-engines: engines on other nodes need a master they can "
                "reach; start mooncake_master there and give --spool mooncake://HOST:PORT"
            )
        master = mooncake.MooncakeMaster(master_log)
        address = master.start()
    else:
        address = where
    try:
        return mooncake.MooncakeSpool(address, bound).connect(), master
    except DraftsmithError:
        if master is not None:
            master.stop()
        raise


class TrainerCores:
    """On a CPU, the trainer's share of the cores while its engine process runs on `engine` (engine_cpus): `take`
    moves this process and torch's threads onto the other cores, `restore` gives back the cores and thread count it
    had."""

    def __init__(self, engine: list[int]):
        self.engine = engine
        self._had: tuple[list[int], int] | None = None  # the cores and torch threads before `take`

    def take(self) -> None:
        cores = sorted(os.sched_getaffinity(0))
        self._had = cores, torch.get_num_threads()
        rest = sorted(set(cores) - set(self.engine))
        os.sched_setaffinity(0, rest)
        torch.set_num_threads(len(rest))

    def restore(self) -> None:
        if self._had is None:
            return
        (cores, threads), self._had = self._had, None
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


class EngineProcess:
    """The engine process rank 0 starts on this node (on the CPU, the cores the trainer does not keep); restarted when
    it dies without a new chunk, up to ENGINE_RESTARTS times."""

    def __init__(
        self, cfg: TrainConfig, where: str, log: Path, scratch: Path, cpus: list[int] | None, devices: list[int] | None
    ):
        self.cfg, self.where, self.log, self.scratch, self.cpus, self.devices = cfg, where, log, scratch, cpus, devices
        self.proc: processes.ChildProcess | None = None
        self.restarts = self.total_restarts = 0

    def start(self) -> None:
        env = dict(os.environ)
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.devices))
        if self.cpus and THREADS_BIND_VAR not in os.environ:  # vLLM binds its threads there
            world = self.cfg.engine_tensor_parallel_size * self.cfg.engine_data_parallel_size
            env[THREADS_BIND_VAR] = cpu_thread_binding(world, self.cpus)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", ENGINE_MODULE, self.where, "--scratch", str(self.scratch)]
        argv += ["--stall-s", str(self.cfg.stall_timeout_s), "--log", str(self.log)]
        # SIGTERM: it kills vLLM's processes and says so in the spool's status; after 10 s, SIGKILL to its group
        self.proc = processes.ChildProcess(argv, log=self.log, env=env, append=True, graces_s=(10.0,))

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def log_tail(self, lines: int = 3) -> str:
        return " | ".join(line.strip() for line in processes.log_lines(self.log)[-lines:])

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        self.proc = None
