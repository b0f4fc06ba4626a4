"""Command lines: shardrec-ckpt (checkpoint inspection)."""
