import sys

# A spawned child process (the engine core, a tensor-parallel rank) imports this module again as `__mp_main__`;
# the guard keeps it from importing the whole command line (~0.5 s of imports it never uses).
if __name__ == "__main__":
    from vlserve.cli import main

    sys.exit(main())
