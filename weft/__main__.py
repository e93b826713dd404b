from weft.cli import main

if __name__ == "__main__":  # tensor-parallel ranks are spawned processes: they import this module too
    raise SystemExit(main())
