"""Numbered version directories for TF Serving and Triton (`BASE/1`, `BASE/2`, ...): the newest
checkpoint of a training job exported as `BASE/<its step>` once it is newer than every version
there, written beside and moved into place whole (a server's poller never sees half of one: TF
Serving and Triton take only directory names that are numbers), and the oldest ones beyond `keep`
removed. Each version is a full export: its cost is the table's size, at every interval
(bench/README.md); shardrec-serve applies a delta's rows instead."""
import os
import re
import shutil
from typing import Any, Callable, Optional

from ..process.logs import get_logger
from .export import resolve_checkpoint

log = get_logger("shardrec.serving")
_NUMBER = re.compile(r"\d+")
_STEP = re.compile(r"-(\d+)$")


def numbered(base: str) -> list:
    """The version numbers under `base`, oldest first."""
    if not os.path.isdir(base):
        return []
    return sorted(int(n) for n in os.listdir(base) if _NUMBER.fullmatch(n) and os.path.isdir(os.path.join(base, n)))


def export_new_version(model_dir: str, base: str, export: Callable[[str], Any], keep: int) -> Optional[str]:
    """Exports `model_dir`'s newest checkpoint as BASE/<step> with export(checkpoint, directory) when
    no version there is as new; then keeps the newest `keep` versions. Returns the new directory."""
    if keep < 1:
        raise ValueError(f"keep={keep}: versions kept must be at least 1")
    checkpoint = resolve_checkpoint(model_dir)
    m = _STEP.search(checkpoint)
    if m is None:
        raise ValueError(f"{checkpoint}: a checkpoint without a step in its name (model.ckpt-<step>) has no version "
                         "number; save with global_step")
    step, have = int(m.group(1)), numbered(base)
    made = None
    if not have or step > have[-1]:
        made = os.path.join(base, str(step))
        export(checkpoint, made)
        have.append(step)
        log.info("version %d of %s written (%s)", step, base, checkpoint)
    for old in have[:-keep]:
        shutil.rmtree(os.path.join(base, str(old)), ignore_errors=True)
        log.info("version %d of %s removed (--keep %d)", old, base, keep)
    return made
