"""shardrec-serve's figures in Prometheus's text format (prometheus_client), on its /metrics."""
import prometheus_client as prom

_LATENCY_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


class ServerMetrics:
    def __init__(self):
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.requests = prom.Counter("shardrec_serve_requests", "Requests answered, by API (rest, grpc), endpoint "
                                     "and status (HTTP's, or gRPC's code)", ["api", "endpoint", "code"], registry=r)
        self.latency = prom.Histogram("shardrec_serve_request_seconds", "Time to answer a predict request", ["api"],
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.batch = prom.Histogram("shardrec_serve_batch_requests", "Requests run together in one session.run "
                                    "(server-side batching)", buckets=_BATCH_BUCKETS, registry=r)
        self.version = prom.Gauge("shardrec_serve_model_version", "The version served (its checkpoint's step)",
                                  registry=r)
        self.updates = prom.Counter("shardrec_serve_updates", "Checkpoints applied, by how (delta in place, or "
                                    "a full load)", ["how"], registry=r)
        self.update_seconds = prom.Histogram("shardrec_serve_update_seconds", "From reading a checkpoint to "
                                             "serving it", ["how"], buckets=_LATENCY_BUCKETS, registry=r)
        self.commit_to_served = prom.Histogram("shardrec_serve_commit_to_served_seconds", "From a checkpoint's "
                                               "commit (its dense part written) to serving it",
                                               buckets=_LATENCY_BUCKETS, registry=r)
        self.refused = prom.Counter("shardrec_serve_refused_checkpoints", "Checkpoints not applied (damaged, "
                                    "incomplete, a broken chain, another model's)", registry=r)
        self.polls = prom.Counter("shardrec_serve_model_dir_polls", "Looks at the model directory for "
                                  "checkpoints newer than the version served", registry=r)
        self.served_age = prom.Gauge("shardrec_serve_version_committed_timestamp_seconds", "When the version "
                                     "served was committed by the training job", registry=r)

    def text(self) -> bytes:
        return prom.generate_latest(self.registry)
