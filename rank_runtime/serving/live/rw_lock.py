"""A lock that many readers hold at once and one writer alone, writers first: a version's requests
read under it, an update to that version writes under it, so that no request sees part of one."""
import threading


class ReadWriteLock:
    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    def acquire_read(self) -> None:
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            if not self._readers:
                self._cond.notify_all()

    def acquire_write(self) -> None:
        with self._cond:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writing = True

    def release_write(self) -> None:
        with self._cond:
            self._writing = False
            self._cond.notify_all()

    def reading(self) -> "_Held":
        return _Held(self.acquire_read, self.release_read)

    def writing(self) -> "_Held":
        return _Held(self.acquire_write, self.release_write)


class _Held:
    def __init__(self, acquire, release):
        self._acquire, self._release = acquire, release

    def __enter__(self):
        self._acquire()

    def __exit__(self, *exc):
        self._release()
