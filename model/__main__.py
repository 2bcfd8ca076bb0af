from model.tools.cli import main

if __name__ == "__main__":  # not again in a spawned worker (disaggregated.py), which imports this module first
    raise SystemExit(main())
