"""→ and ← on the Decode page, taken in the order pressed (issue 41).

Streamlit takes a button's shortcut only while the button is enabled, and a step's new state reaches the browser
when its run is drawn: → then ← pressed at step 0 found Back still disabled, and the ← was lost (the page ended at
step 1). Here the page's own listener takes the two keys first, queues them, and presses the key's button only once
the run of the click before has been drawn: the step view writes how many Next and Back clicks the session has
had (clicks_marker), and a click, by key or by mouse, waits for that number to grow. A key whose button is disabled
by then is dropped, as a click on it would be. A key pressed in a box, or on a widget that moves with the arrows
(a slider, tabs, a radio), is left to it, as Streamlit's shortcuts leave it; a held key repeats only as fast as
the steps are drawn.
"""

from __future__ import annotations

import streamlit as st

CONTAINER = "step_keys"  # the script's container, hidden by ui/widgets.py's CSS
WAIT_MS = 10_000  # a click whose run has not been drawn by then (a lost click): the keys queued after it are dropped

SCRIPT = """<script>
(() => {
  if (window.dlStepKeys) return;  // one listener for the browser tab, whatever the page draws again
  window.dlStepKeys = true;
  const BUTTONS = {ArrowRight: ".st-key-next button", ArrowLeft: ".st-key-back button"};
  const OWN_ARROWS = new Set(["slider", "tab", "radio", "option", "menuitem", "listbox", "combobox", "spinbutton",
                              "grid", "tree", "treeitem"]);
  const queue = [];
  let awaited = null, deadline = 0;
  const clicks = () => {
    const marker = document.querySelector(".dl-step-clicks");
    return marker ? Number(marker.dataset.clicks) : null;
  };
  const ownsArrows = (event) => event.composedPath().some((node) => node instanceof Element
    && (node.matches("input, textarea, select, [contenteditable='true']")
        || OWN_ARROWS.has(node.getAttribute("role"))));
  const busy = () => awaited !== null && clicks() !== null && clicks() < awaited && Date.now() < deadline;
  function pump() {
    if (busy()) { setTimeout(pump, 30); return; }
    if (awaited !== null && clicks() !== null && clicks() < awaited) queue.length = 0;
    awaited = null;
    while (queue.length) {
      const button = document.querySelector(queue.shift());
      if (button && !button.disabled) { button.click(); setTimeout(pump, 30); return; }
    }
  }
  window.addEventListener("click", (event) => {
    if (clicks() !== null && event.target instanceof Element && event.target.closest(Object.values(BUTTONS).join())) {
      awaited = clicks() + 1;
      deadline = Date.now() + WAIT_MS;
    }
  }, true);
  window.addEventListener("keydown", (event) => {
    const button = BUTTONS[event.key];
    if (!button || event.altKey || event.ctrlKey || event.metaKey || event.shiftKey || clicks() === null
        || ownsArrows(event)) return;
    event.preventDefault();
    event.stopImmediatePropagation();  // Streamlit's own shortcut would press the button at once, or drop the key
    if (event.repeat && (queue.length || busy())) return;
    queue.push(button);
    pump();
  }, true);
})();
</script>""".replace("WAIT_MS", str(WAIT_MS))


def queue_step_keys() -> None:
    """Put the listener on the page (it installs itself once per browser tab)."""
    with st.container(key=CONTAINER):
        st.html(SCRIPT, unsafe_allow_javascript=True)


def count_click(callback):
    """A Next or Back callback that first counts the click, for clicks_marker."""
    def counted() -> None:
        st.session_state.step_clicks += 1
        callback()
    return counted


def clicks_marker() -> str:
    """The session's count of Next and Back clicks, drawn in the step view: the listener waits for it to grow."""
    return f'<span class="dl-step-clicks" data-clicks="{int(st.session_state.step_clicks)}" hidden></span>'
