import sys

from splitflash.cli.main import main

sys.exit(main())
