"""`python -m planner` runs the `ckpt-planner` command line."""

from planner.cli import main

raise SystemExit(main())
