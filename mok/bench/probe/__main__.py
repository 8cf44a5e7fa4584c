"""``python -m mok.bench.probe`` (same as ``python -m mok.bench probe``)."""

import sys

from mok.bench.probe.run import main

sys.exit(main())
