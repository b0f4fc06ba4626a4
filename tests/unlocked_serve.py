"""shardrec-serve with what keeps a request inside one version taken out, for the negative test of
tests/test_live_serving.py: the versions' read-write lock does nothing, and an update that the
server writes in one session.run is written op by op, a few milliseconds apart (as a server that
wrote a delta's tables and dense variables one after another would). Everything else is the real
command."""
import sys
import time

from shardrec.launch import serve_cli
from shardrec.rank_runtime.serving.live import model_graph, versions


class _NoLock:
    def reading(self):
        return self

    def writing(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _OpByOp:
    def __init__(self, session):
        self._session = session

    def run(self, fetches, feeds=None):
        if isinstance(fetches, list) and len(fetches) > 1:
            out = []
            for fetch in fetches:
                out.append(self._session.run(fetch, feeds))
                time.sleep(0.005)
            return out
        return self._session.run(fetches, feeds)

    def __getattr__(self, name):
        return getattr(self._session, name)


versions.ReadWriteLock = _NoLock
_new_session = model_graph.ModelGraph.new_session
model_graph.ModelGraph.new_session = lambda self: _OpByOp(_new_session(self))

if __name__ == "__main__":
    sys.exit(serve_cli.main())
