"""ui/state.py's defaults against what the model room and the benchmarks assume of them."""

from model.engine.generate import DEFAULT_NEW_TOKENS
from model.engine.sampling import SamplingSettings
from ui.state import DEFAULTS


def test_the_decode_pages_defaults_are_greedy_and_the_command_lines_length():
    """benchmarks/classroom_load.py replays a class's first clicks with SamplingSettings() and DEFAULT_NEW_TOKENS (it
    imports nothing of ui/): red if the page's defaults move away from them."""
    settings = SamplingSettings()
    assert (DEFAULTS["temperature"], DEFAULTS["top_p"], DEFAULTS["seed"]) == (settings.temperature, settings.top_p,
                                                                               settings.seed)
    assert not DEFAULTS["top_k_on"] and settings.top_k is None
    assert DEFAULTS["max_new_tokens"] == DEFAULT_NEW_TOKENS
