"""Home: the 22-cell map from training data to inference. No torch here: the first paint must not wait."""

import streamlit as st

from ui.classroom import key_figure, why
from ui.i18n import lang, t
from ui.map_view import BAND_CHOICES, band_choice_label, load_cells, map_html, map_labels
from ui.state import keep_across_pages

keep_across_pages({"map_band": "all", "map_hide_overlay": False})
st.header(t("map.map_title"))

with st.container(horizontal=True, vertical_alignment="center", key="map_controls"):
    band = st.segmented_control(
        t("map.filter"),
        BAND_CHOICES,
        key="map_band",
        required=True,
        format_func=band_choice_label(t),
        label_visibility="collapsed",
    )
    hide_overlay = st.toggle(t("map.hide_overlay"), key="map_hide_overlay")

with key_figure():
    st.html(map_html(load_cells(), lang(), band or "all", hide_overlay, map_labels(t)), unsafe_allow_javascript=True)

with why("map"):
    st.markdown(f"{t('map.hint')} {t('map.live_legend')}")
    st.markdown(t("map.reading_order"))
