"""The top of the house: the command line (python -m model …) and the benchmarks; nothing below imports them."""
