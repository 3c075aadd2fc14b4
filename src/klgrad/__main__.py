import sys

from klgrad.cli import main

sys.exit(main())
