"""`python -m portattn`: the support report (same as `portattn-report`)."""
import sys

from .report import main

sys.exit(main())
