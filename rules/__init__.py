"""kprof's pattern -> fix rules (shipped as `kprof.rules`)."""
