"""Everything that runs inside one rank: init, tables, lookups, the key pipeline, sparse optimizers.

Names are loaded on first use: importing this package (or mx_rec) starts no MPI, imports no
TensorFlow by itself and patches nothing of TensorFlow; init() does what must be done process-wide.
The one exception is exit_hooks.py's: from the import on, a rank that fails while MPI runs (even
before init()) ends the whole job instead of leaving its peers waiting.
"""
import importlib

from .process import exit_hooks

exit_hooks.install()

_EXPORTS = {
    "EmbeddingTable": ".embedding.table", "create_table": ".embedding.table",
    "Estimator": ".estimator.estimator",
    "FeatureSpec": ".pipeline.feature_spec",
    "GraphModifierHook": ".estimator.hooks",
    "Saver": ".checkpoint.saver",
    "DirectoryStream": ".stream.directory", "ParquetDataset": ".input.parquet",
    "ParquetDirectoryStream": ".input.parquet_stream",
    "RedisStream": ".stream.redis_streams", "pack_records": ".stream.tfrecord_files",
    "get_asc_insert_func": ".pipeline.key_pipeline", "start_asc_pipeline": ".pipeline.key_pipeline",
    "sparse_lookup": ".pipeline.lookup",
    "get_dense_and_sparse_variable": ".embedding.variables",
    "export_saved_model": ".serving.export",
    "get_rank_id": ".process.config", "get_rank_size": ".process.config", "get_use_dynamic_expansion": ".process.config", "init": ".process.lifecycle",
    "get_if_load": ".process.config", "set_if_load": ".process.config",
    "terminate_config_initializer": ".process.lifecycle",
    "report": ".process.heartbeat", "resume_checkpoint": ".process.heartbeat",
    "start_metrics_server": ".process.metrics",
    "plan_sharding": ".embedding.planner", "TableShape": ".embedding.planner", "CostModel": ".embedding.planner",
    "ShardingPlan": ".formats.sharding_plan",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
