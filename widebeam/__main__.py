import sys

from widebeam.cli import main

sys.exit(main())
