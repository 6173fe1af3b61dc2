"""`python -m hindsight ...`: the same as the `hindsight` command."""

from hindsight.cli import main

raise SystemExit(main())
