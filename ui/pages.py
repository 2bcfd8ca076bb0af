"""The one registry of the app's pages: script, url, title key, icon, and the map cells each one shows live.

app.py builds its navigation from it, the map draws its live links from it, pages link to each other
through it, and the tests read it. No torch and no Streamlit here: the map page imports it at first paint.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PageSpec:
    url: str        # st.Page url_path, and the page's name in "nav.<url>" / "<url>.title" texts
    path: str       # the script under app_pages/
    icon: str
    # map cell id -> anchor of the part of the page that shows it ("" = the page as a whole)
    cells: dict[str, str] = field(default_factory=dict)

    @property
    def title_key(self) -> str:
        return "nav." + self.url


PAGES: tuple[PageSpec, ...] = (
    PageSpec("map", "app_pages/map.py", ":material/map:"),
    PageSpec("prefill", "app_pages/prefill.py", ":material/input:",
             {"1B": "token-tax", "2B": "", "5A": "", "5B": ""}),
    PageSpec("decode", "app_pages/decode.py", ":material/replay:", {"2D": "", "5B": "", "5C": ""}),
    PageSpec("replay", "app_pages/replay.py", ":material/history:"),
    PageSpec("cache", "app_pages/cache.py", ":material/balance:", {"5B": ""}),
    PageSpec("flash", "app_pages/flash.py", ":material/bolt:", {"2B": ""}),
    PageSpec("speculative", "app_pages/speculative.py", ":material/fast_forward:", {"5B": ""}),
    PageSpec("serving", "app_pages/serving.py", ":material/dns:", {"5B": "", "5C": ""}),
    PageSpec("paged", "app_pages/paged.py", ":material/grid_view:", {"5B": "", "5C": ""}),
    PageSpec("tiers", "app_pages/tiers.py", ":material/layers:", {"5B": "", "5C": ""}),
    PageSpec("kv", "app_pages/kv.py", ":material/compress:", {"5B": "", "5C": ""}),
    PageSpec("live", "app_pages/live.py", ":material/podcasts:", {"5B": "", "5C": ""}),
    PageSpec("train", "app_pages/train.py", ":material/model_training:",
             {"1A": "cell-1a", "1B": "cell-1b", "1C": "cell-1c", "2A": "cell-2", "2B": "cell-2", "2C": "cell-2",
              "2D": "cell-2", "3A": "cell-3a", "3B": "cell-3b", "3C": "cell-3c", "3D": "cell-3d", "3E": "cell-3e",
              "4A": "cell-4a", "4B": "cell-4b", "4C": "cell-4c"}),
    PageSpec("finetune", "app_pages/finetune.py", ":material/tune:",
             {"4D": "cell-4d", "4E": "cell-4e", "4F": "cell-4f", "4G": "cell-4g"}),
)
# the Fine-tune page's tabs, in the map's order (4D, 4E, 4F, 4G), and the anchor of each one's heading: only the
# open tab is drawn, so a link to a cell there opens its tab first (the map's links, the page's "tab" query)
FINETUNE_TABS = {"sft": "cell-4d", "lora": "cell-4e", "rlhf": "cell-4f", "dpo": "cell-4g"}
DEFAULT_PAGE = "map"


def page(url: str) -> PageSpec:
    return next(p for p in PAGES if p.url == url)


def tab_of(anchor: str) -> str | None:
    """The Fine-tune tab that holds `anchor`, None for an anchor on no tab."""
    return next((tab for tab, a in FINETUNE_TABS.items() if a == anchor), None)


def live_views(cell_id: str) -> list[tuple[PageSpec, str]]:
    """(page, anchor) of every live view of a map cell, in navigation order."""
    return [(p, p.cells[cell_id]) for p in PAGES if cell_id in p.cells]
