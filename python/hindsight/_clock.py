"""When importing hindsight began and what it took: the recording's own
start-up cost, which a recording charges to its overhead budget. Imported
first by ``hindsight/__init__``."""

from __future__ import annotations

import time

STARTED = time.perf_counter()
#: Seconds `import hindsight` took; set once the package is imported.
import_seconds = 0.0


def imported() -> None:
    global import_seconds
    import_seconds = time.perf_counter() - STARTED
