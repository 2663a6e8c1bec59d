"""``python -m scripts.train_demo``: see the package docstring."""

from .cli import main

raise SystemExit(main())
