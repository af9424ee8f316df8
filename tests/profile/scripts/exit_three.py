"""Planted: exits with status 3 (e.g. a launcher reporting a failed run)."""

import sys

if __name__ == "__main__":
    sys.exit(3)
