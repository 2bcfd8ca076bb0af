"""The models the pages run: shared by every session of the process (loaded once, never changed; a session owns its
run), the sidebar's choice among them, and a page's start on it."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import streamlit as st

import ui.process  # noqa: F401  (the process set-up, before the first model runs: torch's threads)
from model.engine import kernels
from model.engine.loading import load_model, load_session_checkpoint, model_key
from model.engine.lowbit import with_weights
from model.engine.runtime import LoadedModel
from model.errors import InputError
from ui.errors import error_sentence
from ui.i18n import t

log = logging.getLogger(__name__)

MAX_SHARED_MODELS = 4

# The shared models live here, not in st.cache_resource: any visitor's websocket can send Streamlit's
# clear-cache message, which would unload every model for every session.
_models: OrderedDict[tuple[str, str], LoadedModel] = OrderedDict()
_models_lock = threading.Lock()
_loading_locks: dict[tuple[str, str], threading.Lock] = {}


def shared_model(name: str, device: str, allow_download: bool = False) -> LoadedModel:
    """The model, loaded by the first session that asks; the others wait for it instead of loading it again."""
    key = model_key(name, device)
    with _models_lock:
        lock = _loading_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in _models:
            loaded = load_model(name, device, allow_download)
            with _models_lock:
                _models[key] = loaded
                while len(_models) > MAX_SHARED_MODELS:
                    _models.popitem(last=False)  # sessions running it keep their reference until they switch
        with _models_lock:
            _models.move_to_end(key)
        return _models[key]


_converted: OrderedDict[tuple[str, str, str], LoadedModel] = OrderedDict()


def shared_model_in(model: LoadedModel, dtype: str, tiles: bool = False) -> LoadedModel:
    """The shared model with its weights in `dtype` (model/engine/lowbit.py), with `tiles` its products of many rows
    on the CPU's AMX tiles, converted once per process and kept beside the shared models, at most MAX_SHARED_MODELS
    of them; float32 without tiles is the model itself."""
    key = (model.info.name, model.info.device, dtype, tiles)
    with _models_lock:
        if key not in _converted:
            _converted[key] = with_weights(model, dtype, tiles=tiles)
            while len(_converted) > MAX_SHARED_MODELS:
                _converted.popitem(last=False)
        _converted.move_to_end(key)
        return _converted[key]


def chosen_model() -> tuple[str, str, bool]:
    """(name or path, device, downloads allowed) as the sidebar says."""
    s = st.session_state
    if s.model_name == "custom":
        return s.model_path.strip(), s.device, bool(s.allow_download)
    return s.model_name, s.device, False


def session_checkpoint_model(name: str, device: str) -> LoadedModel:
    """A checkpoint this session saved on the Train page, loaded once for this session only: no other session
    can choose it, so it does not take a place among the shared models."""
    folder = st.session_state.session_checkpoints[name]
    held = st.session_state.get("checkpoint_model")
    if held is None or held[:2] != (folder, device):
        st.session_state.checkpoint_model = (folder, device, load_session_checkpoint(name, folder, device))
    return st.session_state.checkpoint_model[2]


def sidebar_model() -> LoadedModel:
    """The sidebar's model on the sidebar's device; InputError says why it cannot load."""
    name, device, allow_download = chosen_model()
    if name in st.session_state.get("session_checkpoints", {}):
        return session_checkpoint_model(name, device)
    return shared_model(name, device, allow_download)


def page_start(page: str, intro: bool = True) -> LoadedModel:
    """A live page's title and intro (intro=False: the page says it itself, below its key figure), then the
    sidebar's model; the page stops, with the reason, without one."""
    st.title(t(page + ".title"))
    if intro:
        st.caption(t(page + ".intro"))
    model = current_model()
    if model is None:
        st.stop()
    return model


def loading_sentence() -> str:
    """The spinner's sentence while a model loads; where this load may first build the decode kernels, it says so
    and for at most how long (a compiler that hangs holds the first load of the process that long)."""
    if not kernels.build_ahead():
        return t("state.loading_model")
    return t("state.loading_model") + " " + t("model.building_kernels", seconds=kernels.BUILD_SECONDS)


def current_model() -> LoadedModel | None:
    """The sidebar's model on the sidebar's device, or None after saying why it cannot load."""
    try:
        with st.spinner(loading_sentence()):
            return sidebar_model()
    except InputError as bad:
        st.error(error_sentence(bad))
    except Exception:
        log.exception("loading %r failed", chosen_model())
        st.error(t("error.model_unexpected"))
    return None
