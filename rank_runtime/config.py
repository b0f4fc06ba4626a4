"""Process-wide runtime state: what ``init`` was given, the rank layout, and, per TensorFlow graph,
the tables and the key pipeline's state.

Tables belong to the graph they were created in: an Estimator builds a new graph for every
train / evaluate / predict call and creates its tables again inside model_fn; each graph's tables
get their own key index, filled from the checkpoint the Estimator restores.
"""
import atexit
import weakref
from dataclasses import dataclass, field

import tensorflow as tf

from . import heartbeat, process_hooks
from .logs import get_logger, warn_once
from .validation import INT32_MAX, check_bool, check_int
from .world import get_world

log = get_logger("shardrec.config")


@dataclass
class RuntimeConfig:
    max_steps: int
    train_steps: int
    eval_steps: int
    save_steps: int
    use_dynamic: bool
    use_dynamic_expansion: bool
    if_load: bool
    bind_cpu: bool
    rank: int
    size: int
    local_rank: int
    # A checkpoint was restored (or warm-started) in this process: what if_load=True waits for.
    loaded: bool = False
    graphs: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    def graph_state(self, graph=None):
        """The tables and pipeline state of `graph` (default: the current default graph)."""
        graph = graph or tf.compat.v1.get_default_graph()
        if graph not in self.graphs:
            self.graphs[graph] = GraphState()
        return self.graphs[graph]

    @property
    def tables(self):
        """Tables of the current default graph, by name."""
        return self.graph_state().tables


@dataclass
class GraphState:
    tables: dict = field(default_factory=dict)
    pipeline_started: bool = False
    # modify_graph=True lookups waiting for modify_graph_and_start_emb_cache (graph_modifier.py).
    pending_lookups: list = field(default_factory=list)
    # is_training -> the iterator initializers that graph modification made.
    initializers: dict = field(default_factory=dict)
    # The names of the lookups' row exchanges (rows and gradients), made when the pipeline starts.
    row_exchanges: list = field(default_factory=list)
    # The insert functions built in this graph (start_asc_pipeline checks their tables).
    insert_functions: list = field(default_factory=list)
    # (feature name, channel) -> send_count, registered by each lookup with static shapes: a train
    # and an eval FeatureSpec of the same name keep their own.
    send_counts: dict = field(default_factory=dict)


_config = None
_atexit_registered = []


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


def init(max_steps=-1, train_steps=-1, eval_steps=-1, save_steps=-1, use_dynamic=True,
         use_dynamic_expansion=False, if_load=False, bind_cpu=False, **kwargs):
    """Initialises shardrec in this process; call once before building the graph."""
    global _config
    if _config is not None:
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
    if kwargs:
        raise TypeError(f"init: unknown parameter(s) {sorted(kwargs)}")
    world = get_world()  # starts MPI; from here on log lines carry the rank
    _warn_unused_steps(steps)
    world.restart_channels()
    process_hooks.patch_tensorflow()
    if not _atexit_registered:
        atexit.register(terminate_config_initializer)
        _atexit_registered.append(True)
    rank, size, local_rank = world.rank, world.size, world.local_rank
    if bind_cpu:
        _bind_to_cores(local_rank, world.local_size)
    _config = RuntimeConfig(use_dynamic=use_dynamic, use_dynamic_expansion=use_dynamic_expansion,
                            if_load=if_load, bind_cpu=bind_cpu, rank=rank, size=size,
                            local_rank=local_rank, **steps)
    heartbeat.start(rank, size)
    log.info("initialised: %d rank(s), %s shapes", size, "dynamic" if use_dynamic else "static")
    return _config


def get_config():
    if _config is None:
        raise RuntimeError("shardrec is not initialised: call mx_rec.util.initialize.init(...) first")
    return _config


def is_initialized():
    return _config is not None


def terminate_config_initializer():
    """Forgets the configuration and every table, so that init() may be called again. The
    communicators, Horovod and MPI stay up for the rest of the process; datasets built before
    refuse to run until a new pipeline is started."""
    global _config
    if _config is None:
        return
    log.info("terminated")
    _config = None


def get_rank_id():
    return get_config().rank


def get_rank_size():
    return get_config().size


def get_use_dynamic_expansion():
    return get_config().use_dynamic_expansion


def get_if_load():
    """Whether this run loads a trained model (the Rec SDK's if_load): init(if_load=True) or
    set_if_load(True) said so, or the supervisor restarted the job and names the checkpoint to
    resume from (heartbeat.resume_checkpoint()). While it is True, a save before any restore is
    refused: it would write fresh tables over the model this run was meant to continue."""
    cfg = get_config()
    return cfg.if_load or heartbeat.resume_checkpoint() is not None


def set_if_load(if_load):
    get_config().if_load = check_bool("set_if_load", "if_load", if_load)


def mark_loaded():
    """A checkpoint's tables are in this process now (Saver.restore, warm start)."""
    get_config().loaded = True


def check_may_save(what):
    """Refuses a save that would write an unloaded model while this run must load one."""
    cfg = get_config()
    if get_if_load() and not cfg.loaded:
        why = ("init(if_load=True) / set_if_load(True)" if cfg.if_load else
               f"the supervisor restarted this job to resume from {heartbeat.resume_checkpoint()}")
        raise RuntimeError(f"{what}: {why} says this run continues a trained model, but nothing was restored "
                           f"before this save, which would write freshly initialised tables over it. Restore "
                           f"first (Saver.restore(sess, resume_checkpoint() or PATH), MonitoredTrainingSession's "
                           f"or the Estimator's checkpoint directory, warm_start_from), or use if_load=False for a "
                           f"fresh model. Nothing was written.")


def get_table(name, graph=None):
    tables = get_config().graph_state(graph).tables
    if name not in tables:
        known = ", ".join(sorted(tables)) or "none"
        raise KeyError(f"no table named {name!r} in this graph; tables created in it so far: {known}")
    return tables[name]
