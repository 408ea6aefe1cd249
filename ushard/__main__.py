import sys

from ushard.cli import main

sys.exit(main())
