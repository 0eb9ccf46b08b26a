"""`python -m ringllm` is the `ringllm` command."""
import sys

from ringllm.cli import main

sys.exit(main())
