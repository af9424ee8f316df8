"""kprof's version, at the base of the package so every stage can name it."""

__version__ = "0.1.0"
