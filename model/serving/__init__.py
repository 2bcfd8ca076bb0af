"""Serving many requests: the one engine (its scheduler, its two KV memories, its runner, what moves blocks in or
out), what a step costs, and the measurements of serve-bench, profile and the serving pages. No argparse: the
command line (model/tools/) and the pages call it."""
