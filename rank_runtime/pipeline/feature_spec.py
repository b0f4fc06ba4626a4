"""FeatureSpec: which element of the dataset holds the ids of one lookup, and of which table, with
the table's admission and eviction thresholds; or (is_timestamp=True) which element holds the
batch's timestamps, which eviction measures ages in."""
from ..process.logs import warn_once
from ..validation import INT32_MAX, check_bool, check_int, check_type

_OWNER = "FeatureSpec"


class FeatureSpec:
    def __init__(self, name, table_name=None, index_key=None, access_threshold=None, eviction_threshold=None,
                 is_timestamp=None, batch_size=None, faae_coefficient=1):
        check_type(_OWNER, "name", name, str, "a non-empty string")
        if not name:
            raise ValueError(f"{_OWNER}: parameter 'name' must be a non-empty string")
        self.name = name
        self.is_timestamp = bool(check_bool(_OWNER, "is_timestamp", is_timestamp)) if is_timestamp is not None else False
        if table_name is not None:
            check_type(_OWNER, "table_name", table_name, str, "a table name")
        elif not self.is_timestamp:
            raise ValueError(f"{_OWNER} {name!r}: parameter 'table_name' is required (the table this feature is looked up in)")
        self.table_name = table_name
        if index_key is not None:
            check_type(_OWNER, "index_key", index_key, (str, int), "the dataset key holding the ids")
        # The dataset element key that holds the ids; defaults to the feature's name.
        self.index_key = index_key if index_key is not None else name
        self.access_threshold = None if access_threshold is None else check_int(
            _OWNER, "access_threshold", access_threshold, -1, INT32_MAX)
        self.eviction_threshold = None if eviction_threshold is None else check_int(
            _OWNER, "eviction_threshold", eviction_threshold, -1, INT32_MAX)
        self.batch_size = None if batch_size is None else check_int(_OWNER, "batch_size", batch_size, 1, INT32_MAX)
        self.faae_coefficient = check_int(_OWNER, "faae_coefficient", faae_coefficient, 1, INT32_MAX)
        if self.is_timestamp:
            given = {k: v for k, v in (("table_name", table_name), ("access_threshold", access_threshold),
                                       ("eviction_threshold", eviction_threshold)) if v is not None}
            if given:
                raise ValueError(f"{_OWNER} {name!r}: is_timestamp=True declares the batch's timestamps (int64 "
                                 f"seconds, one per sample), which belong to no table; it cannot also take "
                                 f"{', '.join(sorted(given))}: put those on the features whose keys they govern")
        if self.eviction and not self.admission:
            raise ValueError(f"{_OWNER} {name!r}: eviction_threshold = {eviction_threshold} needs admission: "
                             "set access_threshold >= 0 as well")
        if self.batch_size is not None:
            warn_once(f"{_OWNER}(batch_size={self.batch_size}) has no effect in shardrec: the batch size is the dataset's "
                      "(each batch may differ with dynamic shapes)", "shardrec.feature_spec")
        if self.faae_coefficient != 1:
            warn_once(f"{_OWNER}(faae_coefficient={self.faae_coefficient}) has no effect in shardrec: every "
                      "occurrence of a key counts once towards access_threshold", "shardrec.feature_spec")

    @property
    def admission(self) -> bool:
        """Keys get a row only once they have occurred access_threshold times (>= 0; -1 or None: off)."""
        return self.access_threshold is not None and self.access_threshold >= 0

    @property
    def eviction(self) -> bool:
        return self.eviction_threshold is not None and self.eviction_threshold >= 0

    def __repr__(self):
        return f"FeatureSpec({self.name!r}, table_name={self.table_name!r}, index_key={self.index_key!r})"
