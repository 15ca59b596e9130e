"""``python -m hydratrain.plan [OVERRIDES]``: the memory plan of a launch (:func:`hydratrain.plan_cli.main`). A
module of its own, so that the planner does not import its command line, which imports the planner."""
import sys

from hydratrain.plan_cli import main

if __name__ == "__main__":
    sys.exit(main())
