import sys


def main() -> int:
    """`serve` goes to the API server's room (server/), every other command to the command line (model/tools)."""
    if sys.argv[1:2] == ["serve"]:
        from server.cli import main as serve
        return serve(sys.argv[2:])
    from model.tools.cli import main as commands
    return commands()


if __name__ == "__main__":  # not again in a spawned worker (disaggregated.py), which imports this module first
    raise SystemExit(main())
