"""The one bounded wait of the tests: for an event, never for a length of time."""
import time


def wait_for(done, proc, seconds, what):
    """Polls done() every 0.1 s until it holds; fails at once if `proc` (the process that makes the
    event happen; None: none to watch) ended, with its output, and after `seconds`, naming `what`."""
    deadline = time.monotonic() + seconds
    while not done():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"{what}: the process ended (status {proc.returncode}) first:\n"
                                 f"{(err or out or '')[-4000:]}")
        assert time.monotonic() < deadline, f"{what} did not happen in {seconds} s"
        time.sleep(0.1)
