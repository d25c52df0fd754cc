"""`python -m specdecode.cli ...` = `specdecode ...`."""
import sys

from specdecode.cli.main import main

sys.exit(main())
