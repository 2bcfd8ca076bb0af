"""Decode Lab: navigation over app_pages/ and the sidebar (language, model, device).

The page scripts are not in a folder named pages/: Streamlit treats such a folder as an old-style
multipage app and, on a fresh server, runs a deep link like /decode without this file (no sidebar,
no session defaults) until some visitor has opened the home page.
"""

import shutil
from urllib.parse import unquote, urlsplit

import streamlit as st
from streamlit import config

import ui.preload  # noqa: F401  (first: what the pages draw with is imported before any page runs)
from model.weights.catalog import BUNDLED, FETCHED, list_models, settings
from ui.classroom import init_presenter, presenter, presenter_style, presenter_toggle
from ui.i18n import init_language, labels, lang, t
from ui.pages import DEFAULT_PAGE, PAGES, page
from ui.state import init_state, on_model_change
from ui.widgets import CSS, choice, md_escape, warn_before_leaving

init_presenter()
# presenter mode folds the sidebar away (its arrow brings it back)
st.set_page_config(page_title="Decode Lab", page_icon="assets/favicon.png", layout="wide",
                   initial_sidebar_state="collapsed" if presenter() else "auto")
# the pages' shared style sheet, once per run (it also trims the space above the title for 720-pixel projectors)
st.html(CSS)
init_language()
init_state()

LANG_NAMES = {"vi": "Tiếng Việt", "en": "English"}
CATALOG = settings()
# the listed models (bundled, fetched, DECODE_LAB_MODELS_DIR), this session's checkpoints from the Train page,
# then any folder or hub id where the operator allows them
MODELS = (list_models(CATALOG.models_dir) + list(st.session_state.get("session_checkpoints", {}))
          + (["custom"] if CATALOG.allow_paths else []))
# a CUDA option only where an NVIDIA driver exists; asking torch would slow the map page's first paint
DEVICES = ("auto", "cpu", "cuda") if shutil.which("nvidia-smi") else ("auto", "cpu")

with st.sidebar:
    # the value sent with every run, as ui/widgets.choice does: a browser that missed the run which set it (?lang=en)
    # would otherwise show the radio's default, Vietnamese, and send it back with the next click
    st.session_state.lang = lang()
    st.radio(t("sidebar.language"), list(LANG_NAMES), format_func=LANG_NAMES.get, key="lang", horizontal=True)
    presenter_toggle()
    model_labels = labels("model.", [m for m in MODELS if m in BUNDLED or m in FETCHED or m == "custom"])
    model_labels |= {m: t("model.checkpoint", name=m) for m in st.session_state.get("session_checkpoints", {})}
    choice(st.selectbox, t("sidebar.model"), MODELS, key="model_name", format_func=lambda m: model_labels.get(m, m),
           on_change=on_model_change)
    if st.session_state.model_name == "custom":
        st.text_input(t("sidebar.model_path"), key="model_path", help=t("sidebar.model_path_help"),
                      on_change=on_model_change)
        st.checkbox(t("sidebar.allow_download"), key="allow_download", help=t("sidebar.allow_download_help"))
    choice(st.selectbox, t("sidebar.device"), DEVICES, key="device", format_func=labels("device.", DEVICES).get)
    for fetched in FETCHED:
        if fetched not in MODELS:
            st.caption(t(f"model.{fetched}_missing"))
st.query_params["lang"] = lang()
warn_before_leaving(st.session_state.generation is not None)
presenter_style()


def asked_address() -> str:
    """The address the browser asked for, below the app's base path: "" for /, "decode" for /decode."""
    url = st.context.url  # the browser's, without its query
    if not url:
        return ""
    parts = unquote(urlsplit(url).path).strip("/").split("/")
    base = [part for part in config.get_option("server.baseUrlPath").split("/") if part]
    return "/".join(parts[len(base):] if parts[:len(base)] == base else parts)


# the map lives at /, and answers /map too; an address the app does not have (one segment: Streamlit takes no
# nested ones) opens the map as well, with a sentence in the session's language instead of Streamlit's English
# "Page not found"
asked = asked_address()
unknown = asked not in {"", *(p.url for p in PAGES)} and "/" not in asked
map_spec = page(DEFAULT_PAGE)
pages = [st.Page(p.path, title=t(p.title_key), icon=p.icon, url_path="" if p is map_spec else p.url,
                 default=p is map_spec) for p in PAGES]
pages += [st.Page(map_spec.path, title=t(map_spec.title_key), icon=map_spec.icon, url_path=address,
                  visibility="hidden") for address in [map_spec.url] + ([asked] if unknown else [])]
shown = st.navigation(pages, expanded=True)  # every page in the sidebar: past 12 Streamlit folds some under "View more"
if unknown and shown.url_path == asked:
    st.info(t("nav.not_found", path=md_escape("/" + asked)))
shown.run()
# the page ran to its end: a whole-page run a fragment asked for is done (ui.reruns.rerun_whole_page)
st.session_state.whole_page_due = False
