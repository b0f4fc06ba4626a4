"""init() and terminate_config_initializer(): the start and end of shardrec in a process, above
config.py (which holds the state they set) and the modules that init() sets up: the world (MPI,
Horovod, the exchanges), TensorFlow's patches, the heartbeat.
"""
import atexit
import gc
import os
from dataclasses import dataclass
from typing import Optional, Union

from . import batch_events, config, exit_hooks, heartbeat, metrics, resize, tf_patches
from ..formats import heartbeat_format
from ..formats.sharding_plan import AUTO, PlanError, ShardingPlan
from .logs import get_logger, warn_once
from ..validation import INT32_MAX, check_bool, check_int
from .world import get_world

log = get_logger("shardrec.config")


@dataclass
class LifecycleState:
    terminate_registered: bool = False  # terminate_config_initializer() runs at exit (registered once)


_STATE = LifecycleState()


def _warn_unused_steps(steps):
    """The Rec SDK sizes its own data loop with these; shardrec follows the dataset and the
    training loop, so they only say what the script intends."""
    given = {k: v for k, v in steps.items() if v != -1}
    if given:
        warn_once(f"init({', '.join(f'{k}={v}' for k, v in given.items())}): step counts have no effect in shardrec: "
                  "the key pipeline follows the dataset, and the training loop (or the Estimator's steps) decides "
                  "how many steps run", "shardrec.config")


def _bind_to_cores(local_rank, local_size):
    """Pins this rank to its share of the cores so ranks on one host do not fight over them."""
    import psutil

    proc = psutil.Process()
    cores = sorted(proc.cpu_affinity())
    share = max(1, len(cores) // max(1, local_size))
    mine = cores[(local_rank * share) % len(cores):][:share] or cores
    proc.cpu_affinity(mine)
    log.info("bound to cores %s", mine)


# Parameters of earlier Rec SDK versions, or of its Ascend devices, that have no counterpart here:
# accepted (a script written for them runs) and said once in the log.
_NO_COUNTERPART = {
    "use_lccl": "Ascend's LCCL collectives; shardrec uses MPI and Horovod",
    "use_hot": "hot-embedding caching on the device; every row here is in host memory",
    "use_shm_swap": "deprecated by the Rec SDK itself (its USE_SHM_SWAP environment variable)",
    "prefetch_batch_number": "the key pipeline prefetches what the dataset's prefetch() says",
    "use_mpi": "shardrec always runs on MPI",
}


def _incremental(is_incremental_checkpoint, save_checkpoint_due_time, save_delta_checkpoints_secs):
    """init's incremental checkpoint settings, checked as the guide states them."""
    check_bool("init", "is_incremental_checkpoint", is_incremental_checkpoint)
    timers = {"save_checkpoint_due_time": save_checkpoint_due_time,
              "save_delta_checkpoints_secs": save_delta_checkpoints_secs}
    for name, value in timers.items():
        if value is not None:
            check_int("init", name, value, 1, INT32_MAX)
    if not is_incremental_checkpoint:
        given = [name for name, value in timers.items() if value is not None]
        if given:
            warn_once(f"init({', '.join(given)}) has no effect without is_incremental_checkpoint=True: every save is "
                      "a full checkpoint", "shardrec.config")
        return None
    missing = [name for name, value in timers.items() if value is None]
    if missing:
        raise ValueError(f"init(is_incremental_checkpoint=True) needs {' and '.join(missing)} (seconds between full "
                         "checkpoints, and between the delta checkpoints in between; each in [1, 2147483647])")
    if save_delta_checkpoints_secs >= save_checkpoint_due_time:
        warn_once(f"init: save_delta_checkpoints_secs={save_delta_checkpoints_secs} >= save_checkpoint_due_time="
                  f"{save_checkpoint_due_time}: no delta fits between two full checkpoints", "shardrec.config")
    return config.IncrementalCheckpoints(full_every_s=save_checkpoint_due_time,
                                         delta_every_s=save_delta_checkpoints_secs)


def init(max_steps: int = -1, train_steps: int = -1, eval_steps: int = -1, save_steps: int = -1,
         use_dynamic: bool = True, use_dynamic_expansion: bool = False, if_load: bool = False, bind_cpu: bool = False,
         is_incremental_checkpoint: bool = False, save_checkpoint_due_time: Optional[int] = None,
         save_delta_checkpoints_secs: Optional[int] = None, restore_model_version: Optional[int] = None,
         recent_key_count_threshold: int = 0, sharding_plan: Union[None, str, os.PathLike, ShardingPlan] = None,
         table_groups: Optional[bool] = None, **kwargs) -> config.RuntimeConfig:
    """Initialises shardrec in this process; call once before building the graph. Every parameter
    of the Rec SDK's init is accepted (docs/reference/init.md); those without a counterpart here are said in
    the log."""
    if config.is_initialized():
        raise RuntimeError("init: shardrec is already initialised; call terminate_config_initializer() "
                           "before calling init() again")
    steps = {}
    for name, value in (("max_steps", max_steps), ("train_steps", train_steps),
                        ("eval_steps", eval_steps), ("save_steps", save_steps)):
        steps[name] = check_int("init", name, value, -1, INT32_MAX)
    if all(v == 0 for v in steps.values()):
        raise ValueError("init: max_steps, train_steps, eval_steps and save_steps are all 0; "
                         "at least one must be -1 (unbounded) or positive")
    for name, value in (("use_dynamic", use_dynamic), ("use_dynamic_expansion", use_dynamic_expansion),
                        ("if_load", if_load), ("bind_cpu", bind_cpu)):
        check_bool("init", name, value)
    incremental = _incremental(is_incremental_checkpoint, save_checkpoint_due_time, save_delta_checkpoints_secs)
    if restore_model_version is not None:
        check_int("init", "restore_model_version", restore_model_version, 0, INT32_MAX)
    check_int("init", "recent_key_count_threshold", recent_key_count_threshold, 0, INT32_MAX)
    groups = _table_groups(table_groups)
    unknown = sorted(set(kwargs) - set(_NO_COUNTERPART))
    if unknown:
        raise TypeError(f"init: unknown parameter(s) {unknown}; init takes {sorted(_INIT_PARAMETERS)}")
    if kwargs.get("use_mpi") is False:
        raise ValueError("init(use_mpi=False): shardrec always runs on MPI (launch it with mpirun or shardrec-run); "
                         "leave use_mpi out")
    for name in ("use_lccl", "use_hot", "use_shm_swap"):
        if name in kwargs:
            check_bool("init", name, kwargs[name])
    if "prefetch_batch_number" in kwargs:
        check_int("init", "prefetch_batch_number", kwargs["prefetch_batch_number"], 1, INT32_MAX)
    world = get_world()  # starts MPI; from here on log lines carry the rank
    plan, auto = _sharding_plan(sharding_plan, world.size)
    _warn_unused_steps(steps)
    for name in sorted(kwargs):
        warn_once(f"init({name}={kwargs[name]!r}) has no effect in shardrec: {_NO_COUNTERPART[name]}", "shardrec.config")
    if recent_key_count_threshold:
        warn_once(f"init(recent_key_count_threshold={recent_key_count_threshold}): shardrec's delta checkpoints hold "
                  "every row that changed, whatever its count, so that a restore is exact; the filter is not applied",
                  "shardrec.config")
    world.restart_channels()
    # TensorFlow's modules are about a million objects that live as long as the process; out of the
    # cyclic collector's way, its full collections while the graph is built skip them (0.3 s of CPU
    # a rank on a short job, examples/wide_deep.py --steps 60 on 2 ranks).
    gc.freeze()
    tf_patches.patch_tensorflow()
    if not _STATE.terminate_registered:
        atexit.register(terminate_config_initializer)
        exit_hooks.install_exit_watch()
        _STATE.terminate_registered = True
    rank, size = world.rank, world.size
    if bind_cpu:
        _bind_to_cores(world.local_rank, world.local_size)
    cfg = config.RuntimeConfig(use_dynamic=use_dynamic, use_dynamic_expansion=use_dynamic_expansion, if_load=if_load,
                               rank=rank, size=size, incremental=incremental,
                               restore_model_version=restore_model_version, sharding_plan=plan, sharding_auto=auto,
                               table_groups=groups)
    config.install(cfg)
    if os.environ.get(heartbeat_format.RUN_DIR_ENV):
        resize.install()  # before the first beat: the supervisor signals only ranks that beat
    batch_events.forget_all()  # an earlier init()'s observers, if terminate_config_initializer() was not called
    resize.observe_stops()
    heartbeat.start(rank, size)
    metrics.start_from_environment()
    log.info("initialised: %d rank(s), %s shapes%s", size, "dynamic" if use_dynamic else "static",
             f", a full checkpoint every {incremental.full_every_s} s and a delta every {incremental.delta_every_s} s"
             if incremental else "")
    return cfg


_INIT_PARAMETERS = ("max_steps", "train_steps", "eval_steps", "save_steps", "use_dynamic", "use_dynamic_expansion",
                    "if_load", "bind_cpu", "is_incremental_checkpoint", "save_checkpoint_due_time",
                    "save_delta_checkpoints_secs", "restore_model_version", "recent_key_count_threshold",
                    "sharding_plan", "table_groups", *_NO_COUNTERPART)

TABLE_GROUPS_ENV = "SHARDREC_TABLE_GROUPS"


def _table_groups(given: Optional[bool]) -> bool:
    """Whether lookups are fused into table groups: init(table_groups=) or, when it is left out,
    SHARDREC_TABLE_GROUPS (on by default), so that a run can be compared without editing the script."""
    if given is not None:
        return check_bool("init", "table_groups", given)
    value = os.environ.get(TABLE_GROUPS_ENV, "on").strip().lower()
    if value not in ("on", "off", "1", "0"):
        raise ValueError(f"init: {TABLE_GROUPS_ENV}={value!r}; allowed: on, off, 1, 0 (or leave it unset: on)")
    return value in ("on", "1")


def _sharding_plan(given, world_size: int) -> "tuple[Optional[ShardingPlan], bool]":
    """(the plan, whether the planner places the tables no plan or sharding= places): None (every
    table row-wise unless create_table says otherwise), "auto", a plan file's path, or a ShardingPlan."""
    if given is None:
        return None, False
    if isinstance(given, str) and given == AUTO:
        return None, True
    if isinstance(given, (str, os.PathLike)):
        return ShardingPlan.load(os.fspath(given), world_size), False
    if isinstance(given, ShardingPlan):
        if given.world_size != world_size:
            raise PlanError(f"init: sharding_plan was made for {given.world_size} rank(s), this job has {world_size}; "
                            "plan again for this world size (plan_sharding(..., world_size=...)), or use 'auto'")
        return given, False
    raise TypeError(f"init: parameter 'sharding_plan' is {given!r}; allowed: None (row-wise unless create_table's "
                    f"sharding= says), {AUTO!r} (the planner), the path of a JSON plan, or a ShardingPlan")


def terminate_config_initializer() -> None:
    """Forgets the configuration and every table, so that init() may be called again. The
    communicators, Horovod and MPI stay up for the rest of the process; datasets built before
    refuse to run until a new pipeline is started."""
    if not config.is_initialized():
        return
    log.info("terminated")
    batch_events.forget_all()  # among them the stream trained from and the incremental save clock
    config.forget()
