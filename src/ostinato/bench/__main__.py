import sys

from ostinato.bench import main

sys.exit(main())
