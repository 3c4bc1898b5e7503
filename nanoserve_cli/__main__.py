"""`python -m nanoserve_cli ...` is `nanoserve ...`."""
import sys

from nanoserve_cli.cli import main

sys.exit(main())
