"""init(), then the script ends leaving a thread of its own that never ends (not a daemon): Python's
exit waits for it, and the exit watch must say so and end the job."""
import threading

import tensorflow as tf

from mx_rec.util.initialize import init

tf.compat.v1.disable_eager_execution()
init()
threading.Thread(target=threading.Event().wait, name="a-thread-that-never-ends").start()
print("SCRIPT-DONE", flush=True)
