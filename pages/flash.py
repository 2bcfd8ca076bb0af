import streamlit as st

st.write("…")
