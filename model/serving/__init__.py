"""Serving many requests: the slotted KV cache and its batched decode, the iteration-level scheduler, what a
step costs, and the measurements of serve-bench, profile and the Serving page. No argparse: the command line
(model/tools/) and the pages call it."""
