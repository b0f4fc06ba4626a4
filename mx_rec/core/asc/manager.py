from shardrec.rank_runtime.key_pipeline import start_asc_pipeline

__all__ = ["start_asc_pipeline"]
