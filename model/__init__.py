"""Decode Lab's engine and tools, no Streamlit. Imports run one way: tools → training, speculative → engine →
weights; errors.py and texts.py (the error codes and the one text lookup) sit under them all."""
