"""Run files: the Decode trace and the speculative run, their writers, their reader and the re-run."""
