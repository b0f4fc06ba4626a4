"""The serving half of the stream demo (`stream_wide_deep.py demo --serve`): once the job has a
checkpoint, shardrec-export writes the model's SavedModel and shardrec-serve serves it on localhost,
following the job's model directory; a client asks every second, over TF Serving's REST API, for
the click probability of an event with an id the stream has not taught the model yet (NEW_ID, which
the producer starts sending as clicks once the client had its first answer), and prints it with the version that
answered: the prediction moves as deltas arrive."""
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

import criteo_synth

NEW_ID = (1 << 32) * 0 + 4_000_000_000  # in field 0's key range, never drawn by criteo_synth (ids < 2**32)
HERE = os.path.dirname(os.path.abspath(__file__))


def with_new_id(data, share=0.25):
    """A `share` of the events get NEW_ID in field 0 and a click: what the stream teaches."""
    marked = np.arange(len(data["label"])) % int(round(1 / share)) == 0
    data["cat"][marked, 0] = NEW_ID
    data["label"][marked] = 1.0
    return data


def _wait_for_checkpoint(model_dir, trainer, timeout=300):
    import tensorflow as tf

    deadline = time.time() + timeout
    while time.time() < deadline and trainer.poll() is None:
        latest = tf.train.latest_checkpoint(model_dir)
        if latest:
            return latest
        time.sleep(0.5)
    return None


def start(model_dir, work, trainer, seed):
    """Exports the job's first checkpoint and starts shardrec-serve on it: (server process, url),
    or None when the job ended before saving."""
    checkpoint = _wait_for_checkpoint(model_dir, trainer)
    if checkpoint is None:
        return None
    bin_dir = os.path.dirname(sys.executable)
    export = os.path.join(work, "export")
    subprocess.run([os.path.join(bin_dir, "shardrec-export"), checkpoint, "--out", export, "--overwrite",
                    "--model-fn", os.path.join(HERE, "wide_deep.py:serving_model"),
                    "--feature", f"cat=int64[-1,{criteo_synth.NUM_CAT}]",
                    "--feature", f"dense=float32[-1,{criteo_synth.NUM_DENSE}]"],
                   check=True, stdout=subprocess.DEVNULL)
    server = subprocess.Popen([os.path.join(bin_dir, "shardrec-serve"), export, "--follow", model_dir, "--port", "0",
                               "--model-name", "wide_deep"], stdout=subprocess.PIPE, text=True)
    url = server.stdout.readline().strip().rsplit(" ", 1)[-1]
    threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()
    print(f"[demo] shardrec-serve at {url}/v1/models/wide_deep, following {model_dir}", flush=True)
    return server, url


class Client(threading.Thread):
    """Asks for NEW_ID's click probability every second; keeps (seconds, version, probability)."""

    def __init__(self, url, seed, new_id_flag):
        super().__init__(daemon=True)
        event = criteo_synth.make_dataset(1, seed=seed, sample_seed=[seed, 7])
        cat = event["cat"][0].tolist()
        cat[0] = NEW_ID
        self.body = json.dumps({"instances": [{"cat": cat, "dense": event["dense"][0].tolist()}]}).encode()
        self.url, self.seen, self._done = f"{url}/v1/models/wide_deep:predict", [], threading.Event()
        self.started, self.new_id_flag = time.time(), new_id_flag

    def ask(self):
        request = urllib.request.Request(self.url, self.body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as r:
            return int(r.headers["X-Model-Version"]), json.load(r)["predictions"][0]

    def run(self):
        while not self._done.wait(1.0):
            try:
                version, prob = self.ask()
            except OSError:
                continue
            at = time.time() - self.started
            if not self.seen or self.seen[-1][1] != version:
                print(f"[client] {at:5.1f} s: version {version} predicts {prob:.7f} for an event with the new id",
                      flush=True)
            self.seen.append((at, version, prob))
            if not os.path.exists(self.new_id_flag):
                print("[client] the producer now sends the new id, as clicks", flush=True)
                open(self.new_id_flag, "w").close()

    def stop(self):
        self._done.set()
        self.join(timeout=10)


def _final_step(model_dir):
    import tensorflow as tf

    latest = tf.train.latest_checkpoint(model_dir)
    return int(latest.rsplit("-", 1)[1]) if latest else None


def serve_until_done(trainer, model_dir, work, seed):
    """Serves and asks while `trainer` (a Popen with stdout piped) runs; once it ended and the
    server serves its last checkpoint, stops both. Returns (the trainer's output, a summary line)."""
    out = []
    drain = threading.Thread(target=lambda: out.extend(trainer.stdout), daemon=True)
    drain.start()
    started = start(model_dir, work, trainer, seed)
    if started is None:
        trainer.wait()
        drain.join()
        return "".join(out), "SERVE-DEMO no checkpoint was saved"
    server, url = started
    client = Client(url, seed, os.path.join(work, "new-id"))
    client.start()
    trainer.wait()
    drain.join()
    final, deadline = _final_step(model_dir), time.time() + 60
    while time.time() < deadline and (not client.seen or client.seen[-1][1] != final):
        time.sleep(0.5)
    client.stop()
    server.terminate()
    server.wait(timeout=30)
    seen = client.seen
    versions = sorted({v for _, v, _ in seen})
    summary = (f"SERVE-DEMO versions={len(versions)} last_version={versions[-1] if versions else None} "
               f"final_checkpoint={final} new_id_first={seen[0][2] if seen else float('nan')!r} "
               f"new_id_last={seen[-1][2] if seen else float('nan')!r}")
    return "".join(out), summary
