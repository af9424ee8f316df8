"""Planted: writes what a script sees of its environment to the file named by argv[1]."""

import json
import os
import sys

with open(sys.argv[1], "w") as f:
    json.dump({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "cwd": os.getcwd()}, f)
