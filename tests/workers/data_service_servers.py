"""A tf.data service for the tests, in a process of its own: a dispatcher and ``argv[1]``
(default 2) worker servers on this host. Prints the dispatcher's ``host:port`` on its first
line, then serves until it is killed.

Why not in the pytest process: stopping a server is a TensorFlow call that holds the GIL, and
in the suite it once held it for about 50 s (the module's teardown, after the two-process
job), freezing the whole pytest process, its timeouts included. A process of its own is
SIGKILLed in no time, as a real service's host would be.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

svc = tf.data.experimental.service
dispatcher = svc.DispatchServer(svc.DispatcherConfig(port=0))
address = dispatcher.target.rpartition("://")[2]
workers = [svc.WorkerServer(svc.WorkerConfig(dispatcher_address=address))
           for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2)]
print(address, flush=True)
dispatcher.join()
