from shardrec.rank_runtime.pipeline.key_pipeline import start_asc_pipeline

__all__ = ["start_asc_pipeline"]
