"""Imported first by app.py, so that a fresh server's first burst of sessions finds its libraries whole.

Twelve students pressing Run prefill within half a second of a server start used to get tracebacks: one
script thread was still importing pandas while plotly, in another, read the half-initialised module from
sys.modules (plotly looks there without taking Python's import lock). Importing them here, in the first script
run and before any page draws, makes every later thread wait for the finished modules. torch is not imported
here: the map page must paint without it, and threads that import it together wait on its import lock.
"""

import importlib

for _module in ("numpy", "pandas", "pyarrow", "plotly.io", "plotly.graph_objects"):
    importlib.import_module(_module)
