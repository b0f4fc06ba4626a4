"""`make test`: the suite in two phases, then one total and the 25 slowest tests of both.

Most tests spend much of their time waiting (TensorFlow's import in each rank, a timeout a test
set itself, an mpiexec winding down): on the 2-core machines here one run leaves the cores idle
about 40% of the time. Phase 1 runs the tests that hold no wall-clock judgement on two pytest
workers (pytest-xdist, a file's tests on one worker, so that its trained-checkpoint fixtures are
built once). Phase 2 runs, alone, the tests marked serial (tests/conftest.py): those that judge
time (hang and heartbeat detection, exchange deadlines, elastic hosts) or compare /dev/shm before
and after a job.

    python scripts/run_tests.py [PYTEST ARGS...]     # e.g. -k lookup, -m quick, tests/test_tiers.py

SHARDREC_TEST_WORKERS sets phase 1's workers (1: no xdist); SHARDREC_TEST_REPORTS=DIR keeps both
phases' JUnit reports there. The exit status is the first failing phase's (pytest's), and 5 when neither phase ran a test. A
phase that selected no test is not a failure when the other ran some.
"""
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.environ.get("SHARDREC_TEST_WORKERS", "2")
NO_TESTS = 5
SLOWEST = 25


def run_phase(phase: str, args: list, report: str) -> int:
    parallel = ["-n", WORKERS, "--dist", "loadfile"] if phase == "parallel" and WORKERS != "1" else ["-p", "no:xdist"]
    cmd = [sys.executable, "-m", "pytest", f"--phase={phase}", f"--junitxml={report}", *parallel, *args]
    print(f"== phase {phase}: {' '.join(cmd[1:])}", flush=True)
    started = time.monotonic()
    rc = subprocess.call(cmd, cwd=ROOT)
    print(f"== phase {phase}: exit {rc} after {time.monotonic() - started:.0f} s", flush=True)
    return rc


def read_report(path: str):
    """(counts, [(seconds, test id)]) of one phase's JUnit XML; empty when the phase wrote none."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    times = []
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return counts, times
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        counts[outcome] += 1
        times.append((float(case.get("time", 0)), f"{case.get('classname', '')}::{case.get('name', '')}"))
    return counts, times


def main(args: list) -> int:
    started = time.monotonic()
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    times, codes = [], []
    with tempfile.TemporaryDirectory(prefix="shardrec-tests-") as tmp:
        reports = os.environ.get("SHARDREC_TEST_REPORTS") or tmp  # a folder to keep the JUnit reports in
        os.makedirs(reports, exist_ok=True)
        for phase in ("parallel", "serial"):
            report = os.path.join(reports, f"{phase}.xml")
            codes.append(run_phase(phase, args, report))
            counts, phase_times = read_report(report)
            for k in totals:
                totals[k] += counts[k]
            times += phase_times
    print(f"\n== {SLOWEST} slowest tests (setup, call and teardown) ==")
    for seconds, name in sorted(times, reverse=True)[:SLOWEST]:
        print(f"{seconds:8.2f}s {name}")
    failing = [rc for rc in codes if rc not in (0, NO_TESTS)]
    rc = failing[0] if failing else (NO_TESTS if all(rc == NO_TESTS for rc in codes) else 0)
    print(f"\n== both phases in {(time.monotonic() - started) / 60:.1f} min, exit {rc}")
    line = f"{totals['passed']} passed, {totals['failed']} failed"
    print(f"total: {line}, {totals['skipped']} skipped" if totals["skipped"] else f"total: {line}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
