"""Suite-wide settings.

Hypothesis: no per-example deadline (a busy 2-core machine makes timings meaningless), and under
CI a fixed seed, so a run there checks the same examples every time instead of finding a new
edge case at random on the day something else is being landed.
"""

import os

from hypothesis import settings

settings.register_profile("tether", deadline=None)
settings.register_profile("tether-ci", deadline=None, derandomize=True)
settings.load_profile("tether-ci" if os.environ.get("CI") else "tether")
