"""What every test session needs, however it was started.

A process a shell without job control starts in the background (`pytest ... &`, as
scripts/test.sh starts its parts) ignores SIGINT, and so does every process it starts:
`cortex up`, which keeps ignoring a stop signal it was started ignoring (as under nohup), then
never sees the Ctrl-C a test sends it. The session takes SIGINT back, so the processes it
starts begin with the default.
"""

from __future__ import annotations

import signal

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
