"""Sessions without browsers for the load tests and the benchmarks: a client of Streamlit's websocket protocol."""
