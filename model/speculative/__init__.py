"""Speculative decoding, the algorithm alone: the acceptance arithmetic (rules), who proposes (drafts), and the
rounds of a run with its speed against plain decoding (decoding); above the engine, below the command line."""
