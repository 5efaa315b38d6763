"""``python -m aqr`` runs the command-line interface."""

from aqr.cli import main

raise SystemExit(main())
