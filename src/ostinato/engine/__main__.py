import sys

from ostinato.engine.cli.main import main

sys.exit(main())
