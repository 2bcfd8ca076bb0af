"""Decode Lab: navigation over app_pages/ and the sidebar (language, model, device).

The page scripts are not in a folder named pages/: Streamlit treats such a folder as an old-style
multipage app and, on a fresh server, runs a deep link like /decode without this file (no sidebar,
no session defaults) until some visitor has opened the home page.
"""

import shutil

import streamlit as st

from model.catalog import BUNDLED, list_models, settings
from ui.i18n import init_language, labels, lang, t
from ui.pages import DEFAULT_PAGE, PAGES
from ui.state import init_state, on_model_change

st.set_page_config(page_title="Decode Lab", page_icon=":material/neurology:", layout="wide")
# projector-friendly: less empty space above the title, so a 720-pixel-high screen shows more of each page
st.html("<style>[data-testid='stMainBlockContainer']{padding-top:2.5rem}</style>")
init_language()
init_state()

LANG_NAMES = {"vi": "Tiếng Việt", "en": "English"}
CATALOG = settings()
# bundled models, then those of DECODE_LAB_MODELS_DIR, then any folder or hub id unless the classroom switch is off
MODELS = list_models(CATALOG.models_dir) + (["custom"] if CATALOG.allow_paths else [])
# a CUDA option only where an NVIDIA driver exists; asking torch would slow the map page's first paint
DEVICES = ("auto", "cpu", "cuda") if shutil.which("nvidia-smi") else ("auto", "cpu")

with st.sidebar:
    st.radio(t("sidebar.language"), list(LANG_NAMES), format_func=LANG_NAMES.get, key="lang", horizontal=True)
    model_labels = labels("model.", [m for m in MODELS if m in BUNDLED or m == "custom"])
    st.selectbox(t("sidebar.model"), MODELS, key="model_name", format_func=lambda m: model_labels.get(m, m),
                 on_change=on_model_change)
    if st.session_state.model_name == "custom":
        st.text_input(t("sidebar.model_path"), key="model_path", help=t("sidebar.model_path_help"),
                      on_change=on_model_change)
        st.checkbox(t("sidebar.allow_download"), key="allow_download", help=t("sidebar.allow_download_help"))
    st.selectbox(t("sidebar.device"), DEVICES, key="device", format_func=labels("device.", DEVICES).get)
st.query_params["lang"] = lang()

pages = [st.Page(p.path, title=t(p.title_key), icon=p.icon, url_path=p.url, default=p.url == DEFAULT_PAGE)
         for p in PAGES]
st.navigation(pages).run()
