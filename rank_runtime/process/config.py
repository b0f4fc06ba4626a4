"""What ``init`` was given and, per TensorFlow graph, the tables and the key pipeline's state: state
and the questions asked of it, nothing that changes the process (lifecycle.py's init() does).

Tables belong to the graph they were created in: an Estimator builds a new graph for every
train / evaluate / predict call and creates its tables again inside model_fn; each graph's tables
get their own key index, filled from the checkpoint the Estimator restores.
"""
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import tensorflow as tf

from . import heartbeat
from ..formats.sharding_plan import ShardingPlan
from ..validation import check_bool


@dataclass(frozen=True)
class IncrementalCheckpoints:
    """init(is_incremental_checkpoint=True)'s timers (the guide's "Saving and Loading Incremental
    Models"): a full checkpoint every `full_every_s` seconds (save_checkpoint_due_time), a delta
    every `delta_every_s` seconds between them (save_delta_checkpoints_secs)."""
    full_every_s: int
    delta_every_s: int


@dataclass
class RuntimeConfig:
    """What the rest of the rank reads of init(): the step counts and bind_cpu act in init() alone."""
    use_dynamic: bool
    use_dynamic_expansion: bool
    if_load: bool
    rank: int
    size: int
    incremental: Optional[IncrementalCheckpoints] = None  # None: every save is a full one
    # The step whose checkpoint the first restore of this process loads (None: the latest).
    restore_model_version: Optional[int] = None
    # A checkpoint was restored (or warm-started) in this process: what if_load=True waits for.
    loaded: bool = False
    graphs: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    # init(sharding_plan=): the plan every table takes its placement from (None: none given), or,
    # with sharding_auto, the planner places each table create_table does not place itself.
    sharding_plan: Optional[ShardingPlan] = None
    sharding_auto: bool = False
    # Lookups of tables that can share kernels are fused into groups (pipeline/table_groups.py).
    table_groups: bool = True

    def graph_state(self, graph: Optional[tf.Graph] = None) -> "GraphState":
        """The tables and pipeline state of `graph` (default: the current default graph)."""
        graph = graph or tf.compat.v1.get_default_graph()
        if graph not in self.graphs:
            self.graphs[graph] = GraphState()
        return self.graphs[graph]

    @property
    def tables(self) -> dict:
        """Tables of the current default graph, by name."""
        return self.graph_state().tables


@dataclass
class GraphState:
    """A graph's tables and key pipeline. The tables' and pipeline's own types live in rooms above
    this one (embedding/, pipeline/), which name this module: here they are Any."""
    tables: Dict[str, Any] = field(default_factory=dict)  # name -> EmbeddingTable
    pipeline_started: bool = False
    # modify_graph=True lookups waiting for modify_graph_and_start_emb_cache (graph_modifier.py).
    pending_lookups: List[Any] = field(default_factory=list)
    # is_training -> the iterator initializers that graph modification made.
    initializers: Dict[bool, tf.Operation] = field(default_factory=dict)
    # The insert functions built in this graph (start_asc_pipeline checks their tables).
    insert_functions: List[Any] = field(default_factory=list)
    # (table name, feature name) -> the training feature's ids in one batch, where the dataset's
    # shapes say (the sharding planner's ids per step; get_asc_insert_func files them).
    training_ids: Dict[Tuple[str, str], int] = field(default_factory=dict)

    def ids_per_step(self, table: str) -> int:
        """Ids of `table`'s training features in one batch (0: not known)."""
        return sum(n for (t, _), n in self.training_ids.items() if t == table)


@dataclass
class ConfigState:
    config: Optional[RuntimeConfig] = None  # the running init()'s: None before init() and after terminate


_STATE = ConfigState()


def install(cfg: RuntimeConfig) -> None:
    """init() made `cfg`: every module reads it from here on, until forget()."""
    if _STATE.config is not None:  # init() checks first, before it starts anything
        raise RuntimeError("config.install: a configuration is installed already; terminate_config_initializer() "
                           "forgets it")
    _STATE.config = cfg


def forget() -> None:
    """terminate_config_initializer(): the configuration and every graph's tables go."""
    _STATE.config = None


def get_config() -> RuntimeConfig:
    if _STATE.config is None:
        raise RuntimeError("shardrec is not initialised: call mx_rec.util.initialize.init(...) first")
    return _STATE.config


def is_initialized() -> bool:
    return _STATE.config is not None


def get_rank_id() -> int:
    return get_config().rank


def get_rank_size() -> int:
    return get_config().size


def get_use_dynamic_expansion() -> bool:
    return get_config().use_dynamic_expansion


def get_if_load() -> bool:
    """Whether this run loads a trained model (the Rec SDK's if_load): init(if_load=True) or
    set_if_load(True) said so, or the supervisor restarted the job and names the checkpoint to
    resume from (heartbeat.resume_checkpoint()). While it is True, a save before any restore is
    refused: it would write fresh tables over the model this run was meant to continue."""
    cfg = get_config()
    return cfg.if_load or heartbeat.resume_checkpoint() is not None


def set_if_load(if_load: bool) -> None:
    get_config().if_load = check_bool("set_if_load", "if_load", if_load)


def mark_loaded() -> None:
    """A checkpoint's tables are in this process now (Saver.restore, warm start)."""
    get_config().loaded = True


def check_may_save(what: str) -> None:
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


def get_table(name: str, graph: tf.Graph | None = None) -> Any:
    tables = get_config().graph_state(graph).tables
    if name not in tables:
        known = ", ".join(sorted(tables)) or "none"
        raise KeyError(f"no table named {name!r} in this graph; tables created in it so far: {known}")
    return tables[name]
