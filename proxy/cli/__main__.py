"""``python -m proxy.cli``: the ``prefixgate`` command."""

from __future__ import annotations

import sys

from proxy.cli import main

sys.exit(main())
