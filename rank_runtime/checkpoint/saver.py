"""tf.compat.v1.train.Saver that carries the sparse tables (the user guide's "Interface Calls" page: its save / restore loop).

init() replaces ``tf.compat.v1.train.Saver`` (and the class the Estimator's Scaffold uses) with
this subclass (tf_patches.py). Dense variables go through TensorFlow's own checkpoint as
before; table variables and their optimizer slots are left out of it (they are capacity-sized
and rank-specific) and written instead as this rank's shard (sparse_checkpoint.py): the keys the
rank holds, in row order, with their rows of values and of every slot. The shard is written before
the dense part, whose `checkpoint` state file is TensorFlow's commit: a save that dies midway
leaves the previous checkpoint as the latest, and get_checkpoint_state (which latest_checkpoint
and MonitoredSession use) skips a checkpoint whose shards are not all committed.

Every rank calls save at the same step. When all ranks pass the same path (one checkpoint,
restorable into any number of ranks), rank 0 alone writes the dense part; with a path per rank
(the user guide's `model-{rank_id}`), each rank writes its own, and the checkpoint restores into the
same number of ranks.

A snapshot is consistent without stopping the key pipeline: keys are exported under the index's
lock together with their rows, which no step changes during a save. Keys that prefetched batches
added are saved with their initial rows and get the same rows back when those batches run again
after a restore, because a restore refills the index in row order.

A table with admission (admission/) also saves each key's count and last-seen timestamp, the keys
still counting towards admission, and the newest timestamp seen: a restore, into any number of
ranks, continues admission and eviction as if the job had not stopped. Warm start brings them
along too. A checkpoint without them (saved before admission was on) restores its keys as
admitted, with count 0 and last-seen timestamp 0, which the log says.

Tables created after the Saver are not part of it (as with dense variables); tables created with
is_save=False are never saved.

With init(is_incremental_checkpoint=True) a save is a full checkpoint or a delta: the rows that
changed since the previous save, the keys removed since, and the whole dense part (save_schedule.py
says which, and when). The delta is committed exactly as a full save, and listed like one: restoring
it restores its chain (checkpoint_chain.py). max_to_keep keeps a chain whole: the oldest saves go
only with every delta that builds on them, so more than max_to_keep may stay listed until the next
full save. One Saver saves a table's deltas: a second Saver of the same tables would take the first
one's changes.
"""
import json
import os
import shutil
import time
import zlib
from typing import Any, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management
from tensorflow.python.ops import variables as variables_lib
from tensorflow.python.training import saver as saver_lib
from tensorflow.python.training import training_util

from ..process import config, metrics
from ..admission.steps import follow_global_step, step_of_save
from .checkpoint_state import rank_state_filename, restorable, tf_get_checkpoint_state
from ..process.logs import get_logger
from .rank_agreement import AGREE_TIMEOUT_S, RankResult, agree, attempt
from .save_schedule import Chain, asked_save_due, old_links, plan_save, save_clock
from .stream_restore import restore_stream
from ..stream.partitioned import training_stream
from ..formats.sparse_checkpoint import (CheckpointError, discard_staged, find_shards, publish, read_manifest,
                                         sparse_dir, write_shard)
from ..formats.manifest import FULL, SaveRef
from .table_restore import restore_tables
from .table_save import table_writer
from ..formats.channel import Channel
from ..process.world import get_world

log = get_logger("shardrec.saver")

_TFSaver = saver_lib.Saver


class _NoDenseVariables(saver_lib.BaseSaverBuilder.SaveableObject):
    """The dense part of a model of tables alone (matrix factorization trained with SGD: no dense
    layer, no global step, no optimizer state). TensorFlow's Saver builds nothing for an empty
    var_list (no saver_def, no files), while a shardrec checkpoint is its dense prefix's files plus
    the shards; this saves one constant in their place, so that the dense part exists, max_to_keep
    and the state file work, and every reader of checkpoints finds it as for any other model.
    Restoring it changes nothing."""
    NAME = "shardrec_no_dense_variables"

    def __init__(self):
        tensor = tf.constant(b"this model has no dense variable; its tables are in the sparse-* directory",
                             name=self.NAME)
        super().__init__(tensor, [saver_lib.BaseSaverBuilder.SaveSpec(tensor, "", self.NAME)], self.NAME)

    def restore(self, restored_tensors: Any, restored_shapes: Any) -> tf.Operation:
        return tf.no_op(name=f"{self.NAME}_restore")


def _without_tables(var_list, excluded):
    if var_list is None:
        var_list = variables_lib._all_saveable_objects()  # what TensorFlow's Saver saves by default
    if isinstance(var_list, dict):
        return {k: v for k, v in var_list.items() if id(v) not in excluded}
    return [v for v in var_list if id(v) not in excluded]


class Saver(_TFSaver):
    def __init__(self, var_list=None, *args, **kwargs):
        self._tables = []
        self._sparse_saved = []  # (dense prefix, FULL or DELTA, whether this rank removes its files), oldest first
        self._counter_writer = None
        self._chain = None  # what the next delta builds on (save_schedule.Chain); None: the next save is full
        self._kinds = {}  # dense prefix -> FULL or DELTA, of the checkpoints this Saver lists
        self.next_save_step = None  # the global step of the next incremental save (save_schedule.py)
        if config.is_initialized():
            cfg = config.get_config()
            state = cfg.graph_state()
            tables = list(state.tables.values())
            if tables:
                excluded = {id(v) for t in tables for v in [t.variable, *t.slots.values()]}
                var_list = _without_tables(var_list, excluded) or [_NoDenseVariables()]
                self._tables = [t for t in tables if t.is_save]
                for table in self._tables:
                    table.init_ops()
                    table.index.track_changes(cfg.incremental is not None)
                if cfg.incremental is not None:
                    save_clock()
        if kwargs.get("defer_build") and self._tables:
            # TensorFlow refuses a var_list with a deferred build; it reads _var_list at build().
            super().__init__(None, *args, **kwargs)
            self._var_list = var_list
        else:
            super().__init__(var_list, *args, **kwargs)

    def save(self, sess, save_path, global_step=None, latest_filename=None, meta_graph_suffix="meta",
             write_meta_graph=True, write_state=True, strip_default_attrs=False, save_debug_info=False,
             is_incremental_checkpoint=None, save_delta=None):
        """TensorFlow's Saver.save, with the tables. save_delta (the Rec SDK's parameter), with
        init(is_incremental_checkpoint=True): True saves a delta (a full checkpoint when there is none
        to build on), False a full checkpoint, None (default) as init's timers say.
        is_incremental_checkpoint (the Rec SDK's too): init's setting decides; True without it is
        refused."""
        def dense_save(latest, write_state=write_state):
            return super(Saver, self).save(sess, save_path, global_step=global_step, latest_filename=latest,
                                           meta_graph_suffix=meta_graph_suffix, write_meta_graph=write_meta_graph,
                                           write_state=write_state, strip_default_attrs=strip_default_attrs,
                                           save_debug_info=save_debug_info)

        if not self._tables:
            return dense_save(latest_filename)
        config.check_may_save(f"Saver.save({save_path!r})")
        cfg = config.get_config()
        if (save_delta or is_incremental_checkpoint) and cfg.incremental is None:
            given = "save_delta=True" if save_delta else "is_incremental_checkpoint=True"
            raise ValueError(f"Saver.save({given}) needs init(is_incremental_checkpoint=True, "
                             "save_checkpoint_due_time=..., save_delta_checkpoints_secs=...)")
        step = None
        path = save_path
        if global_step is not None:
            step = int(global_step if isinstance(global_step, (int, np.integer))
                       else training_util.global_step(sess, global_step))
            path = "%s-%d" % (save_path, step)
        shared = self._shared_path(path)
        if not shared and latest_filename is None:
            # Ranks that save under paths of their own keep state files of their own too, so that
            # each rank's latest_checkpoint names its own latest (get_checkpoint_state reads it).
            latest_filename = rank_state_filename(cfg.rank)
        self._recover_earlier(os.path.dirname(os.path.abspath(save_path)), latest_filename)
        # 1. Every rank commits its shard, and every rank learns whether all did. 2. The dense part
        # is written (by rank 0 alone when all ranks share the path), and again every rank learns
        # whether it was. 3. Only then is the checkpoint listed in the state file. A save that dies
        # or fails on any rank is therefore never the latest checkpoint, on any rank.
        plan = None
        if cfg.incremental is not None:
            emptied = any(t.index.cleared_since_full_save() for t in self._tables)
            plan = plan_save(cfg.incremental, self._chain, step or 0, save_delta, emptied)
            # Until this save is committed on every rank, the next one is full: a failure below
            # leaves nothing that a delta could build on.
            chain, self._chain = self._chain, None
        shard = attempt(lambda: self._save_tables(sess, path, step, shared, plan))
        if shard.value is not None:
            metrics.saved(step or 0, plan.kind.kind if plan else FULL, shard.value)
        # One rank per directory puts a save in place, and writes its dense part: rank 0 when every
        # rank saves under the same path.
        writes_dense = not shared or cfg.rank == 0
        try:
            agree(f"Saver.save({path!r})", shard, "nothing was committed; the previous checkpoint stays the latest")
        except CheckpointError:
            if writes_dense:
                discard_staged(path)
            raise
        dense = attempt(lambda: (publish(path, cfg.size), dense_save(None, write_state=False))[1]) if writes_dense \
            else RankResult(path, None)
        agree(f"Saver.save({path!r}): writing the dense part", dense,
               "the checkpoint is not listed; the previous one stays the latest")
        kind = plan.kind.kind if plan else FULL
        self._kinds[dense.value] = kind
        if writes_dense and write_state:
            self._list_checkpoint(dense.value, latest_filename, meta_graph_suffix)
        self._forget_old(dense.value, kind, writes_dense)
        if plan is not None:
            self._chain = self._chain_after(plan, chain, dense.value, step or 0)
            save_clock().saved(step or 0)
        if shared:
            # Also the barrier after rank 0 listed the checkpoint: every rank returns once it is
            # listed, so that what follows (an evaluation of the latest checkpoint, say) sees it.
            self._publish_counters(os.path.dirname(os.path.abspath(save_path)), step)
        return dense.value

    def _chain_after(self, plan, chain, path, step):
        """What the next delta builds on once this save is committed; the next save's step."""
        now = time.monotonic()
        this = SaveRef(os.path.basename(path), step, plan.kind.save_id)
        self.next_save_step = plan.next_step
        if plan.delta:
            return Chain(chain.base, this, chain.full_time, step, now)
        return Chain(this, this, now, step, now)

    def maybe_save(self, sess: tf.compat.v1.Session, save_path: str, global_step: Any) -> Optional[str]:
        """For a plain Session loop of an incremental job: call after every step, on every rank. Saves
        (a full checkpoint or a delta, as init's timers say) at the steps the ranks agreed on, and
        returns the checkpoint's path; else returns None."""
        step = int(global_step if isinstance(global_step, (int, np.integer))
                   else training_util.global_step(sess, global_step))
        if config.get_config().incremental is None:
            raise ValueError("Saver.maybe_save needs init(is_incremental_checkpoint=True, save_checkpoint_due_time=..., "
                             "save_delta_checkpoints_secs=...); without them call save() when you want a checkpoint")
        if self.next_save_step is not None and step < self.next_save_step and \
                not asked_save_due(step, self._chain.step if self._chain else None):
            return None
        return self.save(sess, save_path, global_step=step)

    def _publish_counters(self, directory, step):
        """Rank 0 writes every table's counters, summed over the ranks, as TensorBoard scalars
        (`shardrec/<table>/<counter>`) under <dir>/shardrec_counters, at the checkpoint's step."""
        cfg = config.get_config()
        mine = {t.table_name: t.counters().as_dict() for t in self._tables}
        if cfg.size > 1:
            texts = get_world().gather_texts(json.dumps(mine), "Saver.save: table counters", AGREE_TIMEOUT_S)
            if cfg.rank != 0:
                return
            parts = [json.loads(text) for text in texts]
        else:
            parts = [mine]
        values = [tf.compat.v1.Summary.Value(tag=f"shardrec/{table}/{name}",
                                             simple_value=float(sum(part[table][name] for part in parts)))
                  for table in sorted(mine) for name in sorted(mine[table])]
        try:
            if self._counter_writer is None:
                self._counter_writer = tf.compat.v1.summary.FileWriter(os.path.join(directory, "shardrec_counters"))
            self._counter_writer.add_summary(tf.compat.v1.Summary(value=values), step or 0)
            self._counter_writer.flush()
        except (OSError, tf.errors.OpError) as e:
            # The checkpoint is committed and listed; the scalars are a view of it, not part of it.
            log.warning("checkpoint saved, but its table counters could not be written to TensorBoard: %s", e)

    def _list_checkpoint(self, path, latest_filename, meta_graph_suffix):
        """What TensorFlow's Saver.save does with write_state=True, once every rank has committed."""
        self._RecordLastCheckpoint(path)
        checkpoint_management.update_checkpoint_state_internal(
            save_dir=os.path.dirname(path), model_checkpoint_path=path, all_model_checkpoint_paths=self.last_checkpoints,
            latest_filename=latest_filename, save_relative_paths=self._save_relative_paths)
        self._MaybeDeleteOldCheckpoints(meta_graph_suffix=meta_graph_suffix)

    def _recover_earlier(self, directory, latest_filename):
        """Lists the complete checkpoints of earlier processes in the state file again, as the
        Estimator does, instead of replacing them by this process's first save."""
        if self.last_checkpoints or getattr(self, "_recovered", False):
            return
        self._recovered = True
        state = tf_get_checkpoint_state(directory, latest_filename)
        if state is None:
            return
        cfg = config.get_config()
        earlier = [p for p in state.all_model_checkpoint_paths if restorable(p, cfg)]
        self.recover_last_checkpoints(earlier)
        for p in earlier:
            self._kinds[p], shared = _kind_and_layout(p)
            # Whatever world size wrote it, its files go with it when max_to_keep lets it go.
            self._sparse_saved.append((p, self._kinds[p], not shared or cfg.rank == 0))

    def _MaybeDeleteOldCheckpoints(self, meta_graph_suffix="meta"):
        """TensorFlow's, which lets the oldest checkpoint go once more than max_to_keep are listed,
        keeping chains whole (old_links)."""
        kinds = [self._kinds.get(p, FULL) for p, _ in self._last_checkpoints]
        for _ in range(old_links(kinds, self.saver_def.max_to_keep)):
            self._kinds.pop(self._last_checkpoints[0][0], None)
            super()._MaybeDeleteOldCheckpoints(meta_graph_suffix)

    def restore(self, sess: tf.compat.v1.Session, save_path: Optional[str]) -> None:
        if self._tables and save_path is not None:
            restore_tables(sess, [(save_path, self._tables)], f"Saver.restore({save_path!r})", check_dense=True)
        super().restore(sess, save_path)
        stream = training_stream()
        if stream is not None and save_path is not None:
            restore_stream(stream, save_path)
        if self._tables and save_path is not None:
            follow_global_step(sess, self._tables)
            config.mark_loaded()
            # The tables are the checkpoint's now: nothing changed since, and the next save is a full
            # one (a delta on this process's earlier saves would not match what was restored).
            for table in self._tables:
                table.index.clear_changes()
            self._chain = None
            self.next_save_step = None

    def _save_tables(self, sess, path, step, shared, plan):
        """Writes and commits this rank's shard; returns its directory."""
        cfg = config.get_config()
        _check_step_trained(sess, step, path)
        back_to = step_of_save(step)
        mode = "plain" if plan is None else plan.kind.kind
        tables = {table.table_name: table_writer(table, back_to, mode) for table in self._tables}
        stream, trained_from = None, training_stream()
        if trained_from is not None:
            if step is None:
                raise ValueError(f"Saver.save({path!r}): a job that trains from a stream saves with global_step, "
                                 "which says which batches the checkpoint holds (the stream's positions)")
            assert trained_from.cursor is not None  # set before the stream registers
            stream = trained_from.cursor.positions_at(step)
        shard = write_shard(path, cfg.rank, cfg.size, step, tables, shared, plan.kind if plan else None, stream)
        log.info("saved this rank's shard of %d table(s) for %s (staged; in place once every rank has saved)%s",
                 len(tables), sparse_dir(path),
                 f" (a delta on {plan.kind.previous.name})" if plan is not None and plan.delta else "")
        return shard

    @staticmethod
    def _shared_path(path):
        """Whether every rank saves under `path` (one checkpoint, reshardable) or each under its
        own. Every rank must save at the same step: each one holds a part of every table."""
        if config.get_config().size == 1:
            return True
        mine = zlib.crc32(os.path.abspath(path).encode())
        return len(set(get_world().gather_from_ranks(mine, f"Saver.save({path!r})", timeout=AGREE_TIMEOUT_S))) == 1

    def _forget_old(self, path, kind, mine):
        """Keeps the sparse parts of the last max_to_keep saves, as TensorFlow does for dense files,
        and the saves those build on (old_links). The rank that put a save in place removes it."""
        self._sparse_saved = [e for e in self._sparse_saved if e[0] != path] + [(path, kind, mine)]
        for _ in range(old_links([k for _, k, _ in self._sparse_saved], self.saver_def.max_to_keep)):
            old, _, mine = self._sparse_saved.pop(0)
            if mine:
                shutil.rmtree(sparse_dir(old), ignore_errors=True)
                discard_staged(old)


def _check_step_trained(sess, step, path) -> None:
    """A save whose contents follow the training step (a stream's positions, admission's counts
    taken back to it) is of the step the graph has trained to: a number that disagrees would save
    the positions and counts of other batches than the ones trained, so it is refused before
    anything is written. A graph without a global step has only the number given."""
    if step is None or not get_world().exchanges[Channel.TRAIN].step_follows_training:
        return
    variable = tf.compat.v1.train.get_global_step(sess.graph)
    if variable is None:
        return
    trained = int(sess.run(variable))
    if trained != step:
        raise ValueError(f"Saver.save({path!r}): global_step={step}, but the graph's global step is {trained}: this "
                         f"rank trained {trained} steps, and the checkpoint's stream positions and admission counts "
                         f"are those of the steps trained; nothing was saved. Pass global_step=<the global step "
                         f"tensor> (or its value, {trained})")


def _kind_and_layout(path: str) -> tuple:
    """(FULL or DELTA, whether every rank saved under `path`), as its shards' manifests say (a full
    save under a shared path when they cannot be read: a damaged save is never built on, and may go)."""
    try:
        shards, _ = find_shards(sparse_dir(path))
        manifest = read_manifest(next(iter(shards.values())))
    except CheckpointError:
        return FULL, True
    return manifest.kind, manifest.shared
