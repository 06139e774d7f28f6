"""What every test session needs, however it was started.

A process started in the background by a shell without job control (`pytest ... &`, as
scripts/test.sh starts its parts) ignores SIGINT, one started under nohup ignores SIGHUP, and
so does every process they start: `cortex up`, which keeps ignoring a stop signal it was
started ignoring (as it should under nohup), then never sees the Ctrl-C or hang-up a test
sends it. The session takes the stop signals back, so the processes it starts begin with the
defaults.
"""

from __future__ import annotations

import signal

for _signum, _default in ((signal.SIGINT, signal.default_int_handler),
                          (signal.SIGHUP, signal.SIG_DFL), (signal.SIGTERM, signal.SIG_DFL)):
    if signal.getsignal(_signum) is signal.SIG_IGN:
        signal.signal(_signum, _default)
