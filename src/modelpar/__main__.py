"""``python -m modelpar``: the command line of :mod:`modelpar._cli`."""

from modelpar._cli import main

raise SystemExit(main())
