from kprof.cli import main

main()
